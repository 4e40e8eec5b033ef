-- Release a run lease only if this run still holds it (compare and delete). A run frees its slots only on a
-- 1 (coordinator/runs.py): a run whose task another run has taken over frees nothing of that run's.
-- KEYS[1] the task's lease
-- KEYS[2] its task hash
-- KEYS[3] the due list
-- ARGV[1] str: this run's token
-- ARGV[2] int: 1: also count the task's deliveries anew (a run handed back to the queue was not lost:
--   SUBQ_MAX_DELIVERIES counts losses), in this same step: a run that started since keeps its count
-- ARGV[3] str: the task's id to take off the due list as the lease is freed (a provider's wait, which its
--   timer ends), '' for none: never after a lease that lapsed, when its timer may have published it since
-- Returns 1 when released, or gone while this run is still the task's last (its lease lapsed, or this very
--   call ran before: its own resend); 0 when another run has started since.
local function released()
  if ARGV[2] == '1' then
    hash_set(KEYS[2], 'deliveries', 0)
  end
  return 1
end
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[3] ~= '' then
    redis.call('ZREM', KEYS[3], ARGV[3])
  end
  return released()
end
-- Gone: it lapsed, or this call was sent before and its reply lost (Sentinel's resend). The run is still the
-- task's last unless a start came since: each start writes its own token as `run_token` (start_run.lua).
if not held and hash_get(KEYS[2], 'run_token')[1] == ARGV[1] then
  return released()
end
return 0

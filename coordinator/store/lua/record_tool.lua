-- A tool call returned (or was answered without running): keep its result, count it on its
-- task, and write the run's step with it (flush_run), in one round trip. The result is kept
-- the moment the call returns, so a run resumed after its worker died replays it instead of
-- calling the tool again; the step's checks (the task's status, the topmost budget reached)
-- serve as the check before the run's next model request. flush_run's now ends a call that ran:
-- the call is kept as a span (`tool_calls`, the task's newest 100).
-- KEYS[1] the task's tool-results hash
-- KEYS[2..] flush_run's KEYS
-- ARGV[1] str: tool call id
-- ARGV[2] str: the result (JSON) to keep, or '' for a call answered without running (kept empty)
-- ARGV[3] str: the counter field of the outcome (`tool:<tool>:<outcome>`)
-- ARGV[4] str: the time field (`tool:<tool>:ms`)
-- ARGV[5] int: the call's ms (0: not added)
-- ARGV[6..] flush_run's ARGV
-- Returns flush_run's reply: {1, status, exhausted, resent, refused}, or {0} when the lease is not this
--   run's (nothing written: another run owns the task and answers the call itself).
local flush_keys, flush_argv = {}, {}
for i = 2, #KEYS do
  flush_keys[#flush_keys + 1] = KEYS[i]
end
for i = 6, #ARGV do
  flush_argv[#flush_argv + 1] = ARGV[i]
end
-- A call that ran (not one denied, or interrupted by its worker's death) is a span of its task's
-- timeline; the spans are read with what the flush reads of the task, in one HMGET.
local tool, outcome = string.match(ARGV[3], '^tool:(.*):([^:]*)$')
local ran = outcome ~= nil and outcome ~= 'denied' and outcome ~= 'interrupted'
hash_prefetch(KEYS[3], fields_and(USAGE_FIELDS, ran and {'tool_calls', 'last_step'} or {'last_step'}))
-- This very step again (its reply lost, sent again as it was)? Its own mark, whether or not the run had
-- anything else to write with it (flush_run marks only a step that writes some of its own).
local step = run_step(flush_argv[1], flush_argv[3])
local resent = hash_get(KEYS[3], 'last_step')[1] == step
local reply = flush_run(flush_keys, flush_argv)
if reply[1] == 0 or resent then
  return reply  -- not this run's; or this very step again, its result and counts written the first time
end
hash_set(KEYS[3], 'last_step', step)
local counted = false
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  -- Answered without running (denied, interrupted): kept as an empty answer, so a later resume of the task (its
  -- worker died before the request that carries the answer was saved) answers it again without counting it: each
  -- resume had counted the denial once more, and said it again in the task's messages.
  counted = redis.call('HSETNX', KEYS[1], ARGV[1], '') == 0
end
redis.call('EXPIRE', KEYS[1], flush_argv[2])
if not counted then
  -- The counters are fields no script reads through hashes.lua's cache: written directly.
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  local ms = tonumber(ARGV[5])
  if ms > 0 then
    redis.call('HINCRBY', KEYS[3], ARGV[4], ARGV[5])
  end
end
if ran then
  -- Its span ends now (the step's clock): the newest 100 are kept (coordinator/timeline.py,
  -- MAX_TOOL_CALLS); the counters above count every call.
  local kept = hash_get(KEYS[3], 'tool_calls')[1]
  local calls = (kept and kept ~= '') and cjson.decode(kept) or {}
  local end_ms = math.floor(tonumber(flush_argv[3]) * 1000 + 0.5)
  calls[#calls + 1] = {end_ms - tonumber(ARGV[5]), end_ms, tool, outcome}
  while #calls > 100 do
    table.remove(calls, 1)
  end
  hash_set(KEYS[3], 'tool_calls', cjson.encode(calls))
end
return reply

-- Decide a pending approval once: approve, deny, or expire. A second decision changes nothing.
-- Its `approval.decided` event goes into the tree's outbox in this same step (outbox_add).
-- KEYS[1] the approval hash
-- KEYS[2] the pending-approvals zset
-- KEYS[3] tree events stream
-- KEYS[4..6] the tree's outbox (outbox_add's KEYS)
-- ARGV[1] str: approval id
-- ARGV[2] str: new status (approved|denied|expired)
-- ARGV[3] str: feedback
-- ARGV[4] float: now
-- ARGV[5] int: events max length
-- ARGV[6] str: the prefix of the tree's task hashes
-- ARGV[7] str: the prefix of its approval hashes (the task's hash and its other approvals are named from
--   the approval's record, as start_run reads ancestors: a tree's keys share one prefix)
-- ARGV[8] str: who decided: the API key's name ('' for an expiry), written with the decision
-- ARGV[9] int: retention seconds
-- Returns 'ok' (also to this very decision sent again after it ran), or the approval's status when it was
--   not pending (or 'missing').
-- The decision that leaves the task no pending approval ends its wait: its timeline marks its
-- resume `queued` now (coordinator/timeline.py).
local was = redis.call('HMGET', KEYS[1], 'status', 'decided_at', 'decided_by', 'feedback')
local status = was[1]
if not status then
  return 'missing'
end
if status ~= 'pending' then
  if status == ARGV[2] and was[2] == ARGV[4] and was[3] == (ARGV[8] or '') and was[4] == ARGV[3] then
    return 'ok'  -- this very decision again (its reply was lost and the connection sent it again): it stands
  end
  return status
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'feedback', ARGV[3], 'decided_at', ARGV[4], 'decided_by', ARGV[8] or '')
redis.call('ZREM', KEYS[2], ARGV[1])
local task_id = redis.call('HGET', KEYS[1], 'task_id')
outbox_add({KEYS[4], KEYS[5], KEYS[6]}, {task_id, 'approval.decided', ARGV[4], ARGV[9], cjson.encode({
  approval_id = ARGV[1], tool = redis.call('HGET', KEYS[1], 'tool'), status = ARGV[2], feedback = ARGV[3],
  decided_by = ARGV[8]})})
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'type', 'approval', 'approval_id', ARGV[1],
  'task_id', task_id, 'status', ARGV[2])
if task_id and ARGV[6] then
  local task_key = ARGV[6] .. task_id
  local waiting = hash_get(task_key, 'waiting_approval_ids')[1]
  local still = false
  for _, other in ipairs(cjson.decode((waiting and waiting ~= '') and waiting or '[]')) do
    if other ~= ARGV[1] and redis.call('HGET', ARGV[7] .. other, 'status') == 'pending' then
      still = true
    end
  end
  if not still and hash_get(task_key, 'status')[1] then
    timeline_mark(task_key, ARGV[4], 'queued')
  end
end
return 'ok'

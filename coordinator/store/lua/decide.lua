-- Decide a pending approval once: approve, deny, or expire. A second decision changes nothing.
-- KEYS[1] the approval hash   KEYS[2] the pending-approvals zset   KEYS[3] tree events stream
-- ARGV[1] approval id   ARGV[2] new status (approved|denied|expired)   ARGV[3] feedback
-- ARGV[4] now   ARGV[5] events max length
-- Returns 'ok', or the approval's status when it was not pending (or 'missing').
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return 'missing'
end
if status ~= 'pending' then
  return status
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'feedback', ARGV[3], 'decided_at', ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'type', 'approval', 'approval_id', ARGV[1],
  'task_id', redis.call('HGET', KEYS[1], 'task_id'), 'status', ARGV[2])
return 'ok'

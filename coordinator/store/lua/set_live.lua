-- A task's live status, while the task has not ended: the tree's live hash and an event on its stream. A
-- status said after its task ended (a stop that landed between a run's release and the wait it says next) is
-- not written: the stop's status and event stay the task's last, in the hash and on the stream.
-- KEYS[1] task hash
-- KEYS[2] tree live hash
-- KEYS[3] tree events
-- ARGV[1] str: task id
-- ARGV[2] str: its live status JSON
-- ARGV[3] str: its state (the status's `state`)
-- ARGV[4] int: retention seconds
-- ARGV[5] int: events max length
-- Returns 1 when written, 0 when the task has ended or is gone (nothing written).
local status = redis.call('HGET', KEYS[1], 'status')
if not status or ENDED[status] then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[4])
-- (The stream this may make, a root parked at its first start, gets its retention from event_add.)
event_add(KEYS[3], ARGV[5], ARGV[4], 'type', 'live', 'task_id', ARGV[1], 'state', ARGV[3])
return 1

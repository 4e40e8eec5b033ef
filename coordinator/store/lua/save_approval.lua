-- Save a parked tool call's approval once: its record, on the pending list, and its `approval.requested`
-- event in the tree's outbox (outbox_add), in one step: a waiting approval is never without its notice.
-- The same approval saved again (its reply lost and the call sent again, Sentinel's retry) finds its
-- record and writes nothing, so its event and its webhooks go out once.
-- A task that has ended (a cancel landed between its run's last step and this save) gets nothing: the
-- cancel marks its tasks stopped before it expires their pending approvals, so a call saved before the
-- mark is expired by it, and one saved after would wait on a person, and notify one, for a run that is over.
-- Nor does a run that lost its lease (it stalled past its lapse, and a newer run of the task may have started):
-- its call would wait on a person, and notify one, for a run whose steps are fenced and which ends lost.
-- KEYS[1] the approval hash
-- KEYS[2] the pending-approvals zset
-- KEYS[3] the task hash of the run whose call waits
-- KEYS[4] its lease
-- KEYS[5..7] the tree's outbox (outbox_add's KEYS)
-- ARGV[1] str: approval id
-- ARGV[2] float: created at: the event's time and the pending list's score
-- ARGV[3] int: retention seconds
-- ARGV[4] str: the task whose tool call waits
-- ARGV[5] str: the event's own fields, a JSON object
-- ARGV[6] str: the token of the run that parks the call, which must hold the lease ('' for a save of no
--   run's)
-- ARGV[7..] each str: the record's fields and values, in pairs
-- Returns 1 when saved, 0 when it was saved before, -1 when its task has ended, -2 when the lease is not
--   the run's (nothing written).
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local status = redis.call('HGET', KEYS[3], 'status')
if ENDED[status] then
  return -1
end
if fenced(KEYS[4], ARGV[6]) then
  return -2
end
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
outbox_add({KEYS[5], KEYS[6], KEYS[7]}, {ARGV[4], 'approval.requested', ARGV[2], ARGV[3], ARGV[5]})
return 1

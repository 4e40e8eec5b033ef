-- Take a task whose run parked it on approvals off the due list while one of them is still pending,
-- except while a live run holds its lease. The decision that leaves none pending watches the task
-- again in its own step (decide.lua); one made before the parked run freed its lease published
-- nothing, and its watch stays until that run's release (which, told 0 here, publishes the resume)
-- or the reconciler publishes it. Read and removal are one step, so a decision made between the two
-- is never taken off with a wait it ended.
-- KEYS[1] the due list
-- KEYS[2] its lease
-- KEYS[3] its task hash
-- ARGV[1] str: task id
-- ARGV[2] str: the prefix of its tree's approval hashes (named from the task's own record, as decide.lua)
-- Returns 1 while one of its approvals is pending (taken off unless leased), 0 when none is (nothing
--   written).
if not approval_pending(redis.call('HGET', KEYS[3], 'waiting_approval_ids'), ARGV[2], nil) then
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1

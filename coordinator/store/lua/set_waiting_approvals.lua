-- The approvals a run parked, as its task's list of those its last run asked for (`waiting_approval_ids`:
-- what a decision, a start and the reconciler read to know whether a call of the task still waits), written
-- only while the run holds the task's lease: a run that stalled past its lapse leaves the list of a newer run
-- of the task as it is.
-- KEYS[1] the task's lease
-- KEYS[2] its task hash
-- ARGV[1] str: the token of the run that parked the calls ('' for a park of no run's)
-- ARGV[2] str: the approvals it parked, a JSON list
-- Returns 1 when written, 0 when the lease is not the run's (nothing written).
if fenced(KEYS[1], ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[2], 'waiting_approval_ids', ARGV[2])
return 1

-- A human-approved tool call starts: noted in the task's journal, so a run resumed after this worker dies knows
-- the call may have taken effect (it has no result yet) and does not take the approval as leave to run it
-- again. Only while the run holds the task's lease: a run that stalled past its lapse, whose task's newer run
-- read the journal without the note and may be running the call itself, learns here that it must not.
-- KEYS[1] the task's lease
-- KEYS[2] its tool results (the journal)
-- ARGV[1] str: the run's token
-- ARGV[2] str: the call's field (`started:<call id>`)
-- ARGV[3] int: retention seconds
-- Returns 1 when noted, 0 when the lease is not the run's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[2], '1')
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1

-- A run's request was answered: its task's wait for its provider, and the failed attempts of that request,
-- are over, while the run still holds the task's lease. A run fenced meanwhile (it stalled past its lapse,
-- and a newer run of the task may have parked for its provider since) clears nothing: the newer park's wait
-- stands, and with it the provider timer that wakes the task (coordinator/endpoints.py's `wake` acts only
-- while the wait is on record).
-- KEYS[1] lease
-- KEYS[2] task hash
-- ARGV[1] str: the run's token
-- Returns 1 when cleared, 0 when the lease is not this run's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('HDEL', KEYS[2], 'provider_wait_since_ms', 'provider_attempts')
return 1

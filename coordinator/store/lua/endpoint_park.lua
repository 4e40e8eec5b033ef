-- A run gives its worker back to wait for its provider: its task's timer, its place on the parked list of the
-- view it waits for, and when its wait began (kept on the task, so its `model_wait_out_s` counts from there; a
-- wait is not a loss, so SUBQ_MAX_DELIVERIES' count starts again). Only while the run holds the task's lease:
-- a run that stalled past its lapse would write its old wait's time, and a zero delivery count, onto the task
-- its newer run holds (whose next failed request would then give up early).
-- KEYS[1] the fleet's timers zset
-- KEYS[2] the view's parked list
-- KEYS[3] the task hash
-- KEYS[4] its lease
-- ARGV[1] str: the task's timer
-- ARGV[2] float: when it wakes (epoch s)
-- ARGV[3] str: task id
-- ARGV[4] int: how long the parked list is kept, seconds
-- ARGV[5] int: when its wait began, epoch ms
-- ARGV[6] str: the run's token ('' for a park of no run's: not checked)
-- ARGV[7] float: now (epoch s)
-- Returns 1 when parked, 0 when the lease is not the run's (nothing written).
if fenced(KEYS[4], ARGV[6]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
-- The parked whose wake time has passed leave the list first: their timers are due, so a recovery has nothing to
-- bring forward for them, and a task that ended or moved to another view during a long outage would otherwise
-- stay on it until the endpoint came back (one entry for each task that ever parked there).
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[3], 'provider_wait_since_ms', ARGV[5], 'deliveries', '0')
return 1

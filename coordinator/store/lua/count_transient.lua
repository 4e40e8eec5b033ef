-- More requests of a run's task failed transiently and will be sent again: its transient errors in all, and
-- the failed attempts of the request in flight, both kept on the task so they go on across parks. Only while
-- the run holds the task's lease: a run that stalled past its lapse would add its failures to the attempts of
-- the request its task's newer run has in flight (which would then give up early).
-- KEYS[1] lease
-- KEYS[2] task hash
-- ARGV[1] str: the run's token
-- ARGV[2] int: how many more requests failed
-- ARGV[3] str: a mark new to this call, kept on the task (`transient_call`): the same call sent again
--   after its reply was lost finds it and answers the counts without adding to them
-- Returns {transient errors in all, failed attempts of the request in flight}, or {} when the lease is not
--   this run's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {}
end
local counted = redis.call('HMGET', KEYS[2], 'transient_call', 'transient_errors', 'provider_attempts')
if counted[1] == ARGV[3] then
  return {tonumber(counted[2] or '0'), tonumber(counted[3] or '0')}  -- this very call, sent again: counted once
end
redis.call('HSET', KEYS[2], 'transient_call', ARGV[3])
return {redis.call('HINCRBY', KEYS[2], 'transient_errors', ARGV[2]),
  redis.call('HINCRBY', KEYS[2], 'provider_attempts', ARGV[2])}

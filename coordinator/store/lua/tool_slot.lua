-- A fleet-wide concurrency limit for the calls of a profile's tools that match one glob: take a
-- slot if one is free. Each slot is held until the call releases it (ZREM) or its lease ends (a
-- worker that died mid-call frees its slots that way).
-- KEYS[1] the glob's slots zset (member: the call, score: when its lease ends, ms)
-- ARGV[1] int: the limit
-- ARGV[2] int: now ms
-- ARGV[3] int: lease ms
-- ARGV[4] str: the call's member
-- Returns 1 when the call holds a slot now, else 0 (it waits and asks again).
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then
  return 1
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  return 1
end
return 0

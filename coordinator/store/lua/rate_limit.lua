-- A fleet-wide requests-per-minute limit for one model provider (a sliding window).
-- KEYS[1] the provider's request-times zset
-- ARGV[1] int: limit per minute
-- ARGV[2] int: now ms
-- ARGV[3] str: a unique member for this request
-- Returns 0 when the request may start now (it is counted), else the ms to wait.
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
-- This very request again (its reply was lost after it ran, and the connection sent it again): it is counted,
-- and starts now. Each request's member is its own (store/runs.py).
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return 0
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], 60000)
  return 0
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return math.max(1, tonumber(oldest[2]) + 60000 - now)

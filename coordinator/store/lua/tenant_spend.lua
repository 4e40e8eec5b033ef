-- One cost counted into its tenant's rolling day (24 hourly buckets), once per request however often the
-- step that made it is repeated, and the day's total read back: the run that made it stops its tree when
-- the total has reached the tenant's `max_cost_usd_per_day` (coordinator/quotas.py). Hours that left the
-- day are dropped as each cost is counted.
-- KEYS[1] the tenant's spend hash (epoch hour -> micro-USD)
-- KEYS[2] the tenant's counted requests zset (`<task id>:<request key>` -> ms)
-- ARGV[1] str: the request (`<task id>:<request key>`)
-- ARGV[2] int: cost micro-USD
-- ARGV[3] int: now ms
-- Returns the tenant's micro-USD in the rolling day, this cost included.
local now = tonumber(ARGV[3])
local hour = math.floor(now / 3600000)
local ttl = 25 * 3600
if tonumber(ARGV[2]) > 0 and redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], tostring(hour), ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
local total = 0
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  local h = tonumber(flat[i])
  if h and h > hour - 24 then
    total = total + (tonumber(flat[i + 1]) or 0)
  elseif h then
    redis.call('HDEL', KEYS[1], flat[i])
  end
end
return total

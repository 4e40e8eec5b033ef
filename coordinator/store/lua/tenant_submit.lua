-- A tenant's quotas checked and a new root counted against them, in one step (coordinator/quotas.py):
-- submits in the last 60 s (a sliding window of root ids), roots running now, and micro-USD spent in
-- the rolling day (24 hourly buckets, the oldest leaving as its hour turns 24 h old). A root id
-- already counted is counted once (a retried submit of the same root). A refusal writes nothing.
-- KEYS[1] the tenant's submits zset (root id -> ms)
-- KEYS[2] the tenant's running roots zset (root id -> ms)
-- KEYS[3] the tenant's spend hash (epoch hour -> micro-USD)
-- ARGV[1] str: the new root's id
-- ARGV[2] int: now ms
-- ARGV[3] int: submits per minute (0: no quota)
-- ARGV[4] int: roots running at once (0: no quota)
-- ARGV[5] int: micro-USD per rolling day (0: no quota)
-- ARGV[6] int: retention seconds (the running roots zset's lifetime)
-- ARGV[7] (optional) str: '1': a root that ended, run again by a retry: counted among the running roots
--   again (its submit was counted when it was made), under max_running_roots and the day's spend
-- Returns {1} when the root is counted (or was before: a retried submit of the same root), or {0, quota,
--   used, limit, retry after ms} when a quota refuses it (nothing written).
local root, now = ARGV[1], tonumber(ARGV[2])
local per_minute, max_roots, max_spend = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local retried = ARGV[7] == '1'
-- A retried root still counted as running (it ended a moment ago, or a retry counted it) holds its place, but the
-- day's spend is checked all the same: a retry must not buy a tree the day stopped one more request.
local counted = redis.call('ZSCORE', KEYS[2], root)
if not retried and (counted or redis.call('ZSCORE', KEYS[1], root)) then
  return {1}
end
-- Reads only: a refusal must leave every key as it was (stale entries are dropped once the root is counted).
local minute_ago = now - 60000
local submits = redis.call('ZCOUNT', KEYS[1], '(' .. minute_ago, '+inf')
if per_minute > 0 and not retried and submits >= per_minute then
  -- The window frees a place when the oldest submit inside it turns a minute old.
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. minute_ago, '+inf', 'WITHSCORES', 'LIMIT', 0,
    submits - per_minute + 1)
  return {0, 'submits_per_minute', submits, per_minute, math.max(1, tonumber(oldest[#oldest]) + 60000 - now)}
end
if max_roots > 0 and not counted then
  local running = redis.call('ZCARD', KEYS[2])
  if running >= max_roots then
    return {0, 'max_running_roots', running, max_roots, 0}
  end
end
if max_spend > 0 then
  local hour = math.floor(now / 3600000)
  local hours, spent = {}, 0
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    local h, micros = tonumber(flat[i]), tonumber(flat[i + 1]) or 0
    if h and h > hour - 24 then
      hours[#hours + 1] = {h, micros}
      spent = spent + micros
    end
  end
  if spent >= max_spend then
    -- Under the quota again once enough of the oldest hours have left the day.
    table.sort(hours, function(a, b) return a[1] < b[1] end)
    local left, reset = spent, now
    for _, entry in ipairs(hours) do
      left = left - entry[2]
      reset = (entry[1] + 24) * 3600000
      if left < max_spend then
        break
      end
    end
    return {0, 'max_cost_usd_per_day', spent, max_spend, math.max(1, reset - now)}
  end
end
if counted then
  return {1}
end
if not retried then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', minute_ago)
  redis.call('ZADD', KEYS[1], now, root)
  redis.call('PEXPIRE', KEYS[1], 60000)
end
-- Counted longer ago than the retention: its record is gone or about to be. Without max_running_roots no submit
-- prunes the set (only `subq tenants` and a metrics scrape do), so an active tenant's set kept every root.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[6]) * 1000)
redis.call('ZADD', KEYS[2], now, root)
redis.call('EXPIRE', KEYS[2], ARGV[6])
return {1}

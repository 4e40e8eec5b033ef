-- A fleet-wide concurrency limit for the calls of a profile's tools that match one glob: take a
-- slot if one is free. Each slot is held until the call frees it (free_tool_slot.lua) or its lease
-- ends (a worker that died mid-call frees its slots that way). A call that holds its slot already
-- (a new run of its task runs it again) takes it again with a new lease: what the earlier take frees
-- later, when a thread it started returns, is then not this take's.
-- KEYS[1] the glob's slots zset (member: the call, score: when its lease ends, ms)
-- ARGV[1] int: the limit
-- ARGV[2] int: now ms
-- ARGV[3] int: lease ms
-- ARGV[4] str: the call's member
-- Returns when the call's slot lease ends (ms) when it holds a slot now, else 0 (it waits and asks again).
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[4])
if held or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  local ends = now + tonumber(ARGV[3])
  -- Each take's lease ends at its own ms, so that the free of an earlier take (its end) frees not this one.
  if held and tonumber(held) >= ends then
    ends = tonumber(held) + 1
  end
  redis.call('ZADD', KEYS[1], ends, ARGV[4])
  -- The set lives as long as its longest lease: tools of one glob may have different timeouts (profiles
  -- sharing a glob too), and a short take must not let the key lapse under a longer-held slot.
  local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', KEYS[1], last - now)
  return ends
end
return 0

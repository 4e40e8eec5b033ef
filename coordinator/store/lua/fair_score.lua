-- Fair shares between tenants (docs/architecture.md, "Fair shares"): put one tenant in the queue of tenants
-- that want a run slot at its score, `(running + 1) / weight` (what its share would be with one slot more; the
-- lowest is the furthest below its weighted share), '+inf' while it holds its `max_running`, or take it out when
-- it wants nothing: no run parked, and none announced in the broker's queue within the last `forget` ms. Its
-- policy is the fleet's table as the workers' heartbeats last wrote it (`<tenant>` or `*`: 'weight max_running').
-- Every step that changes a tenant's running, parked or queued runs calls it, so the queue's scores stay true.
-- KEYS[1] the tenants that want a slot (zset)
-- KEYS[2] the tenants' policies (hash)
-- KEYS[3] the tenant's running set
-- KEYS[4] its parked runs
-- KEYS[5] its runs announced in the broker's queue
-- ARGV[1] str: tenant
-- ARGV[2] int: now ms
-- ARGV[3] int: how long an announced run counts as queued, ms
-- Returns its score now (a number, or '+inf'), or false when it wants nothing.
local tenant = ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
if redis.call('ZCARD', KEYS[4]) == 0 and redis.call('ZCARD', KEYS[5]) == 0 then
  redis.call('ZREM', KEYS[1], tenant)
  return false
end
local policy = redis.call('HGET', KEYS[2], tenant) or redis.call('HGET', KEYS[2], '*') or '1 0'
local weight, cap = string.match(policy, '^(%d+) (%d+)$')
weight, cap = tonumber(weight) or 1, tonumber(cap) or 0
local running = redis.call('SCARD', KEYS[3])
local score = '+inf'
if cap == 0 or running < cap then
  score = (running + 1) / weight
end
redis.call('ZADD', KEYS[1], score, tenant)
return score

-- Fair shares: may a run of this tenant take the worker that holds its message? Called by start_run after the
-- tree's own admission (admit.lua). It runs unless its tenant holds its `max_running` ('max_running'), every
-- slot of the fleet is promised ('fleet': the runs holding a slot reach the live workers' concurrency), or
-- another tenant that wants a slot is further below its weighted share than this one would be with it
-- ('share'), or its tenant's parked runs come before it ('order': the first of them is given the slot). A run
-- that may not start is parked in its tenant's sorted set (priority first, then arrival) and
-- its worker goes back to the broker's queue at once; for 'share', the slot is given to the neediest tenant's
-- parked run instead (fair_take.lua: the caller publishes it), so the fleet stays full while shares even out.
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the runs holding a slot, fleet-wide
-- KEYS[4] the fleet's capacity
-- ARGV[1] str: task id
-- ARGV[2] str: its tenant
-- ARGV[3] int: its priority
-- ARGV[4] int: now ms
-- ARGV[5] str: a tenant key's head
-- ARGV[6] str: the tail of a tenant's running set
-- ARGV[7] str: the tail of its parked runs
-- ARGV[8] str: the tail of its announced runs
-- ARGV[9] int: how long an announced run counts as queued, ms
-- ARGV[10] int: the fleet's capacity while no heartbeat has counted it (this worker's concurrency)
-- ARGV[11] int: retention seconds
-- ARGV[12] str: a task hash key's head
-- ARGV[13] str: its middle
-- Returns {'run', ''} (it holds a slot of its tenant) or {'wait', reason, the task id given the slot or
--   ''}.
local id, tenant, head = ARGV[1], ARGV[2], ARGV[5]
local running, parked, queued = head .. tenant .. ARGV[6], head .. tenant .. ARGV[7], head .. tenant .. ARGV[8]
local function rescore(who, run_set, parked_set, queued_set)
  return fair_score({KEYS[1], KEYS[2], run_set, parked_set, queued_set}, {who, ARGV[4], ARGV[9]})
end
redis.call('ZREM', queued, id)  -- its message has come
if redis.call('SISMEMBER', running, id) == 1 then
  return {'run', ''}  -- admitted already: taken from the parked runs, or a redelivery
end
local policy = redis.call('HGET', KEYS[2], tenant) or redis.call('HGET', KEYS[2], '*') or '1 0'
local weight, cap = string.match(policy, '^(%d+) (%d+)$')
weight, cap = tonumber(weight) or 1, tonumber(cap) or 0
local held = redis.call('SCARD', running)
local reason = false
if cap > 0 and held >= cap then
  reason = 'max_running'
elseif redis.call('HLEN', KEYS[3]) >= tonumber(redis.call('GET', KEYS[4]) or ARGV[10]) then
  reason = 'fleet'
else
  local own = (held + 1) / weight
  for _ = 1, 8 do
    local low = redis.call('ZRANGE', KEYS[1], 0, 1, 'WITHSCORES')
    local other, score = false, false
    for i = 1, #low, 2 do
      if low[i] ~= tenant then
        other, score = low[i], low[i + 1]
        break
      end
    end
    if not other or score == 'inf' or tonumber(score) >= own then
      break
    end
    -- Its score may be stale (announced runs gone by): as it is now, before this run parks for it.
    local fresh = rescore(other, head .. other .. ARGV[6], head .. other .. ARGV[7], head .. other .. ARGV[8])
    if fresh and fresh ~= '+inf' and fresh < own then
      reason = 'share'
      break
    end
  end
end
local taken = false
if not reason then
  -- A slot it may take goes first to its tenant's parked runs that come before it (a higher priority, or the same
  -- parked earlier): room made without a release (a raised max_running, a grown fleet) reaches them at once, not
  -- at the heal tick after the runs that came later took it. A run not parked comes after every parked run of its
  -- priority, whatever their stamps: one parked in this very millisecond, or bumped past it by a tie, or stamped
  -- by a worker whose clock runs ahead, parked before it came (its band's top, not `now`, is its place).
  local place = tonumber(redis.call('ZSCORE', parked, id)) or -tonumber(ARGV[3]) * 1e13 + 1e13
  taken = fair_take({KEYS[1], KEYS[2], KEYS[3]}, {head, ARGV[6], ARGV[7], ARGV[8], ARGV[4], ARGV[9], ARGV[11],
    ARGV[12], ARGV[13], tenant, place})
  if taken then
    reason = 'order'
  end
end
if not reason then
  -- Off its tenant's parked runs, if it was parked (its message delivered again found room): left there, a
  -- release gave it a second slot, held while it waited on a person or its children.
  redis.call('ZREM', parked, id)
  redis.call('SADD', running, id)
  redis.call('EXPIRE', running, ARGV[11])
  redis.call('HSET', KEYS[3], id, tenant)
  rescore(tenant, running, parked, queued)
  return {'run', ''}
end
-- Priority first (5 before 1), then arrival: a redelivered parked run keeps its place (NX). Arrival is the
-- order of parking: a run parked in the same millisecond as the last of its priority (or stamped earlier by
-- another worker's clock) goes after it, where equal scores would sort by task id.
local score = -tonumber(ARGV[3]) * 1e13 + tonumber(ARGV[4])
local band_top = -tonumber(ARGV[3]) * 1e13 + 1e13
local last = redis.call('ZREVRANGEBYSCORE', parked, '(' .. band_top, score, 'WITHSCORES', 'LIMIT', 0, 1)
if last[2] then score = tonumber(last[2]) + 1 end
redis.call('ZADD', parked, 'NX', score, id)
redis.call('EXPIRE', parked, ARGV[11])
rescore(tenant, running, parked, queued)
if reason == 'share' then
  taken = fair_take({KEYS[1], KEYS[2], KEYS[3]}, {head, ARGV[6], ARGV[7], ARGV[8], ARGV[4], ARGV[9], ARGV[11],
    ARGV[12], ARGV[13]})
end
return {'wait', reason, taken or ''}

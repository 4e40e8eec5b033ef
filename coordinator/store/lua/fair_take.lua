-- Fair shares: give one run slot to the waiting run of the tenant furthest below its weighted share (the head of
-- the wanting queue, fair_score.lua), its parked run of the highest priority, then the earliest. When that
-- tenant's runs are in the broker's queue, not parked, nothing is taken: the worker that freed the slot takes
-- the next message, and the runs of tenants above their share before it are parked as they come (a tenant's
-- flood in Celery's FIFO queue drains at the speed of a park). Tenants whose announced runs have all gone by
-- are taken out as they are met. The caller publishes the taken run (it stays on the due list until it
-- starts, so a process that dies first leaves it to the reconciler: coordinator/reconciler.py). A parked run
-- whose task has ended since it parked (stopped by a caller whose tenants table has fair shares off: a stop
-- with them on withdraws its runs, fair_withdraw.lua) or is gone with its tree is dropped, not given the slot.
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the runs holding a slot, fleet-wide (hash: task id -> tenant)
-- ARGV[1] str: a tenant key's head (the keys module's name up to the tenant)
-- ARGV[2] str: the tail of a tenant's running set
-- ARGV[3] str: the tail of its parked runs
-- ARGV[4] str: the tail of its announced runs
-- ARGV[5] int: now ms
-- ARGV[6] int: how long an announced run counts as queued, ms
-- ARGV[7] int: retention seconds
-- ARGV[8] str: a task hash key's head (up to the root id)
-- ARGV[9] str: its middle (between the root id and the task id)
-- ARGV[10] (optional) str: take from this tenant's parked runs alone, not the neediest tenant's
--   (fair_admit.lua: an arrival of a tenant whose parked runs come before it)
-- ARGV[11] (optional) float: with ARGV[10], only a parked run whose place is before this score
-- Returns the task id given the slot, or false.
local head = ARGV[1]
-- The policies changed since the last take (fair_beat.lua marks it): the wanting tenants are scored again, those
-- at +inf (at their max_running when last scored) first, then the lowest, RESCORED of each at most. A score is made
-- again only by its tenant's own steps, and a tenant scored +inf kept it after its cap was raised: every slot freed
-- went to the others, however far over their share, for as long as its running runs ran. (A stale finite score
-- mends itself: its tenant is scored again when it reaches the head.)
local RESCORED = 100
if redis.call('HDEL', KEYS[2], POLICIES_CHANGED) == 1 then
  local capped = redis.call('ZRANGEBYSCORE', KEYS[1], '+inf', '+inf', 'LIMIT', 0, RESCORED)
  for _, tenant in ipairs(capped) do
    fair_score({KEYS[1], KEYS[2], head .. tenant .. ARGV[2], head .. tenant .. ARGV[3], head .. tenant .. ARGV[4]},
      {tenant, ARGV[5], ARGV[6]})
  end
  for _, tenant in ipairs(redis.call('ZRANGE', KEYS[1], 0, RESCORED - 1)) do
    fair_score({KEYS[1], KEYS[2], head .. tenant .. ARGV[2], head .. tenant .. ARGV[3], head .. tenant .. ARGV[4]},
      {tenant, ARGV[5], ARGV[6]})
  end
end
-- The first live parked run of `tenant` before `before` (any, when nil) is given the slot; ended or gone ones met
-- first are dropped. Returns its id (or false), and how many were dropped.
local function take_parked(tenant, before)
  local running, parked, queued = head .. tenant .. ARGV[2], head .. tenant .. ARGV[3], head .. tenant .. ARGV[4]
  local dropped = 0
  while true do
    local first = redis.call('ZRANGE', parked, 0, 0, 'WITHSCORES')
    if #first == 0 or (before and tonumber(first[2]) >= before) then
      return false, dropped
    end
    redis.call('ZREM', parked, first[1])
    local key = ARGV[8] .. string.sub(first[1], 1, 16) .. ARGV[9] .. first[1]
    local status = hash_get(key, 'status', 'timeline')[1]  -- (its timeline, marked below, read with it)
    if status and not ENDED[status] then
      redis.call('SADD', running, first[1])
      redis.call('EXPIRE', running, ARGV[7])
      redis.call('HSET', KEYS[3], first[1], tenant)
      fair_score({KEYS[1], KEYS[2], running, parked, queued}, {tenant, ARGV[5], ARGV[6]})
      -- Its wait for a slot ends now: its run is queued again (the caller publishes it).
      timeline_mark(key, tonumber(ARGV[5]) / 1000, 'queued')
      return first[1], dropped
    end
    dropped = dropped + 1
  end
end
if ARGV[10] then
  local id, dropped = take_parked(ARGV[10], tonumber(ARGV[11]))
  if dropped > 0 and not id then
    fair_score({KEYS[1], KEYS[2], head .. ARGV[10] .. ARGV[2], head .. ARGV[10] .. ARGV[3],
      head .. ARGV[10] .. ARGV[4]}, {ARGV[10], ARGV[5], ARGV[6]})
  end
  return id
end
for _ = 1, 8 do  -- a few tenants found to want nothing any more (or scored stale), then the next
  local top = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #top == 0 then
    return false  -- none waits
  end
  local tenant = top[1]
  local running, parked, queued = head .. tenant .. ARGV[2], head .. tenant .. ARGV[3], head .. tenant .. ARGV[4]
  fair_score({KEYS[1], KEYS[2], running, parked, queued}, {tenant, ARGV[5], ARGV[6]})
  local now_top = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #now_top == 0 or now_top[2] == 'inf' then
    return false  -- none waits, or every tenant waiting holds its max_running
  end
  if now_top[1] == tenant then
    local id, dropped = take_parked(tenant, nil)
    if id then
      return id
    end
    if dropped == 0 then
      return false  -- its runs are in the broker's queue: the freed worker reaches them
    end
    -- Only ended or gone runs were parked: scored again, it may want nothing now, and the next tenant is met.
    fair_score({KEYS[1], KEYS[2], running, parked, queued}, {tenant, ARGV[5], ARGV[6]})
  end
  -- Its score was stale (its announced runs had gone by): the head is another tenant now.
end
return false

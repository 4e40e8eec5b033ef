-- Fair shares: the reconciler's pass (coordinator/reconciler.py, its leader each tick), so that no slot leaks and
-- no parked run is stranded. (1) A slot whose run's task is gone (its tree deleted or expired), has ended or has
-- delegated is freed, once no run holds the task's lease: nothing will ever free it (an end or release with fair
-- shares off, a crash between a delegation and its release). A run that still holds its lease (stopped, and
-- not yet at the step that reads so) frees its slot as it ends, and one that dies first is freed here once its
-- lease lapses: freed before, its slot went to a parked run while it still ran, over its tenant's max_running
-- and the fleet's capacity. A slot held by a live task is left alone, leased or not: one given to a parked
-- run waits for its restart, and one whose worker died for the reconciler's new run; it is put back in its
-- tenant's running set, whose expiry the pass renews. (2) With fair shares on,
-- free slots are given to the neediest tenants' parked runs (a max_running raised, a weight changed, the fleet
-- grown, a slot freed here). (3) With them off, every parked run is released: out of its tenant's set, put on
-- the due list (a process that dies before publishing leaves it to the reconciler), and returned to publish; one
-- whose task is gone with its tree is only taken out. What the pass answered is kept under its call's mark: the
-- same call sent again (its reply lost, Sentinel's retry) answers it again, so its caller publishes the runs
-- it started (found parked no more, the resend answered none, and they held their slots unpublished until the
-- reconciler's grace ran out).
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the runs holding a slot, fleet-wide
-- KEYS[4] the fleet's capacity
-- KEYS[5] the due list
-- KEYS[6] this call's mark: what it answered, kept for the same call sent again (its reply lost)
-- ARGV[1] int: now ms
-- ARGV[2] float: when the reconciler looks at a released run (epoch s)
-- ARGV[3] int: how many parked runs one call releases while fair shares are off
-- ARGV[4] int: retention seconds
-- ARGV[5] int: 1: fair shares between tenants are on (nothing below is read when 0)
-- ARGV[6] str: a tenant key's head (the keys module's name up to the tenant)
-- ARGV[7] str: the tail of a tenant's running set
-- ARGV[8] str: the tail of its parked runs
-- ARGV[9] str: the tail of its announced runs
-- ARGV[10] str: a task hash key's head (up to the root id)
-- ARGV[11] str: its middle (between the root id and the task id)
-- ARGV[12] int: how long an announced run counts as queued, ms
-- ARGV[13] int: the fleet's capacity while no heartbeat has counted it (this worker's concurrency)
-- ARGV[14] int: how many parked runs one freed slot may give a slot (more when the fleet grew)
-- ARGV[15] str: the tenant of a record without one
-- ARGV[16] int: the priority of a record without one
-- ARGV[17] str: a lease key's middle (between the root id and the task id; its head is a task's)
-- ARGV[18] int: how long the mark is kept, seconds
-- Returns {the runs whose slot was freed, the runs to publish again}.
local kept = redis.call('GET', KEYS[6])
if kept then
  return cjson.decode(kept)
end
local now_ms, head, on = ARGV[1], ARGV[6], ARGV[5] == '1'
local function task_key(id)
  return ARGV[10] .. string.sub(id, 1, 16) .. ARGV[11] .. id
end
local function answer(freed, started)
  if #freed > 0 or #started > 0 then
    redis.call('SET', KEYS[6], cjson.encode({freed, started}), 'EX', ARGV[18])
  end
  return {freed, started}
end
local function keys_of(tenant)
  return {KEYS[1], KEYS[2], head .. tenant .. ARGV[7], head .. tenant .. ARGV[8], head .. tenant .. ARGV[9]}
end
local freed, started, kept_running = {}, {}, {}
local holding = redis.call('HGETALL', KEYS[3])  -- at most the fleet's capacity, and what leaked
for i = 1, #holding, 2 do
  local id, tenant = holding[i], holding[i + 1]
  local status = redis.call('HGET', task_key(id), 'status')
  if (not status or ENDED[status] or status == 'delegated')
      and redis.call('EXISTS', ARGV[10] .. string.sub(id, 1, 16) .. ARGV[17] .. id) == 0 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('SREM', head .. tenant .. ARGV[7], id)
    freed[#freed + 1] = id
    if on then
      fair_score(keys_of(tenant), {tenant, now_ms, ARGV[12]})
    end
  else
    -- A slot held is in its tenant's running set too, which max_running counts and whose expiry only an admission
    -- renewed: a tenant whose long runs held their slots for a retention with no admission between lost the set,
    -- and read none running. Each pass puts the held slots back in it and keeps it a retention more.
    local running = head .. tenant .. ARGV[7]
    redis.call('SADD', running, id)
    if not kept_running[running] then
      kept_running[running] = true
      redis.call('EXPIRE', running, ARGV[4])
    end
  end
end
if on then
  local capacity = tonumber(redis.call('GET', KEYS[4]) or ARGV[13])
  for _ = 1, tonumber(ARGV[14]) do
    if redis.call('HLEN', KEYS[3]) >= capacity then
      break
    end
    local taken = fair_take({KEYS[1], KEYS[2], KEYS[3]}, {head, ARGV[7], ARGV[8], ARGV[9], now_ms, ARGV[12], ARGV[4],
      ARGV[10], ARGV[11]})
    if not taken then
      break
    end
    started[#started + 1] = taken
  end
  return answer(freed, started)
end
local left = tonumber(ARGV[3])
for _, tenant in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local parked = head .. tenant .. ARGV[8]
  for _, id in ipairs(redis.call('ZRANGE', parked, 0, left - 1)) do
    redis.call('ZREM', parked, id)
    -- (A task gone with its tree has nothing to run: marked, it was made again as a hash of its timeline alone,
    -- with no expiry, and the caller's read of it failed the reconciler's tick.)
    if hash_get(task_key(id), 'status', 'timeline')[1] then
      redis.call('ZADD', KEYS[5], ARGV[2], id)
      timeline_mark(task_key(id), tonumber(now_ms) / 1000, 'queued')
      started[#started + 1] = id
    end
    left = left - 1
  end
  if redis.call('ZCARD', parked) == 0 then
    redis.call('DEL', head .. tenant .. ARGV[9])  -- its announcements: nothing will take them out now
    redis.call('ZREM', KEYS[1], tenant)
  end
  if left <= 0 then
    break
  end
end
return answer(freed, started)

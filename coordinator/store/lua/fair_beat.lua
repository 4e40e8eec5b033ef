-- Fair shares: a worker process's beat writes its concurrency, the fleet's capacity (the sum over the
-- processes whose heartbeat is recent and that beat here: one counts from its first beat), and the policies
-- of the tenants table it reads (each tenant's 'weight max_running', `*` for the rest), which the admission
-- steps read for any tenant they meet. Every process writes the same sums from the same entries, so the last
-- writer's are as good as any; a process gone drops out of the sum once its heartbeat is old.
-- KEYS[1] the worker processes by their last heartbeat
-- KEYS[2] each process's concurrency
-- KEYS[3] the fleet's capacity
-- KEYS[4] the tenants' policies
-- ARGV[1] str: this process
-- ARGV[2] int: its concurrency
-- ARGV[3] float: the oldest heartbeat that is still live (epoch s)
-- ARGV[4] int: how long the capacity stands without a beat, seconds
-- ARGV[5..] then 2 per tenant (name, 'weight max_running'), `*` among them
-- Returns the fleet's capacity.
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local live = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[3], '+inf')
local capacity, seen = 0, {}
for _, worker in ipairs(live) do
  seen[worker] = true
  -- Only the processes that beat here count: a run's own heartbeat names its process a second time.
  capacity = capacity + (tonumber(redis.call('HGET', KEYS[2], worker) or '0') or 0)
end
if not seen[ARGV[1]] then
  capacity = capacity + tonumber(ARGV[2])
end
for _, worker in ipairs(redis.call('HKEYS', KEYS[2])) do
  if not seen[worker] and worker ~= ARGV[1] then
    redis.call('HDEL', KEYS[2], worker)
  end
end
redis.call('SET', KEYS[3], capacity, 'EX', ARGV[4])
-- Whether the table differs from the one written before (or a change is still to be taken up): the next take
-- (fair_take.lua) scores every wanting tenant again.
local before = redis.call('HGETALL', KEYS[4])
local changed = #before ~= #ARGV - 4
for at = 1, #before, 2 do
  if before[at] == POLICIES_CHANGED then
    changed = true
  end
end
if not changed then
  local was = {}
  for at = 1, #before, 2 do
    was[before[at]] = before[at + 1]
  end
  for at = 5, #ARGV, 2 do
    if was[ARGV[at]] ~= ARGV[at + 1] then
      changed = true
      break
    end
  end
end
redis.call('DEL', KEYS[4])
-- In slices of 500 tenants: Lua unpacks no more than about 8,000 values, and a table of one tenant a customer holds
-- thousands (the beat failed, and with it every reconciler tick after it).
for first = 5, #ARGV, 1000 do
  redis.call('HSET', KEYS[4], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
if changed then
  redis.call('HSET', KEYS[4], POLICIES_CHANGED, '1')
end
return capacity

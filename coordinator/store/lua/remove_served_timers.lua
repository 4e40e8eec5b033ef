-- Remove the timers the reconciler's tick served, each only while it is still set for the time the tick
-- read it at: one set again meanwhile is a new timer (a parked run woken by this tick, run at once and
-- parked again under the same name before the tick ended) and stays. A compare-and-remove in one call:
-- a WATCH on this key, which every park, approval and wake writes, could fail its tries on a busy fleet,
-- and then the whole tick failed and the next served every timer again.
-- KEYS[1] the timers zset (member `<kind>:<id>`, score: due epoch s)
-- ARGV[1..] 2 per timer served: its name, the time it was read at (epoch s)
-- Returns how many were removed.
local removed = 0
for i = 1, #ARGV, 2 do
  local at = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if at and tonumber(at) == tonumber(ARGV[i + 1]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed

-- Renew leases that their holder still holds (compare and pexpire), in one call.
-- KEYS[1..] the leases
-- ARGV[1] int: the lease time, ms
-- ARGV[2..] each str: the holder's token of each lease, in the order of KEYS
-- Returns the indexes (1-based) of the leases that were lost: lapsed, or taken by another.
local lost = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
  else
    lost[#lost + 1] = i
  end
end
return lost

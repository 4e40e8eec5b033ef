-- Take or keep a leader lease: the holder renews it, anyone takes it once it has lapsed.
-- KEYS[1] the lease
-- ARGV[1] str: this candidate's id
-- ARGV[2] int: the lease time, ms
-- Returns 1 when the candidate leads now, 0 when another does.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0

-- Record one model request's usage on the task that made it, once, and roll the
-- spend up into the subtree totals of the task and every ancestor.
-- KEYS[1]  task hash
-- KEYS[2]  usage-applied set of the task (request keys already recorded)
-- KEYS[3..] ancestor task hashes (parent first, root last)
-- ARGV[1] request key (unique per request of the task)   ARGV[2] tokens_in
-- ARGV[3] tokens_out   ARGV[4] cache_reads   ARGV[5] cache_writes
-- ARGV[6] cost_micros  ARGV[7] cost source   ARGV[8] now   ARGV[9] retention seconds
-- Returns 1 when recorded, 0 when this request was already recorded.
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  return 0
end
redis.call('EXPIRE', KEYS[2], ARGV[9])
local tokens = tonumber(ARGV[2]) + tonumber(ARGV[3])
local cost = tonumber(ARGV[6])
redis.call('HINCRBY', KEYS[1], 'tokens_in', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'tokens_out', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'cache_reads', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'cache_writes', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'cost_micros', cost)
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HSET', KEYS[1], 'cost_source', ARGV[7], 'updated_at', ARGV[8])
for i = 1, #KEYS do
  if i ~= 2 then
    redis.call('HINCRBY', KEYS[i], 'total_tokens', tokens)
    redis.call('HINCRBY', KEYS[i], 'total_cost_micros', cost)
    redis.call('EXPIRE', KEYS[i], ARGV[9])
  end
end
return 1

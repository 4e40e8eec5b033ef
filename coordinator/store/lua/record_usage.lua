-- Record one model request's usage on the task that made it, once, and roll the
-- spend up into the subtree totals of the task and every ancestor; then say whether
-- a budget on the way up is exhausted.
-- KEYS[1]  task hash
-- KEYS[2]  usage-applied set of the task (request keys already recorded)
-- KEYS[3..] ancestor task hashes (parent first, root last)
-- ARGV[1] request key (unique per request of the task)   ARGV[2] tokens_in
-- ARGV[3] tokens_out   ARGV[4] cache_reads   ARGV[5] cache_writes
-- ARGV[6] cost_micros  ARGV[7] cost source   ARGV[8] now   ARGV[9] retention seconds
-- Returns {recorded, exhausted}: recorded is 1, 0 (this request was recorded before) or
-- -1 (the task has ended, e.g. was cancelled: nothing is recorded after a stop);
-- exhausted is the id of the topmost task (nearest the root) whose budget the subtree
-- total has reached, or ''.
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'completed' or status == 'failed' or status == 'cancelled' then
  return {-1, ''}
end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  return {0, ''}
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
local exhausted = ''
for i = 1, #KEYS do
  if i ~= 2 then
    redis.call('HINCRBY', KEYS[i], 'total_tokens', tokens)
    local total = redis.call('HINCRBY', KEYS[i], 'total_cost_micros', cost)
    redis.call('EXPIRE', KEYS[i], ARGV[9])
    local budget = tonumber(redis.call('HGET', KEYS[i], 'budget_micros') or '0')
    if budget > 0 and total >= budget then
      exhausted = redis.call('HGET', KEYS[i], 'id')  -- later keys are nearer the root
    end
  end
end
return {1, exhausted}

-- Write one finished child back onto its parent, exactly once (the batch's applied-set
-- makes a redelivered or duplicated callback change nothing).
-- KEYS[1] parent hash   KEYS[2] parent todos (JSON array)   KEYS[3] batch applied-set
-- KEYS[4] parent awaiting set   KEYS[5] child hash   KEYS[6] tree events stream
-- ARGV[1] child id   ARGV[2] result status (completed|failed|cancelled)   ARGV[3] summary
-- ARGV[4] error   ARGV[5] error class   ARGV[6] now   ARGV[7] retention seconds
-- ARGV[8] events max length
-- Returns 1 when applied now, 0 when it had been applied before.
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('EXPIRE', KEYS[3], ARGV[7])

-- The child's own run marks it terminal; a child whose run never reported (its
-- result came from the callback alone) is marked here with the same outcome.
local status = redis.call('HGET', KEYS[5], 'status')
if status ~= 'completed' and status ~= 'failed' and status ~= 'cancelled' then
  redis.call('HSET', KEYS[5], 'status', ARGV[2], 'summary', ARGV[3], 'error', ARGV[4],
    'error_class', ARGV[5], 'updated_at', ARGV[6], 'finished_at', ARGV[6])
  status = ARGV[2]
end

-- The todo item shows the child's subtree totals, read here from the child record
-- (the system of record), never from the message, so a stale result cannot skew them.
local tokens = tonumber(redis.call('HGET', KEYS[5], 'total_tokens') or '0')
local cost = tonumber(redis.call('HGET', KEYS[5], 'total_cost_micros') or '0')
local raw = redis.call('GET', KEYS[2])
if raw then
  local items = cjson.decode(raw)
  local changed = false
  for _, item in ipairs(items) do
    if item['subtask_id'] == ARGV[1] then
      item['tokens'] = tokens
      item['cost_micros'] = cost
      if status == 'completed' then
        item['status'] = 'completed'
      end
      changed = true
    end
  end
  if changed then
    redis.call('SET', KEYS[2], cjson.encode(items), 'EX', ARGV[7])
    redis.call('HINCRBY', KEYS[1], 'todos_version', 1)
  end
end

redis.call('SREM', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[6])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[8], '*', 'type', 'child_applied',
  'task_id', redis.call('HGET', KEYS[1], 'id'), 'child_id', ARGV[1], 'status', status)
return 1

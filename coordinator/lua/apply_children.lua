-- Write finished children back onto their parent, each exactly once (the batch's
-- applied-set makes a redelivered or duplicated callback change nothing). The
-- parent's todo list is decoded and encoded once per call, not once per child, so a
-- wide fan-out stays linear.
-- KEYS[1] parent hash   KEYS[2] parent todos (JSON array)   KEYS[3] batch applied-set
-- KEYS[4] parent awaiting set   KEYS[5] tree events stream   KEYS[6..] child hashes
-- ARGV[1] now   ARGV[2] retention seconds   ARGV[3] events max length
-- ARGV[4..] child ids, in the order of KEYS[6..]
-- A child that has not ended (no terminal status) is skipped. Returns how many were applied now.
local function terminal(status)
  return status == 'completed' or status == 'failed' or status == 'cancelled'
end

local figures = {}
local applied = {}
for i = 4, #ARGV do
  local child_id = ARGV[i]
  local key = KEYS[i + 2]
  local status = redis.call('HGET', key, 'status')
  if terminal(status) and redis.call('SADD', KEYS[3], child_id) == 1 then
    -- The item shows the child's subtree totals, read from the child record (the
    -- system of record), never from a message, so a stale result cannot skew them.
    figures[child_id] = {
      status = status,
      tokens = tonumber(redis.call('HGET', key, 'total_tokens') or '0'),
      cost = tonumber(redis.call('HGET', key, 'total_cost_micros') or '0'),
    }
    applied[#applied + 1] = child_id
  end
end
if #applied == 0 then
  return 0
end
redis.call('EXPIRE', KEYS[3], ARGV[2])

local raw = redis.call('GET', KEYS[2])
if raw then
  local items = cjson.decode(raw)
  local changed = false
  for _, item in ipairs(items) do
    local got = figures[item['subtask_id']]
    if got then
      item['tokens'] = got.tokens
      item['cost_micros'] = got.cost
      if got.status == 'completed' then
        item['status'] = 'completed'
      end
      changed = true
    end
  end
  if changed then
    redis.call('SET', KEYS[2], cjson.encode(items), 'EX', ARGV[2])
    redis.call('HINCRBY', KEYS[1], 'todos_version', 1)
  end
end

local parent_id = redis.call('HGET', KEYS[1], 'id')
for _, child_id in ipairs(applied) do
  redis.call('SREM', KEYS[4], child_id)
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'type', 'child_applied',
    'task_id', parent_id, 'child_id', child_id, 'status', figures[child_id].status)
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[1])
return #applied

-- Write finished children back onto their parent, each exactly once (a child is applied
-- when its line of the combined result is stored, HSETNX: a redelivered or duplicated
-- write-back changes nothing). Only the items concerned are read and written (the list is
-- a hash of item id -> JSON), so a wide fan-out stays linear. The batch lines and the
-- todos keep the retention their delegation gave them (delegation.py) until the batch
-- closes (close_batch.lua), so a child's write-back refreshes neither.
-- KEYS[1] parent hash
-- KEYS[2] parent todos (hash: item id -> JSON, order -> ids)
-- KEYS[3] parent awaiting set
-- KEYS[4] tree events stream
-- KEYS[5] batch lines (hash: child id -> line)
-- KEYS[6..] child hashes
-- ARGV[1] float: now
-- ARGV[2] int: retention seconds
-- ARGV[3] int: events max length
-- ARGV[4..] each str: child ids, in the order of their hashes in KEYS
-- Returns how many were applied now.
-- A child that has not ended (no terminal status) is skipped. A child no row carries adds its
-- figures to the parent's unlinked spend. The batch lines hold each applied child's line, so
-- closing the batch reads no sibling.
-- The child's line of the combined result (writeback.combined_result has the format; the
-- number is its place in the batch, added when the batch closes).
-- The most of a child's output its line carries (writeback.py: OUTPUT_IN_LINE_BYTES, the same number).
local OUTPUT_IN_LINE = 16384
local function usd(micros)
  local sign = micros < 0 and '-' or ''
  micros = math.abs(micros)
  return string.format('%s$%d.%06d', sign, math.floor(micros / 1000000), micros % 1000000)
end
local function one_line(text)
  return (string.gsub(string.gsub(text or '', '%s+', ' '), '^ ?(.-) ?$', '%1'))
end
local function line_of(child_id, got)
  local todo = (got.todo_id and got.todo_id ~= '') and (', todo ' .. got.todo_id) or ''
  local body
  if got.status == 'completed' then
    body = one_line(got.summary)
  else
    local class = (got.error_class and got.error_class ~= '') and got.error_class or 'Error'
    local err = (got.error and got.error ~= '') and got.error or 'no detail'
    body = class .. ': ' .. err
  end
  -- One concatenation, one string (each piece joined apart would be a string of its own).
  local line = '[' .. got.status .. '] ' .. (got.description or '') .. ' (task ' .. child_id .. todo .. '): ' .. body
    .. ' (' .. got.tokens .. ' tokens, ' .. usd(got.cost) .. ')'
  -- A completed typed child's data, as its compact JSON (one line: JSON escapes every line break),
  -- up to OUTPUT_IN_LINE bytes; a larger one is named, for the parent to read from the record.
  if got.status == 'completed' and got.output and got.output ~= '' then
    if #got.output <= OUTPUT_IN_LINE then
      line = line .. ' Output (JSON): ' .. got.output
    else
      line = line .. ' Output: ' .. #got.output .. ' bytes of JSON, more than the ' .. OUTPUT_IN_LINE ..
        ' shown here: it is the output of task ' .. child_id
    end
  end
  return line
end

-- A parent whose record lapsed (a batch open longer than a retention: its plan and batch lines went with it)
-- takes no write-back: any write here would make its keys again with no retention. (Inside a run's end the
-- record is read already, end_run.lua's prefetch.)
local parent = hash_get(KEYS[1], 'id', 'todos_version')
if not parent[1] then
  return 0
end
local figures = {}
local applied = {}
for i = 4, #ARGV do
  local child_id = ARGV[i]
  local key = KEYS[i + 2]
  local f = hash_get(key, 'status', 'total_tokens', 'total_cost_micros', 'todo_id', 'description',
    'summary', 'error_class', 'error', 'output')
  if ENDED[f[1]] then
    -- The item shows the child's subtree totals, read from the child record (the
    -- system of record), never from a message, so a stale result cannot skew them.
    local got = {
      status = f[1], tokens = tonumber(f[2] or '0'), cost = tonumber(f[3] or '0'), todo_id = f[4],
      description = f[5], summary = f[6], error_class = f[7], error = f[8], output = f[9],
    }
    if redis.call('HSETNX', KEYS[5], child_id, line_of(child_id, got)) == 1 then
      figures[child_id] = got
      applied[#applied + 1] = child_id
    end
  end
end
if #applied == 0 then
  return 0
end

local changed = false
for i = 4, #ARGV do
  local child_id = ARGV[i]
  local got = figures[child_id]
  if got then
    local id, item = linked_item(KEYS[2], child_id, got.todo_id)
    if id then
      -- A retried item shows its earlier children's figures too (prior_*), and this child's.
      item['tokens'] = (tonumber(item['prior_tokens']) or 0) + got.tokens
      item['cost_micros'] = (tonumber(item['prior_cost_micros']) or 0) + got.cost
      if got.status == 'completed' then
        item['status'] = 'completed'
      end
      redis.call('HSET', KEYS[2], id, cjson.encode(item))
      changed = true
    else
      -- No row carries the child's link (the plan was rewritten without it): its spend is
      -- the parent's unlinked spend, a figure of its own, so the plan still adds up.
      hash_incr(KEYS[1], 'unlinked_tokens', got.tokens)
      hash_incr(KEYS[1], 'unlinked_cost_micros', got.cost)
    end
  end
end

for _, child_id in ipairs(applied) do
  redis.call('SREM', KEYS[3], child_id)
  -- (The events may have lapsed since the child's end, a write-back the reconciler makes much later: event_add
  -- gives the stream its retention. Inside a run's end finish_task's event sent it: one EXPIRE for both.)
  event_add(KEYS[4], ARGV[3], ARGV[2], 'type', 'child_applied', 'task_id', parent[1], 'child_id', child_id,
    'status', figures[child_id].status)
end
if changed then
  hash_set(KEYS[1], 'updated_at', ARGV[1], 'todos_version', (tonumber(parent[2] or '0') or 0) + 1)
else
  hash_set(KEYS[1], 'updated_at', ARGV[1])
end
return #applied

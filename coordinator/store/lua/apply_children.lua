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
  -- The item shows the child's subtree totals, read from the child record (the
  -- system of record), never from a message, so a stale result cannot skew them.
  local got = child_figures(key)
  if ENDED[got.status] then
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
      item_shows(item, got)
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

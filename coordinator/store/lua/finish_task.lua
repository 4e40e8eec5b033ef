-- Move a task to a terminal status once (its timeline's last mark); a later call leaves the first outcome.
-- Its `task.<status>` event goes into the tree's outbox in this same step (outbox_add).
-- KEYS[1] task hash
-- KEYS[2] tree events stream
-- KEYS[3] tree live hash
-- KEYS[4..6] the tree's outbox (outbox_add's KEYS)
-- ARGV[1] str: status (completed|failed|cancelled)
-- ARGV[2] str: summary
-- ARGV[3] str: error
-- ARGV[4] str: error class
-- ARGV[5] float: now
-- ARGV[6] int: retention seconds
-- ARGV[7] int: events max length
-- ARGV[8] (optional) str: the terminal live status JSON (state: the status above, ts: now), written as it
--   is (without it, the stored one is read and made terminal)
-- Returns the task's status after the call (the earlier one if it was already terminal), or false when the
--   task does not exist.
local task = hash_get(KEYS[1], 'status', 'id')
local status, id = task[1], task[2]
if not status then
  return false
end
if ENDED[status] then
  return status
end
hash_set(KEYS[1], 'status', ARGV[1], 'summary', ARGV[2], 'error', ARGV[3],
  'error_class', ARGV[4], 'updated_at', ARGV[5], 'finished_at', ARGV[5])
timeline_mark(KEYS[1], ARGV[5], ARGV[1])
hash_expire_later(KEYS[1], ARGV[6])
local made_live
if ARGV[8] and ARGV[8] ~= '' then
  made_live = redis.call('HSET', KEYS[3], id, ARGV[8]) == 1  -- made terminal by the caller: no JSON here
else
  local raw = redis.call('HGET', KEYS[3], id)
  local live = raw and cjson.decode(raw) or {task_id = id}
  live['state'] = ARGV[1]
  live['ts'] = tonumber(ARGV[5])
  made_live = redis.call('HSET', KEYS[3], id, cjson.encode(live)) == 1
end
if made_live then
  -- A field made now: the hash may be made now too (a task with no live status before, or a hash that lapsed in a
  -- long run), and a key made with no retention would stay for good.
  redis.call('EXPIRE', KEYS[3], ARGV[6])
end
event_add(KEYS[2], ARGV[7], ARGV[6], 'type', 'task_status', 'task_id', id, 'status', ARGV[1])
wake_waiters(KEYS[2], id)
outbox_add({KEYS[4], KEYS[5], KEYS[6]}, {id, 'task.' .. ARGV[1], ARGV[5], ARGV[6], '', KEYS[1]})
return ARGV[1]

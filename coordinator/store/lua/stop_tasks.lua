-- Stop tasks that have not ended, all at once: a cancel of a subtree, or a subtree
-- whose budget ran out. A task that had ended keeps its outcome; each one stopped now has its
-- `task.<status>` event in the tree's outbox from this same step (outbox_add). Each one stopped now
-- goes on the due list (unless it is there already), in this same step: its caller writes it back
-- into its parent's batch after this step and then takes it off, and a caller that dies between the
-- two leaves it to the reconciler (a stopped top that was delegated, or parked, was off the list, and
-- its parent waited on it for good).
-- KEYS[1] tree events stream
-- KEYS[2] tree live hash
-- KEYS[3..5] the tree's outbox (outbox_add's KEYS)
-- KEYS[6] the due list
-- KEYS[7..] task hashes (the subtree's top first)
-- ARGV[1] str: status of the top
-- ARGV[2] str: status of the rest
-- ARGV[3] str: error of the top
-- ARGV[4] str: error of the rest
-- ARGV[5] str: error class of the top
-- ARGV[6] str: error class of the rest
-- ARGV[7] float: now
-- ARGV[8] int: retention seconds
-- ARGV[9] int: events max length
-- ARGV[10] float: when a task stopped now is due (epoch s; 0: not put on the due list)
-- Returns the ids of the tasks stopped now (by this very call, when it is sent again), the top first.
-- The subtree is stopped from its last task to its top, so each end's events (the stream's, the outbox's) come
-- after its descendants': a receiver that takes the root's `task.cancelled` for the end of the tree has had every
-- child's end before it. The top's outbox event is a millisecond later too: deliveries due at one time are
-- claimed by their ids' text, where `_13` comes before `_2`.
local stopped = {}
for i = #KEYS, 7, -1 do
  local key = KEYS[i]
  local top = (i == 7)
  local was = redis.call('HMGET', key, 'status', 'finished_at', 'error', 'id')
  local status = was[1]
  if was[2] == ARGV[7] and was[3] == (top and ARGV[3] or ARGV[4]) then
    -- Stopped by this very call (its `now` and its error): sent again after its reply was lost (Sentinel's
    -- retry), it answers the tasks it stopped, so its caller still revokes them and writes them back.
    stopped[#stopped + 1] = was[4]
  elseif status and not ENDED[status] then
    local new_status = top and ARGV[1] or ARGV[2]
    redis.call('HSET', key, 'status', new_status, 'error', top and ARGV[3] or ARGV[4],
      'error_class', top and ARGV[5] or ARGV[6], 'updated_at', ARGV[7], 'finished_at', ARGV[7])
    local marked = timeline_add(redis.call('HGET', key, 'timeline'), math.floor(tonumber(ARGV[7]) * 1000 + 0.5),
      new_status)
    if marked then
      redis.call('HSET', key, 'timeline', marked)
    end
    redis.call('EXPIRE', key, ARGV[8])
    local id = was[4]
    local raw = redis.call('HGET', KEYS[2], id)
    local live = raw and cjson.decode(raw) or {task_id = id}
    live['state'] = new_status
    live['ts'] = tonumber(ARGV[7])
    redis.call('HSET', KEYS[2], id, cjson.encode(live))
    event_add(KEYS[1], ARGV[9], ARGV[8], 'type', 'task_status', 'task_id', id, 'status', new_status)
    wake_waiters(KEYS[1], id)
    local at = top and tonumber(ARGV[7]) + 0.001 or ARGV[7]
    outbox_add({KEYS[3], KEYS[4], KEYS[5]}, {id, 'task.' .. new_status, at, ARGV[8], '', key})
    stopped[#stopped + 1] = id
  end
end
for i = 1, math.floor(#stopped / 2) do  -- the top first, as the caller reads them
  stopped[i], stopped[#stopped + 1 - i] = stopped[#stopped + 1 - i], stopped[i]
end
if #stopped > 0 then
  -- The live hash this call wrote may be its own making (a root stopped before any run or delegation wrote it):
  -- a key made with no retention would stay for good (event_add gives the stream its own).
  redis.call('EXPIRE', KEYS[2], ARGV[8])
end
if tonumber(ARGV[10]) > 0 then
  -- In slices: Lua unpacks no more than about 8,000 values, and a stop may name a tree of thousands.
  for first = 1, #stopped, 500 do
    local due = {}
    for i = first, math.min(first + 499, #stopped) do
      due[#due + 1] = ARGV[10]
      due[#due + 1] = stopped[i]
    end
    redis.call('ZADD', KEYS[6], 'NX', unpack(due))
  end
end
return stopped

-- Retry failed tasks of one tree in one step (coordinator/retry.py plans it): each is checked
-- again here, and if any check fails nothing is written. A task to `run` goes back to `active`
-- and onto the due list (its caller publishes its run after this call); a task to `wait` goes
-- back to `delegated` on the batch it is re-opened for, its conversation cut back to the
-- response that made the delegation call. A task of a batch gets its slot there again: its
-- line of the combined result removed, awaited again, and its figures taken back off where its
-- write-back put them (its row back to the earlier children's figures, or out of the parent's
-- unlinked spend when no row carries its link), since its next write-back puts them there
-- again (apply_children.lua sets a linked item's figures, but adds unlinked ones). The closed
-- batch a task waits on again is re-opened: running, with no result.
-- KEYS[1] the due list
-- KEYS[2] tree live hash
-- KEYS[3] tree events stream
-- KEYS[4..] 4 keys per task: task hash, its UI messages, its lease, its conversation
-- KEYS[..] then 5 keys per batch: batch hash, batch lines, parent hash, parent awaiting set, parent todos
-- ARGV[1] float: now (epoch s)
-- ARGV[2] float: when the reconciler looks at the first task to run (epoch s)
-- ARGV[3] float: s: each task to run after it is looked at this much later than the one before it
-- ARGV[4] int: retention seconds
-- ARGV[5] int: events max length
-- ARGV[6] int: number of tasks
-- ARGV[7] int: number of batches
-- ARGV[8..] 5 per task: id, 'run' or 'wait', the index (1-based) of the batch its slot is in (0: none),
--   for 'wait' how many conversation messages to keep and how many it must have now (else 0, 0)
-- ARGV[..] then 3 per batch: batch id, 'open' (still running: its slot is re-opened) or 'closed' (re-
--   opened for its parent, a task to 'wait' here), the parent id
-- Returns {'retried', {retry count of each task, in order}} (also to this very retry sent again after it
--   ran) or {'refused', id, why, detail}: why is 'missing', 'status' (detail: the status), 'caller',
--   'budget' (detail: the error), 'leased', 'batch' (detail: the batch's status), 'parent' (id: an open
--   batch's parent, detail: its status, not 'delegated'), 'chain' or 'conversation' (it changed).
local now, due_at, pace, retention, maxlen = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local n_tasks, n_batches = tonumber(ARGV[6]), tonumber(ARGV[7])
local first_batch_key = 4 + 4 * n_tasks
local first_batch_arg = 8 + 5 * n_tasks

local tasks, batches = {}, {}
for i = 1, n_tasks do
  local k, a = 4 + 4 * (i - 1), 8 + 5 * (i - 1)
  tasks[i] = {
    key = KEYS[k], ui = KEYS[k + 1], lease = KEYS[k + 2], conversation = KEYS[k + 3],
    id = ARGV[a], role = ARGV[a + 1], slot = tonumber(ARGV[a + 2]), keep = tonumber(ARGV[a + 3]),
    length = tonumber(ARGV[a + 4]),
  }
end
for j = 1, n_batches do
  local k, a = first_batch_key + 5 * (j - 1), first_batch_arg + 3 * (j - 1)
  batches[j] = {
    key = KEYS[k], lines = KEYS[k + 1], parent = KEYS[k + 2], awaiting = KEYS[k + 3], todos = KEYS[k + 4],
    id = ARGV[a], state = ARGV[a + 1], parent_id = ARGV[a + 2],
  }
end

-- This very retry again (its reply lost and the call sent again, Sentinel's retry): every task it retried
-- keeps its `now` (`retried_at`), and it answers as it did, writing nothing twice.
local again = {}
for i, t in ipairs(tasks) do
  local f = hash_get(t.key, 'retried_at', 'retries')
  if f[1] ~= now then
    again = nil
    break
  end
  again[i] = tonumber(f[2])
end
if again then
  return {'retried', again}
end

-- Every check first: a refusal writes nothing.
for _, t in ipairs(tasks) do
  local f = hash_get(t.key, 'status', 'runner', 'error_class', 'error')
  if not f[1] then
    return {'refused', t.id, 'missing', ''}
  end
  if f[1] ~= 'failed' then
    return {'refused', t.id, 'status', f[1]}
  end
  if f[2] ~= 'agent' then
    return {'refused', t.id, 'caller', ''}
  end
  if f[3] == 'BudgetExhausted' then
    return {'refused', t.id, 'budget', f[4] or ''}
  end
  if redis.call('EXISTS', t.lease) == 1 then
    return {'refused', t.id, 'leased', ''}
  end
  if t.role == 'wait' and redis.call('LLEN', t.conversation) ~= t.length then
    return {'refused', t.id, 'conversation', ''}
  end
end
for _, b in ipairs(batches) do
  local f = hash_get(b.key, 'status', 'mode')
  if f[2] ~= 'parallel' then
    return {'refused', b.id, 'chain', ''}
  end
  if (b.state == 'open') == (f[1] == 'done') then
    return {'refused', b.id, 'batch', f[1] or 'missing'}
  end
  -- A batch still open under a parent a stop ended (a cancel between stopping its tasks and closing the batch,
  -- or one that died there): its children never run again, to spend under a tree whose figures are final.
  if b.state == 'open' then
    local parent_status = hash_get(b.parent, 'status')[1]
    if parent_status ~= 'delegated' then
      return {'refused', b.parent_id, 'parent', parent_status or 'missing'}
    end
  end
end

-- The failed stretch reads as a wait for the retry, and the task goes on after it (an outcome
-- mark would end its timeline: coordinator/timeline.py).
local function timeline_again(key, state)
  local text = hash_get(key, 'timeline')[1]
  local tl = (text and text ~= '') and cjson.decode(text) or {}
  local m = tl['m'] or {}
  if #m > 0 and (m[#m][2] == 'failed') then
    m[#m][2] = 'wait:retry'
  end
  tl['m'] = m
  local again = timeline_add(cjson.encode(tl), math.floor(tonumber(now) * 1000 + 0.5), state)
  hash_set(key, 'timeline', again or cjson.encode(tl))
end

for _, b in ipairs(batches) do
  if b.state == 'closed' then
    hash_set(b.key, 'status', 'running', 'result', '', 'finished_at', '')
    hash_expire_later(b.key, retention)
  end
end

local counts = {}
for i, t in ipairs(tasks) do
  local f = hash_get(t.key, 'error_class', 'error', 'parent_id', 'depth', 'total_tokens', 'total_cost_micros',
    'todo_id')
  local retries = hash_incr(t.key, 'retries', 1)
  counts[i] = retries
  local status = t.role == 'wait' and 'delegated' or 'active'
  hash_set(t.key, 'status', status, 'error', '', 'error_class', '', 'error_detail', '', 'summary', '',
    'finished_at', '', 'updated_at', now, 'deliveries', 0, 'provider_wait_since_ms', '', 'provider_attempts', 0,
    'retried_at', now)
  hash_expire_later(t.key, retention)
  if t.slot > 0 then
    local b = batches[t.slot]
    if redis.call('HDEL', b.lines, t.id) == 1 then
      -- It was written back: its figures come off where they went, as if it had not been yet (its
      -- subtree total counts as in flight meanwhile), and its next write-back puts them back once.
      local id, item = linked_item(b.todos, t.id, f[7])
      if id then
        item['tokens'] = tonumber(item['prior_tokens']) or 0
        item['cost_micros'] = tonumber(item['prior_cost_micros']) or 0
        redis.call('HSET', b.todos, id, cjson.encode(item))
        hash_incr(b.parent, 'todos_version', 1)
      else
        hash_incr(b.parent, 'unlinked_tokens', -(tonumber(f[5] or '0') or 0))
        hash_incr(b.parent, 'unlinked_cost_micros', -(tonumber(f[6] or '0') or 0))
      end
    end
    redis.call('SADD', b.awaiting, t.id)
    redis.call('EXPIRE', b.awaiting, retention)  -- made again when its batch had closed (the set emptied)
  end
  local said
  if t.role == 'wait' then
    local waits_on = ''
    for _, b in ipairs(batches) do
      if b.parent_id == t.id then
        waits_on = b.id
      end
    end
    hash_set(t.key, 'waiting_batch_id', waits_on)
    redis.call('LTRIM', t.conversation, 0, t.keep - 1)
    timeline_again(t.key, 'wait:children')
    said = 'retried (retry ' .. retries .. '): waits on its failed children, retried; it failed with '
  else
    -- Its run is published after this call; the reconciler publishes it if that never happens. The
    -- runs are published one by one in this order, so each is looked at a publish's pace after the one
    -- before it: looked at before its message was sent, it would read as lost (and be sent twice).
    redis.call('ZADD', KEYS[1], due_at, t.id)
    due_at = due_at + pace
    timeline_again(t.key, 'queued')
    said = 'retried (retry ' .. retries .. '); it failed with '
  end
  said = said .. ((f[1] and f[1] ~= '') and f[1] or 'Error') .. ': ' .. (f[2] or '')
  redis.call('RPUSH', t.ui, cjson.encode({ts = tonumber(now), type = 'say', say = 'retried', text = said}))
  redis.call('EXPIRE', t.ui, retention)
  local parent_id = f[3]
  local live = cjson.encode({
    task_id = t.id, parent_id = (parent_id and parent_id ~= '') and parent_id or cjson.null,
    depth = tonumber(f[4] or '0'), state = t.role == 'wait' and 'delegated' or 'queued', ts = tonumber(now),
  })
  redis.call('HSET', KEYS[2], t.id, live)
  event_add(KEYS[3], maxlen, retention, 'type', 'task_status', 'task_id', t.id, 'status', status)
end
for _, b in ipairs(batches) do
  hash_set(b.parent, 'updated_at', now)
end
redis.call('EXPIRE', KEYS[2], retention)
return {'retried', counts}

-- Hashes read once and written once per script call. A step that does several things
-- (end_run: record usage, finish, write back, close) touches the task's, its parent's and
-- its batch's hashes from several of the scripts it calls; through these functions each
-- hash costs one HMGET (of every field any part needs, `hash_prefetch`) and one HSET, sent
-- when the script returns (`hash_flush`, called by the script's wrapper, base.py). No other
-- client sees the writes held back: a script runs alone. A script reads and writes such a
-- hash only through these functions (a direct HSET would be overwritten, a direct read
-- stale); other fields of the same hash (a batch's lines) may be written directly.
local hash_cache, hash_dirty, hash_order, hash_expire = {}, {}, {}, {}

-- What a read of `value` gives back once written: Redis stores a Lua number as its digits.
-- (These helpers run on every step: they use arithmetic and numeric loops, not math.floor or
-- ipairs, each a C call per value in Lua 5.1; docs/benchmarks.md has what a step costs.)
local function hash_text(value)
  if type(value) == 'number' then
    if value % 1 == 0 and value < 1e15 and value > -1e15 then
      return string.format('%d', value)
    end
    return string.format('%.17g', value)
  end
  return value
end

-- Read `fields` of `key` into the cache, those not there yet, in one HMGET.
local function hash_prefetch(key, fields)
  local have = hash_cache[key]
  local missing = fields
  if have then
    missing = {}
    for i = 1, #fields do
      if have[fields[i]] == nil then
        missing[#missing + 1] = fields[i]
      end
    end
  else
    have = {}
    hash_cache[key] = have
  end
  if #missing > 0 then
    local got = redis.call('HMGET', key, unpack(missing))
    for i = 1, #missing do
      have[missing[i]] = got[i]  -- false when the field is absent, as HMGET gives it
    end
  end
  return have
end

-- As redis.call('HMGET', key, ...): false for an absent field. The table of the names asked for becomes the
-- table of their values (one table a read, not two: every table a step makes is the Lua GC's work later).
local function hash_get(key, ...)
  local out = {...}
  local n = #out
  local have = hash_cache[key]
  if have then
    for i = 1, n do
      if have[out[i]] == nil then
        have = nil
        break
      end
    end
  end
  if not have then
    have = hash_prefetch(key, {...})
  end
  for i = 1, n do
    out[i] = have[out[i]]
  end
  return out
end

-- As redis.call('HSET', key, field, value, ...), sent by hash_flush. A field set to the value it
-- has (read, or set earlier in this call) is left out of the write: it would change nothing.
local function hash_set(key, ...)
  local args = {...}
  local have = hash_cache[key]
  if not have then
    have = {}
    hash_cache[key] = have
  end
  local dirty = hash_dirty[key]
  for i = 1, #args, 2 do
    local name, value = args[i], hash_text(args[i + 1])
    if have[name] ~= value then
      if not dirty then
        dirty = {}
        hash_dirty[key] = dirty
        hash_order[#hash_order + 1] = key
      end
      have[name] = value
      dirty[name] = value
    end
  end
end

-- As redis.call('HINCRBY', key, field, by): the new value.
local function hash_incr(key, name, by)
  local value = (tonumber(hash_get(key, name)[1] or '0') or 0) + by
  hash_set(key, name, value)
  return value
end

-- Whether the task hash `key`'s status is one of `statuses` (space-separated); '' or nil: whatever it is. A
-- free that its caller decided on a status read before (a repair, a stop) holds only while it still is.
local function status_in(key, statuses)
  if (statuses or '') == '' then
    return true
  end
  return string.find(' ' .. statuses .. ' ', ' ' .. (hash_get(key, 'status')[1] or '') .. ' ', 1, true) ~= nil
end

-- The ids a step gave (the runs a slot's release admitted), kept on `key`'s `field` as `<mark> <id>,<id>...`
-- by `keep_given` with a mark of the call's own: this very call sent again (its reply lost, Sentinel's retry)
-- finds its mark and answers the same ids; any other call finds nil.
local function given_before(key, field, mark)
  local kept = hash_get(key, field)[1]
  if not kept or string.sub(kept, 1, #mark + 1) ~= mark .. ' ' then
    return nil
  end
  local ids = {}
  for id in string.gmatch(string.sub(kept, #mark + 2), '[^,]+') do
    ids[#ids + 1] = id
  end
  return ids
end

local function keep_given(key, field, mark, ids)
  if #ids > 0 then
    hash_set(key, field, mark .. ' ' .. table.concat(ids, ','))
  end
end

-- As redis.call('EXPIRE', key, seconds), sent by hash_flush after the writes (once a key).
local function hash_expire_later(key, seconds)
  if not hash_expire[key] then  -- (nil, or false: sent at once by event_add, and not in the order)
    hash_order[#hash_order + 1] = key
  end
  hash_expire[key] = seconds
end

local function hash_flush()
  local done = {}
  for i = 1, #hash_order do
    local key = hash_order[i]
    if not done[key] then
      done[key] = true
      local dirty = hash_dirty[key]
      if dirty then
        local args, n = {}, 0
        for name, value in pairs(dirty) do
          args[n + 1], args[n + 2] = name, value
          n = n + 2
        end
        redis.call('HSET', key, unpack(args, 1, n))
      end
      if hash_expire[key] then
        redis.call('EXPIRE', key, hash_expire[key])
      end
    end
  end
end

-- The task fields record_usage.lua reads: a step that records usage fetches them with the
-- others it needs, in its one HMGET of the task.
local USAGE_FIELDS = {'status', 'tokens_in', 'tokens_out', 'cache_reads', 'cache_writes', 'cost_micros', 'requests',
  'total_tokens', 'total_cost_micros', 'budget_micros', 'id', 'usage_keys'}

-- A run's step as the task's `last_step` keeps it (TaskField.LAST_STEP): the run's token and the step's
-- `now`, which only a resend of that very step carries again (flush_run, record_tool, end_run).
local function run_step(token, now)
  return token .. ' ' .. now
end

-- `fields` and `more` as one list.
local function fields_and(fields, more)
  local out, n = {unpack(fields)}, #fields
  for i = 1, #more do
    out[n + i] = more[i]
  end
  return out
end

-- A task's timeline (coordinator/timeline.py, field `timeline`): `text` with the mark
-- {t_ms, state} appended, or nil when it changes nothing (the same state again, or after an
-- outcome). A mark earlier than the last is moved up to it (two writers' clocks). Past
-- TIMELINE_MAX marks the oldest TIMELINE_FOLD are folded into `f` (ms by state) and `n`,
-- so the field stays small whatever the task does. The bound and the outcomes are declared once,
-- in coordinator/timeline.py (MAX_MARKS, FOLD_MARKS, OUTCOMES): base.py's `_load_script` puts them
-- in below as it loads this prelude. The fold is written here alone, because a script must fold
-- atomically with the state change it marks: the one mark a Python transaction writes (a caller's
-- delegation commit, WATCH/MULTI) is mark_timeline.lua queued inside its MULTI, and Python only
-- reads timelines (tests/test_timeline.py checks this fold over hundreds of marks).
local TIMELINE_MAX, TIMELINE_FOLD = {MAX_MARKS}, {FOLD_MARKS}
-- The statuses that end a task (timeline.py's OUTCOMES), as a set: every script asks `ENDED[status]`
-- (a missing status, false, is not one), the one test of whether a task is over.
local ENDED = {OUTCOMES}
-- The field of the tenants' policies hash that fair_beat.lua sets when the table changed, and the next take
-- (fair_take.lua) takes off as it scores every wanting tenant again; no tenant can be named so.
local POLICIES_CHANGED = '~changed'
-- The whole fold: the stored JSON decoded, marked, folded and encoded again.
local function timeline_fold(text, t_ms, state)
  local tl = (text and text ~= '') and cjson.decode(text) or {}
  local m = tl['m'] or {}
  local last = m[#m]
  if last then
    if ENDED[last[2]] or last[2] == state then
      return nil
    end
    if t_ms < last[1] then
      t_ms = last[1]
    end
  end
  m[#m + 1] = {t_ms, state}
  if #m > TIMELINE_MAX then
    local f = tl['f'] or {}
    for i = 1, TIMELINE_FOLD do
      f[m[i][2]] = (f[m[i][2]] or 0) + (m[i + 1][1] - m[i][1])
    end
    tl['t0'] = tl['t0'] or m[1][1]
    tl['n'] = (tl['n'] or 0) + TIMELINE_FOLD
    local kept = {}
    for i = TIMELINE_FOLD + 1, #m do
      kept[#kept + 1] = m[i]
    end
    m, tl['f'] = kept, f
  end
  tl['m'] = m
  return cjson.encode(tl)
end
-- A mark is appended to the text as text where nothing was folded yet (`{"m":[...]}` alone, as
-- both writers store it then) and the marks stay within the bound: no decode, no encode, the
-- same text cjson would write (its numbers are %.14g, and a time in ms has 13 digits). A
-- state is [a-z:_], so it needs no escaping. Anything else takes the whole fold above.
local function timeline_add(text, t_ms, state)
  if not text or text == '' then
    return '{"m":[[' .. string.format('%d', t_ms) .. ',"' .. state .. '"]]}'
  end
  if string.sub(text, 1, 6) == '{"m":[' and string.sub(text, -3) == ']]}' then
    local last_t, last_state = string.match(text, '^.*%[(%d+),"([^"]*)"%]%]}$')
    -- A mark takes 8 characters at the least (`[0,"a"],`): a shorter text is within the bound uncounted.
    local marks = 0
    if #text >= 8 * TIMELINE_MAX then
      marks = select(2, string.gsub(text, '"%]', ''))
    end
    if last_t and marks < TIMELINE_MAX then
      if ENDED[last_state] or last_state == state then
        return nil
      end
      last_t = tonumber(last_t)
      if t_ms < last_t then
        t_ms = last_t
      end
      return string.sub(text, 1, -3) .. ',[' .. string.format('%d', t_ms) .. ',"' .. state .. '"]]}'
    end
  end
  return timeline_fold(text, t_ms, state)
end

-- An event on a tree's stream (`...`: its fields and values), trimmed to about `maxlen` entries, and the stream's
-- retention. Every script that writes a stream writes it here: an XADD makes a stream that lapsed again, and a key
-- made with no retention would stay for good. The EXPIRE goes with a call's first event on the stream, at once (a
-- script that fails later leaves it sent), and its later events send none (the mark is hash_expire's, which every
-- call starts empty). `retention_s` false only where the caller knows the stream is there with its retention
-- (start_run.lua says why).
local function event_add(stream, maxlen, retention_s, ...)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', ...)
  if retention_s and hash_expire[stream] == nil then
    redis.call('EXPIRE', stream, retention_s)
    hash_expire[stream] = false  -- (sent: hash_flush sends none for a false one)
  end
end

-- Wake whoever waits for the task to settle (Coordinator.wait listens before it reads the status): an empty
-- message on the channel named by the tree's stream key and the task id (keys.py, `Keys.settled`). With
-- nobody listening it costs the server one lookup; a wake-up a waiter misses (its connection dropped)
-- costs it its next status read, a slice later.
local function wake_waiters(events_key, task_id)
  redis.call('PUBLISH', events_key .. ':' .. task_id, '')
end

-- Mark the task of hash `key` (read and written through the cache above); `now_s` in epoch seconds.
-- True when marked, false when the mark changed nothing.
local function timeline_mark(key, now_s, state)
  local text = timeline_add(hash_get(key, 'timeline')[1], math.floor(tonumber(now_s) * 1000 + 0.5), state)
  if text then
    hash_set(key, 'timeline', text)
  end
  return text ~= nil
end

-- The fields of a task's record an event carries (store/outbox.py's EVENT_FIELDS, the same names in the same
-- order, which decodes them): kept with an end's delivery as they are at the event (outbox_add), and read from
-- the record for any other (read_claimed).
local EVENT_FIELDS = {'root_id', 'metadata', 'summary', 'output', 'tokens_in', 'tokens_out', 'total_tokens',
  'cost_micros', 'total_cost_micros', 'error', 'error_class'}

-- A child's line of the combined result (writeback.combined_result has the format; the number is its place
-- in the batch, added when the batch closes): written by its write-back (apply_children), and again with the
-- spend its run made before a stop and recorded after it (record_late_spend).
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

-- What a child's line and its plan item show, read from its record (`got` of line_of).
local function child_figures(key)
  local f = hash_get(key, 'status', 'total_tokens', 'total_cost_micros', 'todo_id', 'description', 'summary',
    'error_class', 'error', 'output')
  return {
    status = f[1], tokens = tonumber(f[2] or '0'), cost = tonumber(f[3] or '0'), todo_id = f[4],
    description = f[5], summary = f[6], error_class = f[7], error = f[8], output = f[9],
  }
end

-- The todo item a child serves, in the todos hash `todos` (item id -> JSON, 'order' -> ids): the
-- one its record names if that item is still linked to it, else (the list was rewritten since)
-- the item that carries its link; nil when none does. Shared by the write-back (apply_children)
-- and a retry, which takes the child's figures back off the same item.
local function linked_item(todos, child_id, todo_id)
  if todo_id and todo_id ~= '' then
    local raw = redis.call('HGET', todos, todo_id)
    if raw then
      local item = cjson.decode(raw)
      if item['subtask_id'] == child_id then
        return todo_id, item
      end
    end
  end
  local order = redis.call('HGET', todos, 'order')
  if order then
    for _, id in ipairs(cjson.decode(order)) do
      local raw = redis.call('HGET', todos, id)
      if raw then
        local item = cjson.decode(raw)
        if item['subtask_id'] == child_id then
          return id, item
        end
      end
    end
  end
  return nil, nil
end

-- A linked item's figures, from its child's (`got`, child_figures): a retried item shows its earlier children's
-- figures too (prior_*), and this child's.
local function item_shows(item, got)
  item['tokens'] = (tonumber(item['prior_tokens']) or 0) + got.tokens
  item['cost_micros'] = (tonumber(item['prior_cost_micros']) or 0) + got.cost
end

-- Whether the run of lease token `token` no longer holds its task's lease `lease` (it stalled past the lapse: a
-- newer run of the task may own it), so the write it asks for must not be made. '' is a write no run makes (an
-- API's, a test's): never fenced. save_approval.lua, set_waiting_approvals.lua and endpoint_park.lua ask it.
local function fenced(lease, token)
  return token ~= '' and redis.call('GET', lease) ~= token
end

-- Whether one of the approvals a task waits on is pending: `waiting` is its `waiting_approval_ids` (JSON;
-- nil, false or '' when none), `prefix` names the tree's approval hashes, and `except_id` is left out (the
-- approval being decided). decide.lua, unwatch_parked.lua and start_run.lua each ask it.
local function approval_pending(waiting, prefix, except_id)
  if not waiting or waiting == '' or waiting == '[]' then
    return false
  end
  for _, approval_id in ipairs(cjson.decode(waiting)) do
    if approval_id ~= except_id and redis.call('HGET', prefix .. approval_id, 'status') == 'pending' then
      return true
    end
  end
  return false
end

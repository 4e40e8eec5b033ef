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
local function hash_text(value)
  if type(value) == 'number' then
    if value == math.floor(value) and math.abs(value) < 1e15 then
      return string.format('%d', value)
    end
    return string.format('%.17g', value)
  end
  return value
end

-- Read `fields` of `key` into the cache, those not there yet, in one HMGET.
local function hash_prefetch(key, fields)
  local have = hash_cache[key]
  if not have then
    have = {}
    hash_cache[key] = have
  end
  local missing = {}
  for _, name in ipairs(fields) do
    if have[name] == nil then
      missing[#missing + 1] = name
    end
  end
  if #missing > 0 then
    local got = redis.call('HMGET', key, unpack(missing))
    for i, name in ipairs(missing) do
      have[name] = got[i]  -- false when the field is absent, as HMGET gives it
    end
  end
  return have
end

-- As redis.call('HMGET', key, ...): false for an absent field.
local function hash_get(key, ...)
  local fields = {...}
  local have = hash_prefetch(key, fields)
  local out = {}
  for i, name in ipairs(fields) do
    out[i] = have[name]
  end
  return out
end

-- As redis.call('HSET', key, field, value, ...), sent by hash_flush.
local function hash_set(key, ...)
  local args = {...}
  local have = hash_cache[key] or {}
  hash_cache[key] = have
  local dirty = hash_dirty[key]
  if not dirty then
    dirty = {}
    hash_dirty[key] = dirty
    hash_order[#hash_order + 1] = key
  end
  for i = 1, #args, 2 do
    local value = hash_text(args[i + 1])
    have[args[i]] = value
    dirty[args[i]] = value
  end
end

-- As redis.call('HINCRBY', key, field, by): the new value.
local function hash_incr(key, name, by)
  local value = (tonumber(hash_get(key, name)[1] or '0') or 0) + by
  hash_set(key, name, value)
  return value
end

-- As redis.call('EXPIRE', key, seconds), sent by hash_flush after the writes (once a key).
local function hash_expire_later(key, seconds)
  if hash_expire[key] == nil then
    hash_order[#hash_order + 1] = key
  end
  hash_expire[key] = seconds
end

local function hash_flush()
  local done = {}
  for _, key in ipairs(hash_order) do
    if not done[key] then
      done[key] = true
      local dirty = hash_dirty[key]
      if dirty then
        local args = {}
        for name, value in pairs(dirty) do
          args[#args + 1] = name
          args[#args + 1] = value
        end
        redis.call('HSET', key, unpack(args))
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

-- `fields` and `more` as one list.
local function fields_and(fields, more)
  local out = {unpack(fields)}
  for _, name in ipairs(more) do
    out[#out + 1] = name
  end
  return out
end

-- A task's timeline (coordinator/timeline.py, field `timeline`): `text` with the mark
-- {t_ms, state} appended, or nil when it changes nothing (the same state again, or after an
-- outcome). A mark earlier than the last is moved up to it (two writers' clocks). Past
-- TIMELINE_MAX marks the oldest TIMELINE_FOLD are folded into `f` (ms by state) and `n`,
-- so the field stays small whatever the task does. The bound and the outcomes are declared once,
-- in coordinator/timeline.py (MAX_MARKS, FOLD_MARKS, OUTCOMES): base.py's `_load_script` puts them
-- in below as it loads this prelude. The fold is here because a script must fold atomically with
-- the state change it marks; Timeline.marked folds the same way for the one mark a Python
-- transaction writes (a caller's delegation commit, WATCH/MULTI, where no script runs), and
-- tests/test_timeline.py holds the two equal over hundreds of marks.
local TIMELINE_MAX, TIMELINE_FOLD = {MAX_MARKS}, {FOLD_MARKS}
local TIMELINE_ENDS = {OUTCOMES}
local function timeline_add(text, t_ms, state)
  local tl = (text and text ~= '') and cjson.decode(text) or {}
  local m = tl['m'] or {}
  local last = m[#m]
  if last then
    if TIMELINE_ENDS[last[2]] or last[2] == state then
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

-- Mark the task of hash `key` (read and written through the cache above); `now_s` in epoch seconds.
local function timeline_mark(key, now_s, state)
  local text = timeline_add(hash_get(key, 'timeline')[1], math.floor(tonumber(now_s) * 1000 + 0.5), state)
  if text then
    hash_set(key, 'timeline', text)
  end
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

-- Write an event into the tree's outbox, one delivery per subscription that asks for it, in the step
-- whose state change causes it (finish_task, stop_tasks, decide, record_usage): an end, an approval or a
-- budget warning is never committed without its deliveries, nor they without it. A tree without
-- subscriptions has no hooks hash, and this costs one HGETALL of nothing.
-- The hooks hash holds, written with the root: `~root` (the root's id), `~tree_cap` and `~cap` (the most
-- deliveries one tree's outbox, and all trees' pending index, may hold: past them an event is counted in
-- `~dropped`, not written), `~seq` (the last event number) and `h:<n>` -> the space-separated event
-- patterns of subscription n ('' once it answered 410); its `s:<n>` (url, secret) is read only by the
-- deliverer (coordinator/outbound.py).
-- KEYS[1] the tree's hooks hash
-- KEYS[2] the tree's outbox hash
-- KEYS[3] the pending deliveries of every tree
-- ARGV[1] str: the task id
-- ARGV[2] str: the event type; `task.<x>` of a task other than the root is `child.<x>`
-- ARGV[3] float: now
-- ARGV[4] int: retention seconds
-- ARGV[5] str: the event's own fields, a JSON object ('' for none: an end's are read from its record)
-- ARGV[6] (optional) str: an end's task hash (finish_task, stop_tasks; called from Lua alone): each
--   delivery keeps the fields of the record an event reads (EVENT_FIELDS) as they are now, and every
--   attempt sends them (read_claimed), not the record as it is then (a retry of the tree clears a failed
--   task's error)
-- Returns how many deliveries were written.
local raw = redis.call('HGETALL', KEYS[1])
if #raw == 0 then
  return 0
end
local conf, hooks = {}, {}
for i = 1, #raw, 2 do
  local name = raw[i]
  if string.sub(name, 1, 2) == 'h:' then
    hooks[#hooks + 1] = {string.sub(name, 3), raw[i + 1]}
  else
    conf[name] = raw[i + 1]
  end
end
-- Kept for as long as the tree has events, whichever a subscription asks for: written once with the root, it
-- must outlive a tree that runs past its retention (a root's end then found no subscription).
redis.call('EXPIRE', KEYS[1], ARGV[4])
local etype = ARGV[2]
if string.sub(etype, 1, 5) == 'task.' and ARGV[1] ~= conf['~root'] then
  etype = 'child.' .. string.sub(etype, 6)
end
-- Only a child's end is held to the caps. The root's own end (written once an end, so once more after each
-- retry), an approval's events and a budget warning are held to neither: the tree's cap counts every delivery
-- the tree ever wrote, delivered ones too, so a wide tree's child events would leave its `on_complete` and
-- `task.*` unwritten, and its approvals told to no one (an operator's `SUBQ_NOTIFY` sink included: the task
-- then waited out its approval's deadline); the fleet's, one tree whose receiver is down fills with its
-- children's events, and every other tree's end and approvals, another tenant's too, were dropped. What
-- the others add is bounded otherwise: a root's ends by the roots, an approval by the tool calls that wait
-- for a person (requested, then decided: two a child of a wide tree whose every child asks), a budget
-- warning by the budgets (once each).
local capped = string.sub(etype, 1, 6) == 'child.'
local function wants(patterns)
  for pattern in string.gmatch(patterns, '%S+') do
    if pattern == '*' or pattern == etype then
      return true
    end
    local n = #pattern
    if n > 2 and string.sub(pattern, n - 1) == '.*' and string.sub(etype, 1, n - 1) == string.sub(pattern, 1, n - 1) then
      return true
    end
  end
  return false
end
local chosen = {}
for i = 1, #hooks do
  if wants(hooks[i][2]) then
    chosen[#chosen + 1] = hooks[i][1]
  end
end
if #chosen == 0 then
  return 0
end
-- The record as at the event (false for a field it lacks: a JSON array keeps its places).
local record = nil
if ARGV[6] then
  record = hash_get(ARGV[6], unpack(EVENT_FIELDS))
  for i = 1, #EVENT_FIELDS do
    if not record[i] then
      record[i] = false
    end
  end
end
local seq = redis.call('HINCRBY', KEYS[1], '~seq', 1)
local event_id = 'evt_' .. conf['~root'] .. '_' .. seq
local now = tonumber(ARGV[3])
local written = 0
for i = 1, #chosen do
  if capped and (redis.call('HLEN', KEYS[2]) >= tonumber(conf['~tree_cap'] or '0')
      or redis.call('ZCARD', KEYS[3]) >= tonumber(conf['~cap'] or '0')) then
    redis.call('HINCRBY', KEYS[1], '~dropped', 1)
  else
    local id = event_id .. '.' .. chosen[i]
    local entry = {id = id, event_id = event_id, type = etype, hook = chosen[i], task_id = ARGV[1], ts = now,
      state = 'pending', attempts = 0, next_at = now, last = ''}
    if ARGV[5] ~= '' then
      entry['fields'] = cjson.decode(ARGV[5])
    end
    entry['record'] = record
    redis.call('HSET', KEYS[2], id, cjson.encode(entry))
    redis.call('ZADD', KEYS[3], math.floor(now * 1000), conf['~root'] .. ' ' .. id)
    written = written + 1
  end
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return written

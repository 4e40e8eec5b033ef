-- Start a run of an agent task in one step: read the task, admit it (admit.lua: a child
-- may have to wait for a run slot, or start after a stagger), take its lease, count the
-- delivery, mark its timeline (`running`, or `wait:admission`: coordinator/timeline.py), put
-- it on the due list while it runs, publish its live status, and say whether a budget over it
-- is spent already; a first run (its run count 1) also says the task's prompt as its first
-- UI message. The caller reads the task's record and its conversation in the same transaction,
-- right after this call (`Scripts.then_read`): read here, each of the record's fields would be
-- made a Lua string and back, the largest part of this step's cost (docs/benchmarks.md).
-- With fair shares off (ARGV[14] 0) the caller leaves KEYS[10..13] and ARGV[15..] off: nothing reads them
-- then, and each key or argument sent costs the server about 1 K instructions (docs/benchmarks.md).
-- KEYS[1] task hash
-- KEYS[2] lease
-- KEYS[3] the due list
-- KEYS[4] tree live hash
-- KEYS[5] tree events stream
-- KEYS[6] UI messages
-- KEYS[7] the tree's running set
-- KEYS[8] the tree's admission list
-- KEYS[9] its last-start time
-- KEYS[10] the tenants that want a slot
-- KEYS[11] the tenants' policies
-- KEYS[12] the runs holding a slot, fleet-wide
-- KEYS[13] the fleet's capacity
-- ARGV[1] str: token
-- ARGV[2] int: lease seconds
-- ARGV[3] float: when the reconciler looks next (epoch s)
-- ARGV[4] float: now
-- ARGV[5] int: events max length
-- ARGV[6] str: the prefix of the tree's task hashes (the budget check reads the ancestors' with a budget,
--   `budget_chain`, or every ancestor's on a record without it: a tree's keys share one prefix, and subq
--   runs on one Redis, so reading keys named in the task's own record is safe here)
-- ARGV[7] int: per-parent run limit
-- ARGV[8] int: per-tree run limit
-- ARGV[9] int: start stagger ms (0: none)
-- ARGV[10] int: now in ms
-- ARGV[11] int: retention seconds
-- ARGV[12] str: the prefix of the tree's running-children sets (the parent's is read from the record, as
--   the ancestors' above)
-- ARGV[13] str: the prefix of the tree's approval hashes (those its record says it waits on, as the
--   ancestors' above)
-- ARGV[14] int: 1: fair shares between tenants are on (nothing below is read when 0)
-- ARGV[15] str: a tenant key's head (the keys module's name up to the tenant)
-- ARGV[16] str: the tail of a tenant's running set
-- ARGV[17] str: the tail of its parked runs
-- ARGV[18] str: the tail of its announced runs
-- ARGV[19] str: a task hash key's head (up to the root id)
-- ARGV[20] str: its middle (between the root id and the task id)
-- ARGV[21] int: how long an announced run counts as queued, ms
-- ARGV[22] int: the fleet's capacity while no heartbeat has counted it (this worker's concurrency)
-- ARGV[23] int: how many parked runs one freed slot may give a slot (more when the fleet grew)
-- ARGV[24] str: the tenant of a record without one
-- ARGV[25] int: the priority of a record without one
-- Returns {verdict, {deliveries, run sequence, exhausted}}: verdict 'run' (the lease is this run's; the
--   same start sent again after it ran answers so too, from what it wrote), 'missing', 'other' (not an
--   agent's, ended or delegated: the caller takes its slow path), 'leased' (another run holds the lease),
--   'asked' (a call its run parked still waits for a person's decision), 'wait' (queued on the admission
--   list for a slot), 'delay' (the counts are {ms to wait}) or 'park' (parked for a slot of its tenant;
--   the counts are {0, why: 'max_running', 'share', 'fleet' or 'order', the task id given the slot instead
--   or ''}); a 'delay' or 'park' sent again answers as it did.
-- Only the fields this step decides on (the record goes to the caller by its own read, see above).
local task = redis.call('HMGET', KEYS[1], 'id', 'status', 'runner', 'parent_id', 'depth', 'deliveries', 'run_seq',
  'timeline', 'budget_micros', 'total_cost_micros', 'budget_chain', 'ancestors', 'prompt', 'tenant', 'priority',
  'run_token', 'waiting_approval_ids')
local id, status, parent_id = task[1], task[2], task[4]
if not id then
  return {'missing', {}}
end
local fair = ARGV[14] == '1'
local tenant = fair and ((task[14] and task[14] ~= '') and task[14] or ARGV[24])
if fair then
  redis.call('ZREM', ARGV[15] .. tenant .. ARGV[18], id)  -- its message has come: no longer queued in the broker
end
if task[3] ~= 'agent' or ENDED[status] or status == 'delegated' then
  return {'other', {}}
end
-- The task itself or the topmost ancestor whose budget is spent already, or ''.
local function budget_reached()
  local exhausted = ''
  local own_budget = tonumber(task[9] or '0') or 0
  if own_budget > 0 and (tonumber(task[10] or '0') or 0) >= own_budget then
    exhausted = id
  end
  local budgeted = task[11]
  if budgeted ~= '[]' then
    -- The ancestors with a budget (`budget_chain`), or every ancestor on a record without it; none
    -- (the common case, '[]') reads nothing.
    local ancestors = cjson.decode((budgeted and budgeted ~= '') and budgeted or task[12] or '[]')
    for i = #ancestors, 1, -1 do
      local f = redis.call('HMGET', ARGV[6] .. ancestors[i], 'budget_micros', 'total_cost_micros')
      local budget = tonumber(f[1] or '0') or 0
      if budget > 0 and (tonumber(f[2] or '0') or 0) >= budget then
        exhausted = ancestors[i]
      end
    end
  end
  return exhausted
end
local held = task[16]
if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] then
  -- This very start again: its reply was lost and the connection sent it again (a token is one start's).
  if held == ARGV[1] then
    if redis.call('GET', KEYS[2]) == ARGV[1] then
      -- It ran: answer it from what it wrote, and write nothing twice (no second delivery, admission or prompt).
      return {'run', {tonumber(task[6]), tonumber(task[7]), budget_reached()}}
    end
  else
    -- It waited (below): the same answer, with no second stagger reserved and no second slot given away.
    local verdict, count, why, given = string.match(held, '^%S+ (%a+) (%d+) ?(%S*) ?(%S*)$')
    if verdict then
      return {verdict, {tonumber(count), why, given}}
    end
  end
end
-- Parked on a call a person has not decided yet: its message delivered again (its worker died between the
-- release and the message's ack) would cut the call off and ask for it again, and the decision on the first
-- would then resume nothing. The decision that ends the wait publishes its resume.
if approval_pending(task[17], ARGV[13], nil) then
  return {'asked', {}}
end
local per_parent, per_tree, stagger = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
if parent_id and parent_id ~= '' and (per_parent > 0 or per_tree > 0 or stagger > 0) then
  -- A root always runs; with no limit set nothing of admission is read.
  -- A start delayed before (another token) kept the start it reserved with its answer: it is that start's.
  local reserved = held and string.match(held, '^%S+ delay %d+ (%d+)$') or '0'
  local admitted = admit({KEYS[7], ARGV[12] .. parent_id, KEYS[8], KEYS[9]},
    {id, ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], reserved})
  if admitted[1] ~= 'run' then
    -- Its timeline waits from now until a slot (or the stagger) lets it start. A delay keeps its answer with
    -- the start's token (a resend of this step answers it again) and the start it reserved (the restart takes
    -- it); a 'wait' is on the admission list once.
    local waited = timeline_add(task[8], tonumber(ARGV[10]), 'wait:admission')
    local writes = {}
    if admitted[1] == 'delay' then
      writes = {'run_token', ARGV[1] .. ' delay ' .. admitted[2] .. ' ' .. admitted[3]}
    end
    if waited then
      writes[#writes + 1], writes[#writes + 2] = 'timeline', waited
    end
    if #writes > 0 then
      redis.call('HSET', KEYS[1], unpack(writes))
    end
    return {admitted[1], {admitted[2]}}
  end
end
if fair then
  -- Fair shares between tenants (fair_admit.lua), roots included: a run holds a worker whoever made it.
  local priority = tonumber(task[15] or '') or ARGV[25]
  local shared = fair_admit({KEYS[10], KEYS[11], KEYS[12], KEYS[13]}, {id, tenant, priority, ARGV[10], ARGV[15],
    ARGV[16], ARGV[17], ARGV[18], ARGV[21], ARGV[22], ARGV[11], ARGV[19], ARGV[20]})
  if shared[1] ~= 'run' then
    local waited = timeline_add(task[8], tonumber(ARGV[10]), 'wait:admission')
    -- Kept with the token, as a delay: a resend must not give a second parked run the slot.
    local answer = ARGV[1] .. ' park 0 ' .. shared[2] .. ' ' .. shared[3]
    if waited then
      redis.call('HSET', KEYS[1], 'run_token', answer, 'timeline', waited)
    else
      redis.call('HSET', KEYS[1], 'run_token', answer)
    end
    return {'park', {0, shared[2], shared[3]}}
  end
end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', ARGV[2]) then
  return {'leased', {}}
end
-- From now on the reconciler looks every tick: a lapsed lease is a dead worker. Added, not
-- only moved (no XX): the entry an earlier step left may be gone (a parent's publish that
-- unwatched it after its batch had closed and watched it for this resume), and a running task
-- that is not on the due list is never published again when its worker dies. No ended task
-- comes back by this: its status was checked above, and this run holds the lease.
redis.call('ZADD', KEYS[3], ARGV[3], id)
local deliveries = (tonumber(task[6] or '0') or 0) + 1
local run_seq = (tonumber(task[7] or '0') or 0) + 1
local started = timeline_add(task[8], tonumber(ARGV[10]), 'running')
-- The run's token is kept with its counts: a resend of this step knows itself by it (above).
if started then
  redis.call('HSET', KEYS[1], 'deliveries', deliveries, 'run_seq', run_seq, 'run_token', ARGV[1], 'timeline', started)
else
  redis.call('HSET', KEYS[1], 'deliveries', deliveries, 'run_seq', run_seq, 'run_token', ARGV[1])
end
-- The live status (models.live_status's form), written as text: ids are [0-9a-z-] and the times
-- are the caller's numbers as it sent them, so nothing in it needs cjson's escaping.
local live = '{"task_id":"' .. id .. '","parent_id":'
  .. ((parent_id and parent_id ~= '') and ('"' .. parent_id .. '"') or 'null')
  .. ',"depth":' .. (tonumber(task[5] or '0') or 0) .. ',"state":"running","ts":' .. ARGV[4] .. '}'
-- A child's field was made with the live hash's retention when it was queued (delegation.py); a field made
-- here is a root's first run's, or one whose hash lapsed in a long run: this step made the hash, and maybe the
-- events stream, so it gives both their retention (a key made with none would stay for good). A field already
-- there says the stream is there too, with its retention (every step that refreshes the live hash refreshes the
-- stream), so a run's start sends no EXPIRE.
local made_live = redis.call('HSET', KEYS[4], id, live) == 1
event_add(KEYS[5], ARGV[5], made_live and ARGV[11], 'type', 'live', 'task_id', id, 'state', 'running')
if made_live then
  redis.call('EXPIRE', KEYS[4], ARGV[11])
end
local exhausted = budget_reached()
if run_seq == 1 then
  -- A first run opens the task's UI messages with its prompt, as AI coding tools show a task. Told by its run
  -- count, not by a conversation (a run that dies before its first step is saved leaves none, and the next run
  -- must not say the prompt again). The list is made here, with its retention (the run's end refreshes it, but a
  -- run that never ends, its worker killed and its task stopped meanwhile, would leave it for good).
  -- Written as text around the prompt's JSON (cjson escapes it): a table encoded whole costs three times that.
  if redis.call('RPUSH', KEYS[6], '{"ts":' .. ARGV[4] .. ',"type":"say","say":"task","text":' .. cjson.encode(task[13]) .. '}') == 1 then
    redis.call('EXPIRE', KEYS[6], ARGV[11])
  end
end
return {'run', {deliveries, run_seq, exhausted}}

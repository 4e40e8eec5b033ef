-- What the attempts of the deliveries just claimed need (claim_deliveries' members), read in the claim's own
-- call (settle_and_claim) rather than in two more round trips after it: each delivery's entry, its
-- subscription (each of a claim read once) and the fields of its task's record that an event carries. A
-- claimed delivery already settled (a claim that outlived its lease and was taken twice) or whose tree has
-- expired is taken off the pending index instead, as the deliverer did with its reply. A claimed
-- delivery's keys are known only here, after the claim: they are the keys module's names, cut where the
-- root and task ids go (OutboxStore), with the ids put back in, as fair_take builds a tenant's.
-- An entry that does not decode, or names no subscription and task, is returned with why, for the
-- deliverer to give up: an error here would fail the whole step, and the entry, claimed again at each
-- lease, every step it was claimed in.
-- KEYS[1] the pending deliveries of every tree
-- ARGV[1] str: a tree key's head (up to the root id)
-- ARGV[2] str: a tree's outbox hash's tail (after the root id)
-- ARGV[3] str: a tree's hooks hash's tail
-- ARGV[4] str: a task hash key's middle (between the root id and the task id)
-- ARGV[5] int: retention seconds
-- ARGV[6..] each str: the claimed members (`<root id> <delivery id>`)
-- Returns per claimed delivery to attempt, oldest first: {its member, its entry (JSON), its subscription's
--   event patterns (false when gone), its target (JSON; false when gone), the fields' values (false for
--   each when the task has expired)}; or, for one whose entry does not decode (not JSON, or without a hook
--   or task_id), {its member, why, the attempts settle_delivery reads it to have}.
local settled = {delivered = true, gone = true, given_up = true}
local subscriptions, kept, out = {}, {}, {}
local function named(id)
  return type(id) == 'string' and id ~= ''
end
for i = 6, #ARGV do
  local member = ARGV[i]
  local root, delivery_id = string.match(member, '^(%S+) (%S+)$')
  local raw = root and redis.call('HGET', ARGV[1] .. root .. ARGV[2], delivery_id)
  local decoded, entry = false, nil
  if raw then
    decoded, entry = pcall(cjson.decode, raw)
  end
  if not raw or (decoded and type(entry) == 'table' and settled[entry['state']]) then
    redis.call('ZREM', KEYS[1], member)
  elseif not decoded then
    out[#out + 1] = {member, 'its entry does not decode: ' .. tostring(entry), 0}
  elseif type(entry) ~= 'table' or not named(entry['hook']) or not named(entry['task_id']) then
    local attempts = type(entry) == 'table' and tonumber(entry['attempts']) or 0  -- as settle_delivery reads them
    out[#out + 1] = {member, 'its entry does not decode: it has no hook or task_id', attempts}
  else
    -- What an attempt reads lives while it is tried: the hooks hash and the task's record, written last at the
    -- event, would lapse under a delivery still retrying (the receiver down longer than the retention, or an
    -- operator's redeliver), which then ended `gone` or `given_up` with nothing wrong but the wait. The gap
    -- between two attempts is held under the retention (settings.py).
    local hook = root .. ' ' .. entry['hook']
    local hooks_key, record_key = ARGV[1] .. root .. ARGV[3], ARGV[1] .. root .. ARGV[4] .. entry['task_id']
    if not subscriptions[hook] then
      subscriptions[hook] = redis.call('HMGET', hooks_key, 'h:' .. entry['hook'], 's:' .. entry['hook'])
      redis.call('EXPIRE', hooks_key, ARGV[5])
    end
    -- An end's delivery keeps the record's fields as they were at the event (outbox_add); one written without
    -- them (an approval's, a budget warning's, or an end's by an earlier release) reads the record as it is.
    -- The record is kept all the same: a Celery callback sends the whole record, read after the claim.
    local values = entry['record']
    if type(values) ~= 'table' then
      values = redis.call('HMGET', record_key, unpack(EVENT_FIELDS))
    end
    if not kept[record_key] then  -- once a call: a task's end is one delivery for each of its subscriptions
      kept[record_key] = true
      redis.call('EXPIRE', record_key, ARGV[5])
    end
    out[#out + 1] = {member, raw, subscriptions[hook][1], subscriptions[hook][2], values}
  end
end
return out

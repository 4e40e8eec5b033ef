-- Record an attempt's outcome on a delivery (or an operator's redeliver), and take it off the pending
-- deliveries or put it back at its next time. A delivery already delivered stays so (a claim that
-- outlived its lease and was taken twice). A 410 ends its subscription: no event is written for it again.
-- An outcome other than delivered is recorded only while the delivery still has the attempts its claim
-- read: the deliverer sends its step again when the reply was lost (Sentinel's failover retry), and the
-- outcomes the first call recorded were each counted again.
-- KEYS[1] the tree's hooks hash
-- KEYS[2] the tree's outbox hash
-- KEYS[3] the pending deliveries of every tree
-- KEYS[4] the attempts' outcomes counted by `<event type> <outcome>` (the metrics)
-- ARGV[1] str: the delivery id
-- ARGV[2] str: its member of the pending deliveries
-- ARGV[3] str: pending (redeliver: due now, attempts from 0), retrying, delivered, gone (a 410: its
--   subscription ends) or given_up
-- ARGV[4] float: when to try again, epoch seconds (retrying)
-- ARGV[5] str: the attempt's answer, one line ('' for none)
-- ARGV[6] float: now
-- ARGV[7] int: retention seconds
-- ARGV[8] int: the attempts the delivery had when claimed (-1: whatever it has)
-- Returns the delivery's state after the call, or '' when it is gone (its tree expired).
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then
  redis.call('ZREM', KEYS[3], ARGV[2])
  return ''
end
local now = tonumber(ARGV[6])
-- An entry that does not decode, or lacks what a delivery's listing reads (the deliverer gives it up for
-- that), is written with what its id says in place of what it lacks, its text kept if it was no object: its
-- outcome is recorded (once: its attempts read as 0 when they are no number) and the tree's deliveries still
-- list. An error here would fail every later step, each sending this outcome again.
local decoded, entry = pcall(cjson.decode, raw)
if not decoded or type(entry) ~= 'table' then
  entry = {stored = raw}
end
if not (entry['hook'] and entry['task_id'] and entry['ts'] and entry['type']) then  -- a well-formed one skips this
  local its_event, its_hook = string.match(ARGV[1], '^(.*)%.([^.]*)$')  -- `<event id>.<subscription>`
  local known = {id = ARGV[1], event_id = its_event or ARGV[1], hook = its_hook or '', type = 'unknown',
    task_id = '', ts = now}
  for name, value in pairs(known) do
    if entry[name] == nil then
      entry[name] = value
    end
  end
end
local state = ARGV[3]
if entry['state'] == 'delivered' and state ~= 'pending' then
  redis.call('ZREM', KEYS[3], ARGV[2])
  return 'delivered'
end
local claimed_attempts = tonumber(ARGV[8])
local other = state ~= 'pending' and state ~= 'delivered'  -- delivered is recorded once: it stays so
if other and claimed_attempts >= 0 and (tonumber(entry['attempts']) or 0) ~= claimed_attempts then
  return entry['state']
end
local patterns = type(entry['hook']) == 'string' and 'h:' .. entry['hook']
if state == 'pending' then
  entry['attempts'] = 0
  entry['next_at'] = now
  entry['since'] = now  -- a redeliver's bounded time counts from it
  redis.call('ZADD', KEYS[3], math.floor(now * 1000), ARGV[2])
  -- An operator's redeliver of a subscription a 410 ended opens it again (its receiver was mended): its events
  -- are written and sent again from now on. Left ended, the redelivery itself was settled `gone` unsent.
  local ended = patterns and redis.call('HGET', KEYS[1], 'g:' .. entry['hook'])
  if ended and redis.call('HGET', KEYS[1], patterns) == '' then
    redis.call('HSET', KEYS[1], patterns, ended)
    redis.call('HDEL', KEYS[1], 'g:' .. entry['hook'])
  end
else
  entry['attempts'] = (tonumber(entry['attempts']) or 0) + 1
  local event_type = type(entry['type']) == 'string' and entry['type'] or 'unknown'  -- not an error
  redis.call('HINCRBY', KEYS[4], event_type .. ' ' .. state, 1)
  entry['last'] = ARGV[5]
  entry['last_at'] = now
  if state == 'retrying' then
    entry['next_at'] = tonumber(ARGV[4])
    redis.call('ZADD', KEYS[3], math.floor(tonumber(ARGV[4]) * 1000), ARGV[2])
  else
    entry['next_at'] = cjson.null
    redis.call('ZREM', KEYS[3], ARGV[2])
  end
  local asked = patterns and redis.call('HGET', KEYS[1], patterns)
  if state == 'gone' and asked and asked ~= '' then
    -- Its patterns kept (`g:`) for a redeliver that opens it again.
    redis.call('HSET', KEYS[1], patterns, '', 'g:' .. entry['hook'], asked)
  end
end
entry['state'] = state
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(entry))
redis.call('EXPIRE', KEYS[2], ARGV[7])
return state

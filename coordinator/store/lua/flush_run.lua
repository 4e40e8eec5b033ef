-- What a run did since its last step, written at once while it still holds its lease:
-- conversation messages, UI messages, each response's usage (record_usage.lua, once per
-- request key, rolled up the ancestors, with the `budget.warning` of a budget whose warning
-- share it crosses), and its live status (while its task has not ended). Then the checks
-- a run makes before its next model request: its status, and the topmost budget reached.
-- KEYS[1] lease
-- KEYS[2] task hash
-- KEYS[3] conversation
-- KEYS[4] UI messages
-- KEYS[5] tree live hash
-- KEYS[6] tree events
-- KEYS[7..9] the tree's outbox (outbox_add's KEYS: a budget warning, record_usage)
-- KEYS[10..] ancestor hashes (parent first, root last)
-- ARGV[1] str: token
-- ARGV[2] int: retention seconds
-- ARGV[3] float: now
-- ARGV[4] int: events max length
-- ARGV[5] int: 1 when end_run calls it: the task's status is not read back, and the task hash's retention
--   is left to the end (it refreshes each key it writes once)
-- ARGV[6] float: the share of a budget whose crossing sends `budget.warning` (record_usage)
-- ARGV[7] str: live status JSON, or ''
-- ARGV[8] int: how many conversation messages
-- ARGV[9] int: how many UI messages
-- ARGV[10] int: how many usage records
-- ARGV[11..] each str: the conversation messages
-- ARGV[..] each str: then the UI messages
-- ARGV[..] then 7 values per usage record (request key, tokens in, tokens out, cache reads, cache writes,
--   cost micro-USD, cost source)
-- ARGV[..] then, to the end, 2 per timeline mark the run took between steps (t ms, state:
--   coordinator/timeline.py)
-- Returns {1, status, exhausted, resent, refused} (status '' when called by end_run; resent 1 when this
--   was the same step again, nothing written twice; refused 1 when its task had ended and its usage
--   records were not written: the run records them by record_late_spend), or {0} when the lease is not
--   this run's (nothing written).
-- A step is known by its run's token and its `now` (`last_step` on the task hash): a step whose reply was
-- lost is sent again by the connection as it was, and finds itself written already.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0}
end
-- The checks a run makes before its next request, as this step's reply: the task's status ('' for end_run)
-- and the topmost budget reached (`exhausted`, when a usage record of this step already said which).
local function flush_checks(keys, in_end, exhausted, recorded, resent, refused)
  if not recorded then
    -- The topmost task of the chain whose budget its subtree has reached (later keys are nearer the root).
    local chain = {keys[2]}
    for i = 10, #keys do
      chain[#chain + 1] = keys[i]
    end
    for _, key in ipairs(chain) do
      local f = hash_get(key, 'budget_micros', 'total_cost_micros', 'id')
      local budget = tonumber(f[1] or '0') or 0
      if budget > 0 and (tonumber(f[2] or '0') or 0) >= budget then
        exhausted = f[3]
      end
    end
  end
  if in_end then
    return {1, '', exhausted, resent, refused}
  end
  return {1, hash_get(keys[2], 'status')[1], exhausted, resent, refused}
end
local retention, now, in_end = ARGV[2], ARGV[3], ARGV[5] == '1'
-- With the status and budget read below, and the last step written: one HMGET (end_run's own prefetch
-- has them all).
if not in_end then
  hash_prefetch(KEYS[2], fields_and(USAGE_FIELDS, {'last_step'}))
end
if in_end or ARGV[7] ~= '' or #ARGV > 10 then
  -- A step that writes (a check alone writes nothing, and answers a resend as it did the first time).
  local step = run_step(ARGV[1], now)
  if hash_get(KEYS[2], 'last_step')[1] == step then
    -- This very step again: the checks only, as the first one answered them.
    -- (Its usage records, refused the first time if its task had ended, are said refused again: the run
    -- records them after, once per request key, record_late_spend.)
    local refused = (tonumber(ARGV[10]) > 0 and ENDED[hash_get(KEYS[2], 'status')[1]]) and 1 or 0
    return flush_checks(KEYS, in_end, '', false, 1, refused)
  end
  hash_set(KEYS[2], 'last_step', step)
end
local n_conv, n_ui, n_usage = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local at = 11
if n_conv > 0 then
  redis.call('RPUSH', KEYS[3], unpack(ARGV, at, at + n_conv - 1))
  redis.call('EXPIRE', KEYS[3], retention)
  at = at + n_conv
end
if n_ui > 0 then
  redis.call('RPUSH', KEYS[4], unpack(ARGV, at, at + n_ui - 1))
  redis.call('EXPIRE', KEYS[4], retention)
  at = at + n_ui
end
-- record_usage's KEYS: the task, the tree's outbox (a budget warning), the ancestors.
local usage_keys = {KEYS[2], KEYS[7], KEYS[8], KEYS[9]}
for i = 10, #KEYS do
  usage_keys[#usage_keys + 1] = KEYS[i]
end
-- record_usage says which budget a recorded request reached; with none recorded, the chain is read below.
local exhausted, recorded, refused = '', false, 0
for _ = 1, n_usage do
  local got = record_usage(usage_keys, {ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4],
    ARGV[at + 5], ARGV[at + 6], now, retention, ARGV[6], in_end and '0' or '1'})
  if got[1] == 1 then
    recorded, exhausted = true, got[2]
  elseif got[1] == -1 then
    refused = 1  -- a stop landed since the run's last step (record_usage)
  end
  at = at + 7
end
if refused == 1 then
  -- Its run records that spend next (record_late_spend, which clears this): until then, or a lapse, the
  -- tree's event stream does not end (coordinator/api/events.py), so its last figures include it. The
  -- server's clock, which the stream's look reads too: a worker's and an API host's may differ.
  hash_set(KEYS[2], 'late_spend_at', redis.call('TIME')[1])
end
while at < #ARGV do
  -- Its task's timeline is read only when the run has marks to add (a wait within it, its end).
  local text = timeline_add(hash_get(KEYS[2], 'timeline')[1], tonumber(ARGV[at]), ARGV[at + 1])
  if text then
    hash_set(KEYS[2], 'timeline', text)
  end
  at = at + 2
end
-- (Not over a stop that landed since the run's last step: the stop's status stays the task's last, in the hash
-- and on the stream, and the run reads the stop in this step's reply.)
if ARGV[7] ~= '' and not ENDED[hash_get(KEYS[2], 'status')[1]] then
  local live = cjson.decode(ARGV[7])
  redis.call('HSET', KEYS[5], live['task_id'], ARGV[7])
  redis.call('EXPIRE', KEYS[5], retention)
  event_add(KEYS[6], ARGV[4], retention, 'type', 'live', 'task_id', live['task_id'], 'state', live['state'])
end
return flush_checks(KEYS, in_end, exhausted, recorded, 0, refused)

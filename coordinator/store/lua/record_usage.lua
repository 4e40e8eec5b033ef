-- Record one model request's usage on the task that made it, once, and roll the
-- spend up into the subtree totals of the task and every ancestor; then say whether
-- a budget on the way up is exhausted. Each hash is read once and written once (hashes.lua).
-- A budgeted task of the chain whose total this request takes from below ARGV[10]'s share of
-- its budget to at or above it has its `budget.warning` written into the tree's outbox here,
-- in the step that records the spend (outbox_add), once: its `budget_warned` field keeps the
-- shares warned. A task without a budget, and a step that crosses no share, read nothing more.
-- KEYS[1] task hash (its `usage_keys` field lists the request keys already recorded, space-separated: read
--   and written with the figures, no key of its own)
-- KEYS[2..4] the tree's outbox (outbox_add's KEYS: a budget warning)
-- KEYS[5..] ancestor task hashes (parent first, root last)
-- ARGV[1] str: request key (unique per request of the task, no spaces; `tool:<call id, URL-quoted>` for a
--   tool call's price, which is spend but no model request: it counts no request and keeps the source)
-- ARGV[2] int: tokens in
-- ARGV[3] int: tokens out
-- ARGV[4] int: cache reads
-- ARGV[5] int: cache writes
-- ARGV[6] int: cost micro-USD
-- ARGV[7] str: cost source
-- ARGV[8] float: now
-- ARGV[9] int: retention seconds
-- ARGV[10] float: the share of a budget (0 < share < 1) whose crossing sends the budgeted task's
--   `budget.warning`, once: its `budget_warned` field keeps the shares warned
-- ARGV[11] (optional) str: '0': leave the task hash's retention to the caller (end_run refreshes it once)
-- ARGV[12] (optional) str: '1': a response its run had before its task was stopped, recorded after the
--   stop (record_late_spend)
-- Returns {recorded, exhausted}: recorded is 1, 0 (this request was recorded before) or -1 (the task has
--   ended, e.g. was cancelled, and ARGV[12] is not '1': a step refuses spend after a stop, and its run
--   records it by record_late_spend); exhausted is the id of the topmost task (nearest the root) whose
--   budget the subtree total has reached, or ''.
local own = hash_get(KEYS[1], unpack(USAGE_FIELDS))
local status = own[1]
if ENDED[status] and ARGV[12] ~= '1' then
  return {-1, ''}
end
local recorded = own[12] or ''
if recorded ~= '' and string.find(' ' .. recorded .. ' ', ' ' .. ARGV[1] .. ' ', 1, true) then
  return {0, ''}
end
local function n(value)
  return tonumber(value or '0') or 0
end
local tokens = n(ARGV[2]) + n(ARGV[3])
local cost = n(ARGV[6])
local exhausted = ''
local total = n(own[9]) + cost
-- The warning of the budgeted task of hash `key` whose subtree total went from `total - cost` to `total`.
local function warn(key, id, budget, total)
  local share = ARGV[10]
  local at = budget * tonumber(share)
  if total - cost >= at or total < at then
    return
  end
  local warned = hash_get(key, 'budget_warned')[1] or ''
  if string.find(' ' .. warned .. ' ', ' ' .. share .. ' ', 1, true) then
    return
  end
  hash_set(key, 'budget_warned', warned == '' and share or (warned .. ' ' .. share))
  outbox_add({KEYS[2], KEYS[3], KEYS[4]}, {id, 'budget.warning', ARGV[8], ARGV[9], cjson.encode({
    budget_micros = budget, total_cost_micros = total, share = tonumber(share),
    share_percent = tonumber(share) * 100})})
end
hash_set(KEYS[1], 'tokens_in', n(own[2]) + n(ARGV[2]), 'tokens_out', n(own[3]) + n(ARGV[3]),
  'cost_micros', n(own[6]) + cost, 'total_tokens', n(own[8]) + tokens, 'total_cost_micros', total,
  'updated_at', ARGV[8], 'usage_keys', recorded == '' and ARGV[1] or (recorded .. ' ' .. ARGV[1]))
-- A figure that does not change is not computed (most requests read and write no cache).
if ARGV[4] ~= '0' then
  hash_set(KEYS[1], 'cache_reads', n(own[4]) + n(ARGV[4]))
end
if ARGV[5] ~= '0' then
  hash_set(KEYS[1], 'cache_writes', n(own[5]) + n(ARGV[5]))
end
if string.sub(ARGV[1], 1, 5) ~= 'tool:' then
  hash_set(KEYS[1], 'requests', n(own[7]) + 1, 'cost_source', ARGV[7])
end
if ARGV[11] ~= '0' then
  hash_expire_later(KEYS[1], ARGV[9])
end
local budget = n(own[10])
if budget > 0 then
  warn(KEYS[1], own[11], budget, total)
  if total >= budget then
    exhausted = own[11]
  end
end
for i = 5, #KEYS do
  local up = hash_get(KEYS[i], 'total_tokens', 'total_cost_micros', 'budget_micros', 'id')
  -- (An ancestor whose record lapsed, one waiting longer than a retention, takes no roll-up: the write would make
  -- its hash again with no retention and only these two fields.)
  if up[4] then
    local up_total = n(up[2]) + cost
    hash_set(KEYS[i], 'total_tokens', n(up[1]) + tokens, 'total_cost_micros', up_total)
    budget = n(up[3])
    if budget > 0 then
      warn(KEYS[i], up[4], budget, up_total)
      if up_total >= budget then
        exhausted = up[4]  -- later keys are nearer the root
      end
    end
  end
end
return {1, exhausted}

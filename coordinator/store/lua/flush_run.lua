-- What a run did since its last step, written at once while it still holds its lease:
-- conversation messages, UI messages, each response's usage (record_usage.lua, once per
-- request key, rolled up the ancestors), its latency, and its live status. Then the checks
-- a run makes before its next model request: its status, and the topmost budget reached.
-- KEYS[1] lease   KEYS[2] task hash   KEYS[3] usage-applied set   KEYS[4] conversation
-- KEYS[5] UI messages   KEYS[6] latency histogram   KEYS[7] tree live hash   KEYS[8] tree events
-- KEYS[9..] ancestor hashes (parent first, root last)
-- ARGV[1] token   ARGV[2] retention seconds   ARGV[3] now   ARGV[4] events max length
-- ARGV[5] live status JSON, or ''   ARGV[6] conversation messages   ARGV[7] UI messages
-- ARGV[8] usage records   ARGV[9] latencies; then the conversation messages, the UI messages,
-- 7 values per usage record (request key, tokens in, tokens out, cache reads, cache writes,
-- cost micro-USD, cost source) and 2 per latency (histogram field, ms).
-- Returns {1, status, exhausted}, or {0} when the lease is not this run's (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0}
end
local retention, now = ARGV[2], ARGV[3]
local n_conv, n_ui, n_usage, n_latency = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local at = 10
if n_conv > 0 then
  redis.call('RPUSH', KEYS[4], unpack(ARGV, at, at + n_conv - 1))
  redis.call('EXPIRE', KEYS[4], retention)
  at = at + n_conv
end
if n_ui > 0 then
  redis.call('RPUSH', KEYS[5], unpack(ARGV, at, at + n_ui - 1))
  redis.call('EXPIRE', KEYS[5], retention)
  at = at + n_ui
end
local usage_keys = {KEYS[2], KEYS[3]}
for i = 9, #KEYS do
  usage_keys[#usage_keys + 1] = KEYS[i]
end
-- record_usage says which budget a recorded request reached; with none recorded, the chain is read below.
local exhausted, recorded = '', false
for _ = 1, n_usage do
  local got = record_usage(usage_keys, {ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4],
    ARGV[at + 5], ARGV[at + 6], now, retention})
  if got[1] == 1 then
    recorded, exhausted = true, got[2]
  end
  at = at + 7
end
for _ = 1, n_latency do
  redis.call('HINCRBY', KEYS[6], ARGV[at], 1)
  redis.call('HINCRBYFLOAT', KEYS[6], 'sum_ms', ARGV[at + 1])
  at = at + 2
end
if ARGV[5] ~= '' then
  local live = cjson.decode(ARGV[5])
  redis.call('HSET', KEYS[7], live['task_id'], ARGV[5])
  redis.call('EXPIRE', KEYS[7], retention)
  redis.call('XADD', KEYS[8], 'MAXLEN', '~', ARGV[4], '*', 'type', 'live', 'task_id', live['task_id'],
    'state', live['state'])
end
if not recorded then
  -- The topmost task of the chain whose budget its subtree has reached (later keys are nearer the root).
  local chain = {KEYS[2]}
  for i = 9, #KEYS do
    chain[#chain + 1] = KEYS[i]
  end
  for _, key in ipairs(chain) do
    local f = redis.call('HMGET', key, 'budget_micros', 'total_cost_micros', 'id')
    local budget = tonumber(f[1] or '0') or 0
    if budget > 0 and (tonumber(f[2] or '0') or 0) >= budget then
      exhausted = f[3]
    end
  end
end
return {1, redis.call('HGET', KEYS[2], 'status'), exhausted}

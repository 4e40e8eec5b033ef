-- Spend a run made before its task was stopped, recorded after the stop. A step refuses usage on an ended
-- task (record_usage), but a response whose tool calls are all idempotent is written with its first call's
-- result: a stop that lands during the call finds it unwritten, and the provider billed it. The run records
-- it here once it reads the stop in its step's reply (coordinator/runs.py), once per request key as always.
-- So does its worker's heartbeat, later, with spend a run held when Redis failed its step (stopped or not:
-- coordinator/heartbeat.py), and with late spend whose record Redis refused.
-- Each level of the chain whose child was written back onto its parent before this (its line is in its
-- batch's lines: apply_children) shows the new figures too: the child's line of the combined result and
-- its plan item (or the parent's unlinked spend). A level not yet written back reads them from the child's
-- record when it is.
-- KEYS[1] task hash (stopped since its run's last step, or one whose step Redis failed)
-- KEYS[2..4] the tree's outbox (outbox_add's KEYS: a budget warning, record_usage)
-- KEYS[5..] ancestor hashes (parent first, root last)
-- ARGV[1] float: now
-- ARGV[2] int: retention seconds
-- ARGV[3] float: the share of a budget whose crossing sends `budget.warning` (record_usage)
-- ARGV[4] str: the prefix of the tree's todo lists
-- ARGV[5] str: the prefix of the tree's batch lines
-- ARGV[6] int: 1: the spend a step refused for a stop, whose mark (`late_spend_at`) this call clears; 0:
--   spend its worker kept when Redis failed a step (the heartbeat's), which leaves the mark to the run
--   that set it
-- ARGV[7..] 7 values per usage record (request key, tokens in, tokens out, cache reads, cache writes, cost
--   micro-USD, cost source)
-- Returns {recorded, exhausted}: how many of the records were recorded now (a record recorded before is
--   not counted again), and the id of the topmost task (nearest the root) whose budget its subtree has
--   reached once they were, '' when none was recorded now or none is reached (its caller stops that
--   subtree unless it has ended, as a step's caller does).
-- The mark of spend still to record (flush_run) goes with this call, whether or not it records anything new;
-- spend a worker kept when Redis failed a step leaves it (a newer run of the task may have set it since).
if ARGV[6] == '1' then
  hash_set(KEYS[1], 'late_spend_at', '')
end
local tokens, cost, recorded, exhausted = 0, 0, 0, ''
for at = 7, #ARGV, 7 do
  local got = record_usage(KEYS, {ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4],
    ARGV[at + 5], ARGV[at + 6], ARGV[1], ARGV[2], ARGV[3], '1', '1'})
  if got[1] == 1 then
    recorded = recorded + 1
    if got[2] ~= '' then
      exhausted = got[2]  -- (totals only grow: a later record's holder is at least as near the root)
    end
    tokens = tokens + tonumber(ARGV[at + 1]) + tonumber(ARGV[at + 2])
    cost = cost + tonumber(ARGV[at + 5])
  end
end
if recorded == 0 then
  return {0, ''}
end
local chain = {KEYS[1], unpack(KEYS, 5)}
for j = 1, #chain - 1 do
  local child = hash_get(chain[j], 'id', 'batch_id')
  local parent = hash_get(chain[j + 1], 'id', 'todos_version')
  if child[1] and child[2] and child[2] ~= '' and parent[1] then
    local lines = ARGV[5] .. child[2]
    if redis.call('HEXISTS', lines, child[1]) == 1 then
      local got = child_figures(chain[j])
      redis.call('HSET', lines, child[1], line_of(child[1], got))
      local todos = ARGV[4] .. parent[1]
      local id, item = linked_item(todos, child[1], got.todo_id)
      if id then
        item_shows(item, got)
        redis.call('HSET', todos, id, cjson.encode(item))
        hash_set(chain[j + 1], 'todos_version', (tonumber(parent[2] or '0') or 0) + 1, 'updated_at', ARGV[1])
      else
        hash_incr(chain[j + 1], 'unlinked_tokens', tokens)
        hash_incr(chain[j + 1], 'unlinked_cost_micros', cost)
      end
    end
  end
end
return {recorded, exhausted}

-- Keep one compaction of a run's conversation (workers/runtime/compaction.py, docs/context.md) while the
-- run still holds its task's lease: the record (which journal messages the model reads folded or elided,
-- the summary, tokens before and after), its `context_compacted` UI message and a `compacted` mark on the
-- task's timeline, all at once. The journal itself is never touched. Records are numbered: a record of a
-- number the task has already is refused, so no turns are compacted twice into two records.
-- KEYS[1] lease
-- KEYS[2] task hash
-- KEYS[3] the task's compaction records
-- KEYS[4] UI messages
-- ARGV[1] str: the run's token
-- ARGV[2] int: the record's number (1 for the task's first)
-- ARGV[3] str: the record (JSON)
-- ARGV[4] str: the context_compacted UI message (JSON)
-- ARGV[5] float: now
-- ARGV[6] int: retention seconds
-- Returns 'kept', 'fenced' when the lease is not this run's, or 'kept_before' when the task has a
--   compaction of that number already (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'fenced'
end
if redis.call('LLEN', KEYS[3]) >= tonumber(ARGV[2]) then
  return 'kept_before'
end
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[6])
redis.call('RPUSH', KEYS[4], ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[6])
-- A point on the timeline, not a state: the run goes on running (coordinator/timeline.py).
timeline_mark(KEYS[2], ARGV[5], 'compacted')
timeline_mark(KEYS[2], ARGV[5], 'running')
return 'kept'

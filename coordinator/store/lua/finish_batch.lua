-- Close a delegation once: store the combined result, set the parent active again,
-- append the result to the parent's UI messages, and announce it on the tree's stream.
-- KEYS[1] batch hash
-- KEYS[2] parent hash
-- KEYS[3] parent UI messages
-- KEYS[4] parent awaiting set
-- KEYS[5] tree events stream
-- ARGV[1] str: combined result text
-- ARGV[2] str: UI message JSON
-- ARGV[3] float: now
-- ARGV[4] int: retention seconds
-- ARGV[5] int: events max length
-- ARGV[6] str: the child that completed it
-- Returns the parent's resume count when closed now (the caller then resumes the parent under that number,
--   so a resume is published once), 0 when closed before.
if hash_get(KEYS[1], 'status')[1] == 'done' then
  return 0
end
hash_set(KEYS[1], 'status', 'done', 'result', ARGV[1], 'finished_at', ARGV[3])
hash_expire_later(KEYS[1], ARGV[4])
local batch_id = hash_get(KEYS[1], 'id')[1]
local parent = hash_get(KEYS[2], 'status', 'waiting_batch_id', 'id', 'runner', 'ends_with_batch')
if parent[1] == 'delegated' and parent[2] == batch_id and parent[5] == '1' then
  -- A submission's root: nobody goes on from it, it ends now (writeback.end_submission, the caller's next step,
  -- or the reconciler's: it is due). Delegated until then, so no waiter takes it for settled meanwhile.
  hash_set(KEYS[2], 'completed_by_child_id', ARGV[6], 'updated_at', ARGV[3])
elseif parent[1] == 'delegated' and parent[2] == batch_id then
  -- The resumed run answers the delegation call from this batch, and may be
  -- delivered SUBQ_MAX_DELIVERIES times anew.
  hash_set(KEYS[2], 'status', 'active', 'waiting_batch_id', '', 'resume_batch_id', batch_id,
    'deliveries', 0, 'completed_by_child_id', ARGV[6], 'updated_at', ARGV[3])
  -- Its wait on the children ends now: an agent's resume is queued, a caller holds its task again.
  timeline_mark(KEYS[2], ARGV[3], parent[4] == 'agent' and 'queued' or 'running')
end
local resumes = hash_incr(KEYS[2], 'resumes', 1)
hash_expire_later(KEYS[2], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('DEL', KEYS[4])
local parent_id = parent[3]
event_add(KEYS[5], ARGV[5], ARGV[4], 'type', 'batch_done', 'task_id', parent_id, 'batch_id', batch_id)
wake_waiters(KEYS[5], parent_id)
return resumes

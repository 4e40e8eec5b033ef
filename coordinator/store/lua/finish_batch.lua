-- Close a delegation once: store the combined result, set the parent active again,
-- append the result to the parent's UI messages, and announce it on the tree's stream.
-- KEYS[1] batch hash   KEYS[2] parent hash   KEYS[3] parent UI messages
-- KEYS[4] parent awaiting set   KEYS[5] tree events stream
-- ARGV[1] combined result text   ARGV[2] UI message JSON   ARGV[3] now
-- ARGV[4] retention seconds   ARGV[5] events max length   ARGV[6] the child that completed it
-- Returns the parent's resume count when closed now (the caller then resumes the
-- parent under that number, so a resume is published once), 0 when closed before.
if redis.call('HGET', KEYS[1], 'status') == 'done' then
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'done', 'result', ARGV[1], 'finished_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
local batch_id = redis.call('HGET', KEYS[1], 'id')
if redis.call('HGET', KEYS[2], 'status') == 'delegated'
    and redis.call('HGET', KEYS[2], 'waiting_batch_id') == batch_id then
  -- The resumed run answers the delegation call from this batch, and may be
  -- delivered SUBQ_MAX_DELIVERIES times anew.
  redis.call('HSET', KEYS[2], 'status', 'active', 'waiting_batch_id', '', 'resume_batch_id', batch_id,
    'deliveries', 0, 'completed_by_child_id', ARGV[6], 'updated_at', ARGV[3])
end
local resumes = redis.call('HINCRBY', KEYS[2], 'resumes', 1)
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('DEL', KEYS[4])
local parent_id = redis.call('HGET', KEYS[2], 'id')
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'type', 'batch_done',
  'task_id', parent_id, 'batch_id', batch_id)
redis.call('EXPIRE', KEYS[5], ARGV[4])
return resumes

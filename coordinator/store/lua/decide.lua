-- Decide a pending approval once: approve, deny, or expire. A second decision changes nothing.
-- Its `approval.decided` event goes into the tree's outbox in this same step (outbox_add).
-- KEYS[1] the approval hash
-- KEYS[2] the pending-approvals zset
-- KEYS[3] tree events stream
-- KEYS[4..6] the tree's outbox (outbox_add's KEYS)
-- KEYS[7] the due list
-- ARGV[1] str: approval id
-- ARGV[2] str: new status (approved|denied|expired)
-- ARGV[3] str: feedback
-- ARGV[4] float: now
-- ARGV[5] int: events max length
-- ARGV[6] str: the prefix of the tree's task hashes
-- ARGV[7] str: the prefix of its approval hashes (the task's hash and its other approvals are named from
--   the approval's record, as start_run reads ancestors: a tree's keys share one prefix)
-- ARGV[8] str: who decided: the API key's name ('' for an expiry), written with the decision
-- ARGV[9] int: retention seconds
-- ARGV[10] str: the prefix of the tree's leases (named from the approval's record, as the task's hash)
-- ARGV[11] float: when the reconciler looks at the task whose wait this decision ends (epoch s)
-- ARGV[12] (optional) str: '1': a withdrawal, the expiry of a call whose run stopped before it asked for
--   all its calls: it ends no task's wait (the task is its newer run's, or the reconciler's)
-- Returns {outcome, reason id}: outcome 'resume' when this decision (or this very decision sent again
--   after it ran) ended its task's wait and no run holds the task's lease: its caller publishes the
--   resume, claimed for the reason id (the first approval of the park this decision ended: read here, as a
--   later park of the task may list others by the time the caller claims); 'ok' when it was decided
--   otherwise; 'stopped' for a person's decision on a call whose task has ended (a stop whose expiry of
--   its calls has not come yet): the call expires now, as the stop's expiry would, and the decision is
--   refused; 'late', nothing written, for an approval made at or after the approval's deadline (its caller
--   expires it); or the approval's status when it was not pending (or 'missing'). The reason id is '' but
--   for 'resume'.
-- The decision that leaves the task no pending approval ends its wait, decided here and nowhere else:
-- two decisions made at once each see the other's, so exactly one of them ends it. Its timeline marks
-- its resume `queued` now (coordinator/timeline.py), and the task goes on the due list in this step:
-- a process that dies before it publishes the resume leaves it to the reconciler, and no step between
-- (unwatch_parked.lua, run by a release or the reconciler) can take off a watch made before the
-- decision. While a run holds the lease (the run that parked the task, not released yet) nothing is
-- to publish: a delivery would find the lease held and do nothing; that run's release publishes it.
local was = redis.call('HMGET', KEYS[1], 'status', 'decided_at', 'decided_by', 'feedback')
local status = was[1]
if not status then
  return {'missing', ''}
end
-- Whether the approvals of `task_id` leave its wait ended: none of those it waits on pending, the task
-- not ended; then 'resume' (with the park's first approval) unless a run holds its lease, else 'ok'. `watch`:
-- put it on the due list too.
local function ends_wait(task_id, watch)
  if not task_id or ARGV[12] == '1' then
    return {'ok', ''}
  end
  local task_key = ARGV[6] .. task_id
  local waiting, task_status = unpack(hash_get(task_key, 'waiting_approval_ids', 'status'))
  if not task_status or ENDED[task_status] then
    return {'ok', ''}
  end
  if approval_pending(waiting, ARGV[7], ARGV[1]) then
    return {'ok', ''}
  end
  if watch then
    -- Its change time too: a reconciler that read the task before this step looks again later rather
    -- than publish it beside this decision's resume.
    timeline_mark(task_key, ARGV[4], 'queued')
    hash_set(task_key, 'updated_at', ARGV[4])
    redis.call('ZADD', KEYS[7], ARGV[11], task_id)
  end
  if redis.call('EXISTS', ARGV[10] .. task_id) == 1 then
    return {'ok', ''}
  end
  local listed = (waiting and waiting ~= '') and cjson.decode(waiting) or {}
  return {'resume', listed[1] or ARGV[1]}  -- (an approval its task does not list: its own id, as before)
end
-- The feedback of a call expired because a person's decision found its task ended (below).
local TASK_ENDED = 'its task had ended'
if status ~= 'pending' then
  if status == ARGV[2] and was[2] == ARGV[4] and was[3] == (ARGV[8] or '') and was[4] == ARGV[3] then
    -- This very decision again (its reply was lost and the connection sent it again): it stands, and
    -- answers as it did (its writes were made; the resume's claim keeps a second publish from running).
    return ends_wait(redis.call('HGET', KEYS[1], 'task_id'), false)
  end
  if status == 'expired' and ARGV[2] ~= 'expired' and was[2] == ARGV[4] and was[4] == TASK_ENDED then
    return {'stopped', ''}  -- this very decision again, which found its task ended: answered as then
  end
  return {status, ''}
end
-- A person's approval at or after the deadline is refused, nothing written: the call timed out, which is a
-- denial (its caller expires it now). Before, it stood while the reconciler had not yet served the expiry's
-- timer (up to a tick, or while no worker ran), and the resumed run ran a call a person was too late to allow.
-- (A late denial stands: it is what the expiry would do, with the person's words for the model.)
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '')
if ARGV[2] == 'approved' and deadline and tonumber(ARGV[4]) >= deadline then
  return {'late', ''}
end
local task_id = redis.call('HGET', KEYS[1], 'task_id')
-- A person's decision on a call whose task has ended (a stop between its own step and its expiry of the tree's
-- calls, or a task failed meanwhile) expires the call, as that expiry would: before, it stood `approved` (an
-- `approval.decided` event and an audit entry) for a call no run would make, its task `cancelled`.
local decided, feedback, by = ARGV[2], ARGV[3], ARGV[8] or ''
local stopped = false
if decided ~= 'expired' and task_id then
  local task_status = hash_get(ARGV[6] .. task_id, 'status')[1]
  if task_status and ENDED[task_status] then
    decided, feedback, by, stopped = 'expired', TASK_ENDED, '', true
  end
end
redis.call('HSET', KEYS[1], 'status', decided, 'feedback', feedback, 'decided_at', ARGV[4], 'decided_by', by)
redis.call('ZREM', KEYS[2], ARGV[1])
outbox_add({KEYS[4], KEYS[5], KEYS[6]}, {task_id, 'approval.decided', ARGV[4], ARGV[9], cjson.encode({
  approval_id = ARGV[1], tool = redis.call('HGET', KEYS[1], 'tool'), status = decided, feedback = feedback,
  decided_by = by})})
-- (The stream may have lapsed while the approval waited: event_add gives the one it makes again its retention.)
event_add(KEYS[3], ARGV[5], ARGV[9], 'type', 'approval', 'approval_id', ARGV[1], 'task_id', task_id,
  'status', decided)
if stopped then
  return {'stopped', ''}
end
return ends_wait(task_id, true)

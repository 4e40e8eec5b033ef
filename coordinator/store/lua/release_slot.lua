-- A run has ended (or released its worker): free its slot and admit, in order, the
-- waiting tasks that now fit. The caller publishes a run for each admitted id. A run's end
-- calls it inside end_run.lua; a run that releases its worker (delegated, waiting for a
-- decision, handed back), a redelivery of an ended task, and the reconciler (a delegated task's, a parked
-- one's whose run died before its release) through `store.release_slot`.
-- KEYS[1] the tree's running set
-- KEYS[2] the tree's admission list
-- KEYS[3] the task's parent's running-children set
-- ARGV[1] str: task id
-- ARGV[2] int: per-parent limit
-- ARGV[3] int: per-tree limit
-- ARGV[4] int: retention seconds
-- ARGV[5] str: the prefix of the tree's task hashes
-- ARGV[6] str: the prefix of its running-children sets
-- ARGV[7] int: how many waiting tasks to look at, from the list's head
-- ARGV[8] float: now (epoch s)
-- ARGV[9] str: only while the task's status is one of these, space-separated ('': whatever it is): nothing
--   freed nor admitted otherwise
-- ARGV[10] str: the token of the run that frees its slots: only while it is the task's last start (its
--   `run_token`); nothing freed nor admitted otherwise ('': whichever run)
-- ARGV[11] (optional) str: the prefix of the tree's approval hashes: only while one of the calls the task
--   waits on is still pending: nothing freed nor admitted otherwise
-- Returns the ids admitted now (removed from the list, added to the running sets; by this very call, when
--   it is sent again).
-- (A waiting task that has ended, or is gone, is taken off the list and admitted to nothing.)
-- (A waiting task's parent, and so its running-children set, is read from its record here:
-- a tree's keys share one prefix and hash tag, and subq runs on one Redis primary.)
-- What a release admitted is kept on the released task with its `now` (`release_reply`): this very release sent
-- again (its reply lost, Sentinel's retry) answers the same ids, so its caller still publishes their runs.
local own = ARGV[5] .. ARGV[1]
local again = given_before(own, 'release_reply', ARGV[8])
if again then
  return again
end
-- The reconciler frees the slot of a delegated task whose run died before its release: not once its batch
-- has closed and a resumed run of it took a slot again (checked here, in the step that frees it).
if not status_in(own, ARGV[9]) then
  return {}
end
-- A run's release frees its slots after its lease, in a step of its own: a run of the task that started between
-- the two (a decision's resume) reuses the slots the task holds, so they are that run's now, not freed here.
if (ARGV[10] or '') ~= '' and hash_get(own, 'run_token')[1] ~= ARGV[10] then
  return {}
end
-- And the slot of a task whose run died after it parked calls for a person, before its release: only while one
-- of them is still pending (no run of the task starts before the last decision: start_run answers `asked`), not
-- once a decision resumed it and its run reuses the slot.
if ARGV[11] and not approval_pending(hash_get(own, 'waiting_approval_ids')[1], ARGV[11], nil) then
  return {}
end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
local per_parent, per_tree = tonumber(ARGV[2]), tonumber(ARGV[3])
local admitted = {}
local waiting = redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[7]) - 1)
for _, id in ipairs(waiting) do
  if per_tree > 0 and redis.call('SCARD', KEYS[1]) >= per_tree then
    break
  end
  local waiter = hash_get(ARGV[5] .. id, 'parent_id', 'timeline', 'status')
  local parent = waiter[1]
  if not parent or parent == '' then
    parent = id
  end
  local parent_set = ARGV[6] .. parent
  if not waiter[3] or ENDED[waiter[3]] then
    -- Stopped while it waited (or its tree expired): off the list, given no slot. Given one, its run was
    -- published only to find it ended, and a process that died before that publish left the slot held.
    redis.call('LREM', KEYS[2], 1, id)
  elseif not (per_parent > 0 and redis.call('SCARD', parent_set) >= per_parent) then
    if redis.call('LREM', KEYS[2], 1, id) == 1 then
      redis.call('SADD', KEYS[1], id)
      redis.call('SADD', parent_set, id)
      redis.call('EXPIRE', KEYS[1], ARGV[4])
      redis.call('EXPIRE', parent_set, ARGV[4])
      admitted[#admitted + 1] = id
      -- Its wait for a slot ends now: its run is queued again (the caller publishes it).
      timeline_mark(ARGV[5] .. id, ARGV[8], 'queued')
    end
  end
end
keep_given(own, 'release_reply', ARGV[8], admitted)
return admitted

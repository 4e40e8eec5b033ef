-- Take tasks off the due list, except those a live run holds the lease of (that run's end, or
-- the reconciler once its lease lapses, takes it off), and, with a status given, except those
-- no longer in it. A caller unwatches a task for what it saw a moment before (a parent whose
-- batch it has just published), and a later step may have watched the task again for a new
-- reason meanwhile (the batch closed, the parent went `active` and its resume was published;
-- then its resumed run started): removing that entry left a task that nobody publishes again
-- when the message is lost or the worker dies. A run holds the lease from its start
-- (start_run.lua puts it on the list in the same call) until its end (end_run.lua takes it
-- off in the same call as it frees the lease).
-- KEYS[1] the due list
-- KEYS[2..] 2 keys per task id of ARGV, in its order: its lease, its task hash
-- ARGV[1] str: the status the task must still have to be taken off ('' for any)
-- ARGV[2..] each str: task ids
-- Returns how many were taken off.
local removed = 0
local wanted = ARGV[1]
for i = 2, #ARGV do
  local task_id = ARGV[i]
  local leased = redis.call('EXISTS', KEYS[2 * (i - 1)]) == 1
  local status_ok = wanted == '' or redis.call('HGET', KEYS[2 * (i - 1) + 1], 'status') == wanted
  if not leased and status_ok then
    removed = removed + redis.call('ZREM', KEYS[1], task_id)
  end
end
return removed

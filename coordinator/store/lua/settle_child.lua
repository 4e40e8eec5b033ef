-- Settle one ended child of a batch: for a parallel batch, write it back onto its parent's
-- todo item (apply_children, once) and, when it was the last the parent awaited, close the
-- batch (close_batch: exactly one closer, decided here, with no race). The one
-- implementation of "apply a child and close its batch": a run's end calls it inside
-- end_run.lua, and every other caller (a redelivery, the reconciler) through
-- `store.settle_child`. A sequential batch is left to its caller, who starts the next step.
-- KEYS[1] parent hash
-- KEYS[2] parent todos
-- KEYS[3] parent awaiting set
-- KEYS[4] tree events stream
-- KEYS[5] batch lines
-- KEYS[6] child hash
-- KEYS[7] batch hash
-- KEYS[8] parent UI messages
-- KEYS[9] the due list
-- ARGV[1] float: now
-- ARGV[2] int: retention seconds
-- ARGV[3] int: events max length
-- ARGV[4] str: child id
-- ARGV[5] float: resume grace seconds
-- ARGV[6] str: the batch's mode when the caller knows it ('' if not)
-- Returns {mode, resumes, resume}: `resumes` the parent's resume count when this call closed the batch (0
--   otherwise), `resume` 1 when the caller must publish the parent's resumed run, 2 when it must end the
--   parent (a submission's root).
local mode = ARGV[6]
if mode == '' then
  mode = hash_get(KEYS[7], 'mode')[1] or ''
end
if mode ~= 'parallel' then
  return {mode, 0, 0}
end
local now, retention, maxlen = ARGV[1], ARGV[2], ARGV[3]
apply_children({KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}, {now, retention, maxlen, ARGV[4]})
if redis.call('SCARD', KEYS[3]) > 0 then
  return {mode, 0, 0}
end
local got = close_batch({KEYS[7], KEYS[1], KEYS[8], KEYS[3], KEYS[4], KEYS[5], KEYS[9], KEYS[2]},
  {now, retention, maxlen, ARGV[5]})
return {mode, got[1], got[2]}

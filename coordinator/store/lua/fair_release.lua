-- Fair shares: a run frees its tenant's slot (its end, or a release of its worker: delegated, waiting for a
-- decision or its provider, handed back), and the free slots of the fleet are given, one at a time, to the
-- neediest tenant's parked runs (fair_take.lua) while the runs holding a slot stay below the fleet's capacity.
-- end_run.lua calls it in the step that ends the run; `store.fair.release` for a release (the reconciler's too,
-- for a parked run that died before its release, and a repair's of an ended task: writeback.settle_ended). A
-- second call for the same run frees nothing (the slot's owner is read from the fleet-wide hash).
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the runs holding a slot, fleet-wide
-- KEYS[4] the fleet's capacity
-- ARGV[1] str: task id
-- ARGV[2] int: now ms
-- ARGV[3] int: retention seconds
-- ARGV[4] int: 1: fair shares between tenants are on (nothing below is read when 0)
-- ARGV[5] str: a tenant key's head (the keys module's name up to the tenant)
-- ARGV[6] str: the tail of a tenant's running set
-- ARGV[7] str: the tail of its parked runs
-- ARGV[8] str: the tail of its announced runs
-- ARGV[9] str: a task hash key's head (up to the root id)
-- ARGV[10] str: its middle (between the root id and the task id)
-- ARGV[11] int: how long an announced run counts as queued, ms
-- ARGV[12] int: the fleet's capacity while no heartbeat has counted it (this worker's concurrency)
-- ARGV[13] int: how many parked runs one freed slot may give a slot (more when the fleet grew)
-- ARGV[14] str: the tenant of a record without one
-- ARGV[15] int: the priority of a record without one
-- ARGV[16] str: this call's own token, kept with what it gave: only its resend carries it again (none from
--   end_run, whose `end_reply` answers its resend)
-- ARGV[17] str: the token of the run that frees its slot: only while it is the task's last start (its
--   `run_token`); nothing freed nor given otherwise ('': whichever run)
-- ARGV[18] str: only while the task's status is one of these, space-separated ('': whatever it is):
--   nothing freed nor given otherwise
-- ARGV[19] (optional) str: the prefix of the run's tree's approval hashes: only while one of the calls its
--   task waits on is still pending: nothing freed nor given otherwise
-- Returns the ids given a slot (the caller publishes their runs; by this very call, when it is sent
--   again).
local id, head, call = ARGV[1], ARGV[5], ARGV[16] or ''
-- The runs a release gave a slot are kept on the released task with its call's token (`fair_release_reply`):
-- this very release sent again (its reply lost, Sentinel's retry) answers the same ids, so its caller
-- publishes them; a second release of the run, a call of its own, gives nothing more.
local own = ARGV[9] .. string.sub(id, 1, 16) .. ARGV[10] .. id
if call ~= '' then
  local again = given_before(own, 'fair_release_reply', call)
  if again then
    return again
  end
end
-- The reconciler frees the slot of a run that died after it parked calls for a person, before its release: only
-- while one of them is still pending (no run of the task starts before the last decision), not once a decision
-- resumed it and its run reuses the slot.
-- A run's release frees its slot after its lease: a run of the task that started between the two (a decision's
-- resume) holds the slot now (fair_admit.lua: admitted already), so it is not freed here.
if (ARGV[17] or '') ~= '' and hash_get(own, 'run_token')[1] ~= ARGV[17] then
  return {}
end
-- A repair frees the slot of a task it read ended: not once a retry made it active again and its new run took a
-- slot (checked here, in the step that frees it); still when the retry made it wait on its children.
if not status_in(own, ARGV[18]) then
  return {}
end
if ARGV[19] and not approval_pending(hash_get(own, 'waiting_approval_ids')[1], ARGV[19], nil) then
  return {}
end
local tenant = redis.call('HGET', KEYS[3], id)
if tenant then
  redis.call('HDEL', KEYS[3], id)
  local running = head .. tenant .. ARGV[6]
  redis.call('SREM', running, id)
  fair_score({KEYS[1], KEYS[2], running, head .. tenant .. ARGV[7], head .. tenant .. ARGV[8]},
    {tenant, ARGV[2], ARGV[11]})
end
local capacity = tonumber(redis.call('GET', KEYS[4]) or ARGV[12])
local admitted = {}
for _ = 1, tonumber(ARGV[13]) do
  if redis.call('HLEN', KEYS[3]) >= capacity then
    break
  end
  local taken = fair_take({KEYS[1], KEYS[2], KEYS[3]}, {head, ARGV[6], ARGV[7], ARGV[8], ARGV[2], ARGV[11], ARGV[3],
    ARGV[9], ARGV[10]})
  if not taken then
    break
  end
  admitted[#admitted + 1] = taken
end
if call ~= '' then
  keep_given(own, 'fair_release_reply', call, admitted)
end
return admitted

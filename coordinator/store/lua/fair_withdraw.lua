-- Fair shares: a stop withdraws the runs it stopped from their tenant's demand. A run parked for a slot, or
-- announced in the broker's queue, leaves those sets only as its message reaches a worker (or after `queued
-- ms`), and a stopped run's message is revoked, so it never does: the tenant would go on wanting slots it
-- cannot use, and, the neediest, hold every freed slot for nobody (fair_take.lua takes nothing while the head
-- tenant's runs are in the broker's queue) while the other tenants' runs wait. Then the free slots are given
-- to the parked runs that now come first (fair_release.lua, for no run of its own). This very call sent again
-- (its reply lost, Sentinel's retry) answers the same ids, kept on the first stopped run's task with its token,
-- so its caller still publishes their runs.
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the runs holding a slot, fleet-wide
-- KEYS[4] the fleet's capacity
-- ARGV[1] str: the tenant
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
-- ARGV[16] str: this call's own token, kept with what it gave on the first run's task: only its resend
--   carries it
-- ARGV[17..] each str: the runs stopped
-- Returns the ids given a slot (fair_release's: the caller publishes their runs).
local head, tenant, call = ARGV[5], ARGV[1], ARGV[16]
local own = ARGV[9] .. string.sub(ARGV[17], 1, 16) .. ARGV[10] .. ARGV[17]
local again = given_before(own, 'fair_withdraw_reply', call)
if again then
  return again
end
local running, parked, queued = head .. tenant .. ARGV[6], head .. tenant .. ARGV[7], head .. tenant .. ARGV[8]
for i = 17, #ARGV do  -- one at a time: a stop of thousands would pass Lua's limit on `unpack`
  redis.call('ZREM', parked, ARGV[i])
  redis.call('ZREM', queued, ARGV[i])
end
fair_score({KEYS[1], KEYS[2], running, parked, queued}, {tenant, ARGV[2], ARGV[11]})
local admitted = fair_release(KEYS, {'', ARGV[2], ARGV[3], unpack(ARGV, 4, 15)})
keep_given(own, 'fair_withdraw_reply', call, admitted)
return admitted

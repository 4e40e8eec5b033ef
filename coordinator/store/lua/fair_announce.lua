-- Fair shares: runs of a tenant were published (a batch's children, a root): they count as the tenant's
-- demand while their messages wait in the broker's queue, which admission cannot see (Celery's queue is one
-- FIFO list), so a tenant whose runs are queued behind another's flood still wants its share. Each leaves as
-- its message reaches a worker (fair_admit.lua, or start_run for a run it does not start), or after
-- `queued ms` (a message lost or never sent must not hold the others back for long).
-- KEYS[1] the tenants that want a slot
-- KEYS[2] the tenants' policies
-- KEYS[3] the tenant's running set
-- KEYS[4] its parked runs
-- KEYS[5] its announced runs
-- ARGV[1] str: the tenant
-- ARGV[2] int: now ms
-- ARGV[3] int: how long an announced run counts as queued, ms
-- ARGV[4] int: retention seconds
-- ARGV[5..] each str: the runs published now
-- Returns nothing.
for i = 5, #ARGV do
  redis.call('ZADD', KEYS[5], ARGV[2], ARGV[i])  -- a publish tried again counts from now
end
redis.call('EXPIRE', KEYS[5], ARGV[4])
fair_score(KEYS, {ARGV[1], ARGV[2], ARGV[3]})

-- Claim the deliveries whose time has come: each claimed one's score moves to the end of its lease, so
-- no other worker takes it meanwhile, and one whose worker died (no settle_delivery before the lease
-- ends) is due again then. The lease is longer than an attempt's timeout (coordinator/outbound.py).
-- KEYS[1] the pending deliveries of every tree (member `<root id> <delivery id>`, score: due ms)
-- ARGV[1] int: now ms
-- ARGV[2] int: how long a claim holds a delivery, ms: past it (its worker died) another takes it
-- ARGV[3] int: the most to claim
-- Returns the members claimed (`<root id> <delivery id>`), oldest first.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local until_ms = tonumber(ARGV[1]) + tonumber(ARGV[2])
for i = 1, #due do
  redis.call('ZADD', KEYS[1], until_ms, due[i])
end
return due

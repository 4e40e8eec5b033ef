-- The deliverer's step (coordinator/outbound.py) in one call: record each attempt's outcome exactly as
-- settle_delivery does alone, claim due deliveries as claim_deliveries does, and read what their attempts
-- need as read_claimed does. One script a batch, not one a delivery: each outcome cost the deliverer a
-- script call's packing and reply (about 45 us of CPU) and the server a script call of its own; and the
-- claim's two reads after it (the entries and subscriptions, then the records' fields) cost the deliverer
-- two more round trips a claim. Atomic as a whole, which each of its parts was alone.
-- KEYS[1] the pending deliveries of every tree (member `<root id> <delivery id>`, score: due ms)
-- KEYS[2] the attempts' outcomes counted by `<event type> <outcome>` (the metrics)
-- KEYS[3..] 2 keys per outcome: its tree's hooks hash, its tree's outbox hash
-- ARGV[1] float: now
-- ARGV[2] int: retention seconds
-- ARGV[3] int: now ms
-- ARGV[4] int: how long a claim holds a delivery, ms: past it (its worker died) another takes it
-- ARGV[5] int: the most to claim (0: none)
-- ARGV[6..9] how a claimed delivery's keys are named, as read_claimed's ARGV[1..4]
-- ARGV[10] int: number of outcomes
-- ARGV[11..] 6 per outcome, as settle_delivery takes them: the delivery id, its member of the pending
--   deliveries, its state (retrying, delivered, gone or given_up), when to try again (epoch s), the
--   attempt's answer, the attempts it had when claimed (-1: any)
-- Returns per claimed delivery to attempt, as read_claimed reads it; none when the limit is 0.
local n_outcomes = tonumber(ARGV[10])
for i = 1, n_outcomes do
  local k, a = 2 * i + 1, 6 * i + 5
  settle_delivery({KEYS[k], KEYS[k + 1], KEYS[1], KEYS[2]},
    {ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[1], ARGV[2], ARGV[a + 5]})
end
if tonumber(ARGV[5]) <= 0 then
  return {}
end
local claimed = claim_deliveries({KEYS[1]}, {ARGV[3], ARGV[4], ARGV[5]})
local reads = {ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[2]}
for i = 1, #claimed do
  reads[#reads + 1] = claimed[i]
end
return read_claimed({KEYS[1]}, reads)

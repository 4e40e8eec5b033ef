-- Keep the keys of a tree in flight (coordinator/keeper.py, the reconciler's leader): a key counts its retention
-- from its last write, and a tree in flight may go a retention without writing some of its keys (a parent waiting
-- on a long child, its todo list and batch lines, a child's record during one long model request). A tree is in
-- flight while its root is an agent's that has not ended, or a caller's that is delegated (a caller's root has
-- no end of its own: an idle one lapses as before). Each key named here that has a retention with less than the
-- floor left is given the whole retention again; a key with no expiry is left with none, and a key gone is not
-- made again. A tree not in flight is left as it is: its keys lapse a retention after their last write.
-- KEYS[1] the root's task hash
-- KEYS[2..] keys of the same tree
-- ARGV[1] int: retention ms
-- ARGV[2] int: a key with less than this many ms left is given its retention again
-- Returns how many keys were given their retention again, or -1 when the tree is not in flight.
local root = redis.call('HMGET', KEYS[1], 'status', 'runner')
local status, runner = root[1], root[2]
if not status or ENDED[status] or (runner ~= 'agent' and status ~= 'delegated') then
  return -1
end
local retention_ms, floor_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local kept = 0
for i = 2, #KEYS do
  local left_ms = redis.call('PTTL', KEYS[i])
  if left_ms >= 0 and left_ms < floor_ms then
    redis.call('PEXPIRE', KEYS[i], retention_ms)
    kept = kept + 1
  end
end
return kept

-- Keep the keys of the trees in flight that one step of the keeper found (coordinator/keeper.py, the reconciler's
-- leader): a key counts its retention from its last write, and a tree in flight may go a retention without writing
-- some of its keys (a parent waiting on a long child, its todo list and batch lines, a child's record during one long
-- model request). A tree is in flight while its root is an agent's that has not ended, or a caller's that is
-- delegated (a caller's root has no end of its own: an idle one lapses as before). Each key of such a tree that has
-- a retention with less than the floor left is given the whole retention again; a key with no expiry is left with
-- none, and a key gone is not made again. A tree not in flight is left as it is: its keys lapse a retention after
-- their last write. The trees of one call are of several slots (docs/architecture.md, Known gaps): one call for
-- what one SCAN call found, not a round trip a tree.
-- KEYS[1..] for each tree, in ARGV's order: its root's task hash, then its keys
-- ARGV[1] int: retention ms
-- ARGV[2] int: a key with less than this many ms left is given its retention again
-- ARGV[3..] each int: how many keys of KEYS are each tree's, its root's hash not counted
-- Returns how many keys were given their retention again.
local retention_ms, floor_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local kept, at = 0, 1
for t = 3, #ARGV do
  local root = redis.call('HMGET', KEYS[at], 'status', 'runner')
  local status, runner = root[1], root[2]
  local last = at + tonumber(ARGV[t])
  if status and not ENDED[status] and (runner == 'agent' or status == 'delegated') then
    for i = at + 1, last do
      local left_ms = redis.call('PTTL', KEYS[i])
      if left_ms >= 0 and left_ms < floor_ms then
        redis.call('PEXPIRE', KEYS[i], retention_ms)
        kept = kept + 1
      end
    end
  end
  at = last + 1
end
return kept

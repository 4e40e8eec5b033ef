-- A run has ended (or released its worker): free its slot and admit, in order, the
-- waiting tasks that now fit. The caller publishes a run for each admitted id.
-- KEYS[1] the tree's running set   KEYS[2] the tree's admission list
-- KEYS[3] the task's parent's running-children set
-- KEYS[4..] running-children sets of the waiting tasks' parents, one per ARGV[5..] id
-- ARGV[1] task id   ARGV[2] per-parent limit   ARGV[3] per-tree limit   ARGV[4] retention seconds
-- ARGV[5..] waiting ids as the caller read them (the list's head, in order), each
-- followed in KEYS by its parent's running-children set
-- Returns the ids admitted now (removed from the list, added to the running sets).
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
local per_parent, per_tree = tonumber(ARGV[2]), tonumber(ARGV[3])
local admitted = {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local parent_set = KEYS[i - 1]
  local tree_full = per_tree > 0 and redis.call('SCARD', KEYS[1]) >= per_tree
  if tree_full then
    break
  end
  if not (per_parent > 0 and redis.call('SCARD', parent_set) >= per_parent) then
    if redis.call('LREM', KEYS[2], 1, id) == 1 then
      redis.call('SADD', KEYS[1], id)
      redis.call('SADD', parent_set, id)
      redis.call('EXPIRE', KEYS[1], ARGV[4])
      redis.call('EXPIRE', parent_set, ARGV[4])
      admitted[#admitted + 1] = id
    end
  end
end
return admitted

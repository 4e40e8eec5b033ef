-- One mark on a task's timeline (coordinator/timeline.py), for a step that is a Python transaction rather
-- than a script: a caller's delegation commit (store/delegation.py) queues this call inside its MULTI, so
-- the mark is hashes.lua's `timeline_add` (its fold past the bound included), atomic with the commit, and
-- the fold is written in Lua alone.
-- KEYS[1] task hash
-- ARGV[1] float: now, epoch seconds
-- ARGV[2] str: the state marked (coordinator/timeline.py)
-- Returns 1 when marked, 0 when the mark changed nothing (the state it has, or after an outcome).
if timeline_mark(KEYS[1], ARGV[1], ARGV[2]) then
  return 1
end
return 0

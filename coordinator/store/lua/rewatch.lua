-- Put a task's place on the due list back as it was before a step's watch, when the step was refused
-- (a delegation: coordinator/delegation.py), unless a step has watched the task since: that watch is
-- another's (a delegation of the same task that committed, a newer run), and taking it off would leave a
-- committed batch that nothing publishes if its process dies.
-- KEYS[1] the due list
-- ARGV[1] str: task id
-- ARGV[2] float: the time this step's watch wrote
-- ARGV[3] str: the time it was due before that watch ('' when it was not on the list)
-- Returns 1 when its place was put back, 0 when a step has watched it since this step's watch (left as it
--   is).
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not due or tonumber(due) ~= tonumber(ARGV[2]) then
  return 0
end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
end
return 1

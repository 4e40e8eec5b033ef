-- Release a run lease only if this run still holds it (compare and delete).
-- KEYS[1] the task's lease
-- ARGV[1] str: this run's token
-- Returns 1 when released, 0 when the lease was another run's or had lapsed.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

-- Append conversation messages only while the run still holds the task's lease (fencing:
-- a run that lost its lease to another worker must not write the conversation beside it).
-- KEYS[1] the lease
-- KEYS[2] the conversation list
-- ARGV[1] str: the run's token
-- ARGV[2] int: retention, s
-- ARGV[3..] each str: the messages
-- Returns 1 when appended, 0 when the lease is no longer this run's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
for i = 3, #ARGV do
  redis.call('RPUSH', KEYS[2], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1

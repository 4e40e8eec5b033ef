-- Keep a dead letter at the head of the list, once a message: a message dead-lettered again while its entry is
-- on the list is not kept twice. That happens when a worker dies after the dead letter and before it
-- acknowledged the message (which comes back to a worker, and fails again), or when the write's reply was lost
-- and the connection sent it again. Each message on the list is a member of the marks set, scored in the order
-- kept: the newest MAX_DEAD_LETTERS are kept of both, so a message trimmed off the list loses its mark too.
-- KEYS[1] the dead-letter list
-- KEYS[2] the marks of the messages on it (a zset: the message's digest, scored in the order kept)
-- ARGV[1] str: the entry (JSON)
-- ARGV[2] str: the message's digest (its delivery tag, task id and body; else its raw text)
-- ARGV[3] int: the most entries kept
-- Returns 1 when the entry was kept, 0 when the same message is on the list already.
if redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  return 0
end
-- The list first: a list Redis refuses (not a list) fails the call before anything is written, and the message
-- is read again and kept once the list takes it. (The mark's key, read above, takes the ZADD.)
redis.call('LPUSH', KEYS[1], ARGV[1])
-- Scored one above the newest mark, not by a clock (a clock stepped back would trim the newest mark by rank).
local newest = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[2], (tonumber(newest[2]) or 0) + 1, ARGV[2])
local cap = tonumber(ARGV[3])
redis.call('LTRIM', KEYS[1], 0, cap - 1)
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -cap - 1)
return 1

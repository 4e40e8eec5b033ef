-- Admission control: may this task's run start now? At most N children of one parent
-- and M tasks of one tree run at once; the rest wait in order, holding no worker.
-- KEYS[1] the tree's running set
-- KEYS[2] the parent's running-children set
-- KEYS[3] the tree's admission list
-- KEYS[4] the tree's last-start time
-- ARGV[1] str: task id
-- ARGV[2] int: per-parent limit (0: none)
-- ARGV[3] int: per-tree limit (0: none)
-- ARGV[4] int: stagger ms (0: none)
-- ARGV[5] int: now ms
-- ARGV[6] int: retention seconds
-- ARGV[7] int: the start this task's delayed start reserved (ms; 0: none)
-- Returns {'run', 0}, {'wait', 0} (queued in the admission list), or {'delay', ms, the start reserved
--   (ms)}.
local id = ARGV[1]
if redis.call('SISMEMBER', KEYS[1], id) == 1 then
  return {'run', 0}  -- admitted already (a redelivery, or a start from the admission list)
end
local per_parent, per_tree = tonumber(ARGV[2]), tonumber(ARGV[3])
local full = (per_parent > 0 and redis.call('SCARD', KEYS[2]) >= per_parent)
  or (per_tree > 0 and redis.call('SCARD', KEYS[1]) >= per_tree)
if full then
  if redis.call('LPOS', KEYS[3], id) == false then
    redis.call('RPUSH', KEYS[3], id)
    redis.call('EXPIRE', KEYS[3], ARGV[6])
  end
  return {'wait', 0}
end
local stagger = tonumber(ARGV[4])
local reserved = tonumber(ARGV[7]) or 0
local now = tonumber(ARGV[5])
if stagger > 0 and reserved > 0 and now < reserved + stagger then
  -- Its delayed start comes back (a new run, a new token) within a stagger of the start it reserved: that start
  -- is its own. Read against the last start, which is that reservation or a later one, it was delayed again at
  -- every return and never ran. One later than that (its worker died, the reconciler published it again) starts
  -- as any other below: several such at once would otherwise all run in the same moment, and the next start too.
  if now < reserved then
    return {'delay', reserved - now, reserved}  -- early: the rest of its wait, no second reservation
  end
  if now > tonumber(redis.call('GET', KEYS[4]) or '0') then
    redis.call('SET', KEYS[4], now, 'EX', ARGV[6])
  end
elseif stagger > 0 then
  local last = tonumber(redis.call('GET', KEYS[4]) or '0')
  if now - last < stagger then
    redis.call('SET', KEYS[4], last + stagger, 'EX', ARGV[6])  -- reserve the next start
    return {'delay', last + stagger - now, last + stagger}
  end
  redis.call('SET', KEYS[4], now, 'EX', ARGV[6])
end
redis.call('SADD', KEYS[1], id)
redis.call('SADD', KEYS[2], id)
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
-- Off the list if it waited there (its first start's message came again, after its worker died before the
-- ack, and found room): a freed slot must not admit it a second time.
redis.call('LREM', KEYS[3], 1, id)
return {'run', 0}

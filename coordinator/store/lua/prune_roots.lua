-- A tenant's ended roots taken out of its running roots (QuotaStore.prune_roots), each only while it is still
-- as the prune read it, a round trip before: its score the one read, and its record still ended (or still
-- unwritten, for a root read without one). A retry counts an ended root again and then runs it (retry.py):
-- a removal decided on the earlier read would take that count away, and the root would run uncounted, one
-- over the tenant's max_running_roots. A record gone meanwhile (expired) keeps its root until a later look.
-- The roots read as running and counted long ago are counted anew (XX: one taken out meanwhile stays out).
-- The task hashes are of the roots' trees, not of the tenant's slot: subq runs on one Redis, not Cluster.
-- KEYS[1] the tenant's running roots zset (root id -> ms)
-- KEYS[2..] the task hash of each root of ARGV's triples, in their order
-- ARGV[1] int: retention seconds (the running roots zset's lifetime)
-- ARGV[2] float: now ms: the new score of each root counted anew
-- ARGV[3] int: how many roots the prune read as ended
-- ARGV[4..] 3 per root read as ended: its id, its score as read, its status as read ('' for no record)
-- ARGV[..] each str: then the roots read as running, counted long ago: counted anew at now
-- Returns how many roots were taken out.
local roots, ended = KEYS[1], tonumber(ARGV[3])
local removed = 0
for i = 1, ended do
  local at = 4 + (i - 1) * 3
  local root = ARGV[at]
  local score = redis.call('ZSCORE', roots, root)
  if score and tonumber(score) == tonumber(ARGV[at + 1]) then
    local status = redis.call('HGET', KEYS[1 + i], 'status')
    if ENDED[status] or (not status and ARGV[at + 2] == '') then
      removed = removed + redis.call('ZREM', roots, root)
    end
  end
end
local first_running = 4 + ended * 3
for i = first_running, #ARGV do
  -- GT: a retry that counted the root again since the read wrote a later time, which stays.
  redis.call('ZADD', roots, 'XX', 'GT', ARGV[2], ARGV[i])
end
if #ARGV >= first_running then
  redis.call('EXPIRE', roots, ARGV[1])
end
return removed

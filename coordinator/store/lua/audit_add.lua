-- Add one entry to the audit log, trim what is past the retention and the cap, and count a refusal, once: the
-- same entry sent again after its reply was lost (a Sentinel client sends a command again after a connection
-- error) finds its mark and writes nothing. Each entry's mark is its own (store/audit.py), kept a few minutes.
-- KEYS[1] the audit stream
-- KEYS[2] the refused requests' counts by reason
-- KEYS[3] this entry's mark
-- ARGV[1] int: how long the mark is kept, seconds
-- ARGV[2] int: the most entries kept
-- ARGV[3] str: the oldest entry id kept (`<ms>-0`)
-- ARGV[4] str: the refusal's reason ('' for an entry that is not a refusal)
-- ARGV[5..] the entry's fields and values
-- Returns 1 when the entry was added, 0 when this very entry had been added before.
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 5))
-- Kept as long as task history: entries older than the retention go (whole nodes, `~`).
redis.call('XTRIM', KEYS[1], 'MINID', '~', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
end
return 1

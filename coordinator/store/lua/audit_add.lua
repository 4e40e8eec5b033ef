-- Add one entry to the audit log, trim what is past the retention and the cap, and count a refusal, once: the
-- same entry sent again after its reply was lost (a Sentinel client sends a command again after a connection
-- error) finds its mark and writes nothing. Each entry's mark is its own (store/audit.py), kept a few minutes.
-- A refusal is counted whatever comes, and logged while its actor's minute holds fewer than ARGV[5]: the first
-- past it is logged saying the rest of the minute's are counted alone, so one key's flood of refused requests
-- cannot push the other tenants' decisions and cancels past the cap.
-- KEYS[1] the audit stream
-- KEYS[2] the refused requests' counts by reason
-- KEYS[3] this entry's mark
-- KEYS[4] the count of its actor's refusals put on the log this minute (a refusal's)
-- ARGV[1] int: how long the mark is kept, seconds
-- ARGV[2] int: the most entries kept
-- ARGV[3] str: the oldest entry id kept (`<ms>-0`)
-- ARGV[4] str: the refusal's reason ('' for an entry that is not a refusal)
-- ARGV[5] int: the most refusals of one actor put on the log a minute
-- ARGV[6..] the entry's fields and values
-- Returns 1 when the entry was added, 0 when this very entry had been added before, 2 when a refusal was
--   counted and not logged (its actor's minute was full).
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
local fields = {unpack(ARGV, 6)}
if ARGV[4] ~= '' then
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
  local logged = redis.call('INCR', KEYS[4])
  if logged == 1 then
    redis.call('EXPIRE', KEYS[4], 120)
  end
  local most = tonumber(ARGV[5])
  if logged > most + 1 then
    return 2
  end
  if logged == most + 1 then
    for i = 1, #fields - 1, 2 do
      if fields[i] == 'detail' then
        fields[i + 1] = 'more than ' .. most .. ' refusals this minute: the rest of the minute\'s are counted ' ..
          '(subq_refused_requests_total), not logged'
      end
    end
  end
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
-- Kept as long as task history: entries older than the retention go (whole nodes, `~`).
redis.call('XTRIM', KEYS[1], 'MINID', '~', ARGV[3])
return 1

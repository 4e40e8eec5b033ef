-- May a request go to a provider's endpoint now? The fleet's one view of it (coordinator/endpoints.py).
-- KEYS[1] the endpoint's hash
-- ARGV[1] int: now ms
-- ARGV[2] str: the asking run's token
-- ARGV[3] int: the probe's lease ms
-- ARGV[4] int: how long to wait, at most, before asking again while another run's probe is out (ms)
-- Returns {wait ms (0: send it now), failures in a row, the last error line}.
-- Not down: send. Down until a time still to come: wait for it. Its time come: the first run to ask
-- sends one request, the probe, and holds the endpoint's one try for the lease; the others wait for
-- the probe's answer (a success deletes the hash, a failure marks it down again: endpoint_failed.lua).
local now = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'down_until_ms', 'failures', 'error', 'probe', 'probe_until_ms')
if not h[1] then
  return {0, 0, ''}
end
local down_until = tonumber(h[1])
local failures = tonumber(h[2] or '0')
local err = h[3] or ''
if now < down_until then
  return {down_until - now, failures, err}
end
local probe_until = tonumber(h[5] or '0')
if (not h[4]) or h[4] == ARGV[2] or probe_until <= now then
  redis.call('HSET', KEYS[1], 'probe', ARGV[2], 'probe_until_ms', now + tonumber(ARGV[3]))
  return {0, failures, err}
end
return {math.min(probe_until - now, tonumber(ARGV[4])), failures, err}

-- A request to a provider's endpoint failed with a transient error: mark one of the endpoint's views down for
-- the fleet, its host's (a refused or dropped connection, a timeout) or its model's (429, 5xx, 529).
-- KEYS[1] the hash of the endpoint's view the error marks (its host's, or a model's)
-- ARGV[1] int: now ms
-- ARGV[2] int: backoff base ms
-- ARGV[3] int: backoff cap ms
-- ARGV[4] float: jitter, in [0, 1)
-- ARGV[5] int: the wait the provider asked for (Retry-After, retry-after-ms), ms; -1: none
-- ARGV[6] str: the error line
-- ARGV[7] int: how long the hash outlives the endpoint's wait, ms
-- Returns {ms until the endpoint may be tried again, failures in a row}.
-- Only a failure of an endpoint that was up, or whose wait was over (a probe), counts: the requests in
-- flight as it went down all fail together, and the backoff must grow with the probes that fail, not
-- with the size of the fleet. The backoff is exponential with equal jitter (half fixed, half random,
-- so it still grows) and a cap; a wait the provider asked for is honoured whenever it is longer.
local now = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'down_until_ms', 'failures')
local down_until = tonumber(h[1] or '0')
local failures = tonumber(h[2] or '0')
if now >= down_until then
  failures = failures + 1
  local backoff = math.min(tonumber(ARGV[3]), tonumber(ARGV[2]) * 2 ^ (failures - 1))
  down_until = now + math.floor(backoff * (0.5 + tonumber(ARGV[4]) / 2))
end
local asked = tonumber(ARGV[5])
if asked >= 0 then
  down_until = math.max(down_until, now + asked)
end
redis.call('HSET', KEYS[1], 'down_until_ms', down_until, 'failures', failures, 'error', ARGV[6])
redis.call('HDEL', KEYS[1], 'probe', 'probe_until_ms')
redis.call('PEXPIRE', KEYS[1], down_until - now + tonumber(ARGV[7]))
return {down_until - now, failures}

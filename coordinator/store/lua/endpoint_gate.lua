-- May a request go to a model of a provider's endpoint now? The fleet's two views of it (coordinator/endpoints.py):
-- its host's (refused or dropped connections, timeouts) and the model's (what the provider said of it).
-- KEYS[1] the endpoint host's hash
-- KEYS[2] the hash of the model's view of the endpoint
-- ARGV[1] int: now ms
-- ARGV[2] str: the asking run's token
-- ARGV[3] int: the probe's lease ms
-- ARGV[4] int: how long to wait, at most, before asking again while another run's probe is out (ms)
-- Returns {wait ms (0: send it now), failures in a row, the last error line, the view ('host', 'model';
--   '': up)}.
-- Each view: not down, send. Down until a time still to come: wait for it. Its time come: the first run to ask
-- sends one request, the probe, and holds that view's one try for the lease; the others wait for the probe's
-- answer (an answer deletes the hash, a failure marks it down again: endpoint_failed.lua). A request goes only
-- when both views let it: the longer wait is answered (the host's on a tie), and no probe is taken while the
-- other view says wait, so a probe's lease is never held by a run that does not send.
local now = tonumber(ARGV[1])

local function view(key)
  local h = redis.call('HMGET', key, 'down_until_ms', 'failures', 'error', 'probe', 'probe_until_ms')
  if not h[1] then
    return 0, 0, '', false
  end
  local down_until = tonumber(h[1])
  local failures = tonumber(h[2] or '0')
  local err = h[3] or ''
  if now < down_until then
    return down_until - now, failures, err, false
  end
  local probe_until = tonumber(h[5] or '0')
  if (not h[4]) or h[4] == ARGV[2] or probe_until <= now then
    return 0, failures, err, true
  end
  return math.min(probe_until - now, tonumber(ARGV[4])), failures, err, false
end

local host_wait, host_failures, host_err, host_probe = view(KEYS[1])
local model_wait, model_failures, model_err, model_probe = view(KEYS[2])
if host_wait > 0 or model_wait > 0 then
  if host_wait >= model_wait then
    return {host_wait, host_failures, host_err, 'host'}
  end
  return {model_wait, model_failures, model_err, 'model'}
end
local probe_until = now + tonumber(ARGV[3])
if host_probe then
  redis.call('HSET', KEYS[1], 'probe', ARGV[2], 'probe_until_ms', probe_until)
end
if model_probe then
  redis.call('HSET', KEYS[2], 'probe', ARGV[2], 'probe_until_ms', probe_until)
end
if host_failures > 0 then
  return {0, host_failures, host_err, 'host'}
end
if model_failures > 0 then
  return {0, model_failures, model_err, 'model'}
end
return {0, 0, '', ''}

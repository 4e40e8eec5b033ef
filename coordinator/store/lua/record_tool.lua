-- A tool call returned (or was answered without running): keep its result, count it on its
-- task, and write the run's step with it (flush_run), in one round trip. The result is kept
-- the moment the call returns, so a run resumed after its worker died replays it instead of
-- calling the tool again; the step's checks (the task's status, the topmost budget reached)
-- serve as the check before the run's next model request.
-- KEYS[1] the task's tool-results hash   KEYS[2..] flush_run's KEYS
-- ARGV[1] tool call id   ARGV[2] the result (JSON) to keep, or '' to keep none
-- ARGV[3] the counter field of the outcome (`tool:<tool>:<outcome>`)
-- ARGV[4] the time field (`tool:<tool>:ms`)   ARGV[5] the call's ms (0: not added)
-- ARGV[6..] flush_run's ARGV
-- Returns flush_run's reply: {1, status, exhausted}, or {0} when the lease is not this
-- run's (nothing written: another run owns the task and answers the call itself).
local flush_keys, flush_argv = {}, {}
for i = 2, #KEYS do
  flush_keys[#flush_keys + 1] = KEYS[i]
end
for i = 6, #ARGV do
  flush_argv[#flush_argv + 1] = ARGV[i]
end
local reply = flush_run(flush_keys, flush_argv)
if reply[1] == 0 then
  return reply
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], flush_argv[2])
end
-- The counters are fields no script reads through hashes.lua's cache: written directly.
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
if tonumber(ARGV[5]) > 0 then
  redis.call('HINCRBY', KEYS[3], ARGV[4], ARGV[5])
end
return reply

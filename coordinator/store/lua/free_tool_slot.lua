-- Free a call's fleet-wide tool slot (tool_slot.lua) only if the take that frees it is still the slot's
-- last: a later take of the same call (a new run of its task) holds it with another lease end.
-- KEYS[1] the glob's slots zset
-- ARGV[1] str: the call's member
-- ARGV[2] int: when the take that frees it said its lease ends, ms
-- Returns 1 when freed; 0 when the call holds it no more (taken again since, or its lease lapsed).
if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or -1) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0

-- A request to an endpoint was answered: forget the failures of its views (its host's, and the model's when the
-- answer was of one), and take the tasks parked on them off their lists, for the caller to wake now; once: the
-- same call sent again after its reply was lost (a Sentinel client's retry) finds its mark and answers the same
-- tasks. Before, the resend found the views up and the lists gone, and those runs waited for their own timers.
-- KEYS[1] this call's mark
-- KEYS[2..] each view's hash (its host's, then a model's), then each view's parked tasks, in that order
-- ARGV[1] int: how many keys follow the mark
-- ARGV[2] int: how long the mark is kept, seconds
-- Returns the ids of the tasks parked on those views: none when no view was down.
local kept = redis.call('GET', KEYS[1])
if kept then
  local ids = {}
  for id in string.gmatch(kept, '%S+') do
    ids[#ids + 1] = id
  end
  return ids
end
local views = tonumber(ARGV[1]) / 2
if redis.call('DEL', unpack(KEYS, 2, 1 + views)) == 0 then
  return {}  -- it was up: nothing is parked on it
end
local ids = {}
for i = 2 + views, 1 + 2 * views do
  local parked = redis.call('ZRANGE', KEYS[i], 0, -1)
  for j = 1, #parked do
    ids[#ids + 1] = parked[j]
  end
end
redis.call('DEL', unpack(KEYS, 2 + views, 1 + 2 * views))
if #ids > 0 then
  redis.call('SET', KEYS[1], table.concat(ids, ' '), 'EX', ARGV[2])
end
return ids

-- Claim a task's resume for one reason (an approval decided), once, and number it: the claim and
-- the count are one step, so a claim sent again after its reply was lost (Sentinel's retry) finds its
-- own token and answers the number it took, rather than "claimed by another" or a second count.
-- A claim written before the token (a bare 1) is another's.
-- KEYS[1] task hash
-- ARGV[1] str: the claim's field (`resumed:<reason id>`)
-- ARGV[2] str: this claim's token
-- Returns the resume count the caller publishes the task's resumed run under, 0 when another claimed it.
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  local token, resumes = string.match(held, '^(%S+) (%d+)$')
  if token == ARGV[2] then
    return tonumber(resumes)
  end
  return 0
end
local resumes = redis.call('HINCRBY', KEYS[1], 'resumes', 1)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. resumes)
return resumes

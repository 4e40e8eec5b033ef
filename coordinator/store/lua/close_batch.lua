-- Close a delegation once, in constant time per child: the combined result is the batch's
-- stored lines (one per child, written as each child was applied, apply_children.lua) in
-- dispatch order, no sibling is read. Watches an agent parent that will be resumed (the due
-- list) before it closes, so a resume lost after the close is published by the reconciler;
-- then closes with finish_batch.
-- KEYS[1] batch hash
-- KEYS[2] parent hash
-- KEYS[3] parent UI messages
-- KEYS[4] parent awaiting set
-- KEYS[5] tree events stream
-- KEYS[6] batch lines
-- KEYS[7] the due list
-- KEYS[8] parent todos
-- ARGV[1] float: now
-- ARGV[2] int: retention seconds
-- ARGV[3] int: events max length
-- ARGV[4] float: resume grace seconds
-- Returns {resumes, resume}: the parent's resume count when closed now (0: closed before) and 1 when the
--   caller must publish the parent's resumed run, 2 when it must end the parent (a submission's root).
-- What this and finish_batch read of the batch, in one HMGET.
local head = hash_get(KEYS[1], 'status', 'mode', 'child_ids', 'id', 'close_reply')
if head[1] == 'done' then
  -- Closed before; by this very call when its `now` is the close's (a call sent again after its reply was
  -- lost, Sentinel's retry): it answers as it did, so its caller still publishes the parent's resume.
  local now, resumes, resume = string.match(head[5] or '', '^(%S+) (%d+) (%d)$')
  if now == ARGV[1] then
    return {tonumber(resumes), tonumber(resume)}
  end
  return {0, 0}
end
if not head[3] then
  -- Its record lapsed (a batch open longer than a retention): nothing is left to close.
  return {0, 0}
end
local batch = hash_get(KEYS[1], 'mode', 'child_ids')
local child_ids = cjson.decode(batch[2])
-- In slices: unpack() of a whole wide batch would overflow Lua's stack.
local lines = {}
for first = 1, #child_ids, 500 do
  local last = math.min(first + 499, #child_ids)
  local got = redis.call('HMGET', KEYS[6], unpack(child_ids, first, last))
  for j = 1, #got do
    lines[first + j - 1] = got[j]
  end
end
-- The most the combined result carries, in bytes (writeback.py: COMBINED_RESULT_BYTES, the same number): the
-- parent's model reads it whole as one tool result. Past it, each later line keeps its first LINE_HEAD_BYTES
-- (status, description, task id) and says where the rest is, so 256 children of 16 KiB outputs stay readable.
local COMBINED_RESULT_BYTES = 262144
local LINE_HEAD_BYTES = 300
local done = 0
local out = {}
local used = 0
for i, child_id in ipairs(child_ids) do
  local line = lines[i] or ('[unknown] (task ' .. child_id .. '): not written back')
  if string.sub(line, 1, 11) == '[completed]' then
    done = done + 1
  end
  if used + #line > COMBINED_RESULT_BYTES then
    local keep = math.max(LINE_HEAD_BYTES, COMBINED_RESULT_BYTES - used)
    if keep < #line then
      line = string.sub(line, 1, keep) .. ' [cut: this combined result reached its limit of ' ..
        COMBINED_RESULT_BYTES .. ' bytes; the whole result is the record of task ' .. child_id .. ']'
    end
  end
  used = used + #line
  out[i] = i .. '. ' .. line
end
local combined = 'Subtask results (' .. batch[1] .. ', ' .. done .. ' of ' .. #child_ids .. ' completed):\n'
  .. table.concat(out, '\n')
-- Every field of the parent the close reads, here and in finish_batch, in one HMGET: end_run leaves them to
-- the batch's closer (every other child's end reads only what its write-back needs).
hash_prefetch(KEYS[2], {'id', 'status', 'runner', 'error_class', 'error', 'waiting_batch_id', 'resumes', 'timeline',
  'ends_with_batch'})
local parent = hash_get(KEYS[2], 'id', 'status', 'runner', 'error_class', 'error', 'ends_with_batch')
if not parent[1] then
  -- The parent's record lapsed before its batch's (a caller's record is refreshed by none of its batch's
  -- steps): no parent to resume, and a close would make its hash again with only the close's fields.
  return {0, 0}
end
if ENDED[parent[2]] then
  -- Stopped meanwhile: its caller reads why, then what had finished.
  combined = 'Stopped: ' .. (parent[4] or '') .. ': ' .. (parent[5] or '') .. '\n' .. combined
end
local ui = cjson.encode({ts = tonumber(ARGV[1]), type = 'say', say = 'subtask_result', text = combined})
local resume = 0
if parent[2] == 'delegated' and (parent[3] == 'agent' or parent[6] == '1') then
  -- Watched first: an agent parent's resume, or the end of a submission's root (writeback.end_submission), lost
  -- with its caller after the close is the reconciler's to make.
  resume = parent[3] == 'agent' and 1 or 2
  redis.call('ZADD', KEYS[7], tonumber(ARGV[1]) + tonumber(ARGV[4]), parent[1])
end
local resumes = finish_batch({KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]},
  {combined, ui, ARGV[1], ARGV[2], ARGV[3], child_ids[#child_ids]})
if resumes > 0 then
  -- The children's write-backs left these keys' retention to the close (apply_children.lua).
  redis.call('EXPIRE', KEYS[6], ARGV[2])
  redis.call('EXPIRE', KEYS[8], ARGV[2])
  hash_set(KEYS[1], 'close_reply', ARGV[1] .. ' ' .. resumes .. ' ' .. resume)
end
return {resumes, resume}

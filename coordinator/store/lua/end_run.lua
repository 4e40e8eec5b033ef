-- End a run in one step: write what it did since its last step (flush_run), make the task
-- terminal once (finish_task), release its lease, take it off the due list, say its outcome,
-- free its run slot when admission limits are set (release_slot), and, for a child of a
-- parallel batch, write it back onto its parent's todo item and close the batch if it was
-- the last (settle_child). A child of a sequential batch stays on the due list, for its
-- caller to write back and start the next step: a process that dies before that leaves it
-- to the reconciler.
-- With fair shares off (ARGV[20] 0) the caller leaves KEYS[20..23] and ARGV[21..31] off: the ancestors
-- are KEYS[20..] then, and flush_run's ARGV begins at ARGV[21] (each key or argument sent costs the server
-- about 1 K instructions, docs/benchmarks.md).
-- KEYS[1..6] as flush_run (lease, task, conversation, UI, live, events)
-- KEYS[7] the due list
-- KEYS[8] parent hash
-- KEYS[9] parent todos
-- KEYS[10] parent awaiting set
-- KEYS[11] batch hash
-- KEYS[12] parent UI messages
-- KEYS[13] batch lines
-- KEYS[14] the tree's running set
-- KEYS[15] its admission list
-- KEYS[16] the parent's running-children set
-- KEYS[17..19] the tree's outbox (outbox_add's KEYS)
-- KEYS[20..23] the fleet-wide keys of fair shares (fair_release's)
-- KEYS[24..] ancestor hashes (parent first, root last)
-- ARGV[1] str: token
-- ARGV[2] int: retention seconds
-- ARGV[3] float: now
-- ARGV[4] int: events max length
-- ARGV[5] str: status
-- ARGV[6] str: summary
-- ARGV[7] str: error
-- ARGV[8] str: error class
-- ARGV[9] float: resume grace seconds
-- ARGV[10] int: 1: end on the budget check (a run that completed)
-- ARGV[11] int: 1: free a run slot (admission limits set, a child)
-- ARGV[12] int: per-parent limit
-- ARGV[13] int: per-tree limit
-- ARGV[14] str: the prefix of the tree's task hashes
-- ARGV[15] str: the prefix of its running-children sets
-- ARGV[16] int: how many waiting tasks to look at
-- ARGV[17] str: what the end keeps beyond its text, written with the status: a completed typed task's
--   data, compact JSON, as its `output`; an unsuccessful end's raw error body as its `error_detail` (''
--   for none)
-- ARGV[18] int: its model's answers that broke its output schema (kept on the record when above 0)
-- ARGV[19] float: the share of a budget whose crossing sends `budget.warning` (record_usage)
-- ARGV[20..31] how fair shares are read (fair_release's, after its own three)
-- ARGV[32..] flush_run's ARGV from its seventh (what the run did since its last step)
-- Returns {'fenced'} (nothing written), {'exhausted', holder, refused} (the flush was written; the caller
--   stops the holder's subtree and ends the run again), or {'ended', status, summary, error, error class,
--   tokens in, tokens out, cache reads, cache writes, cost micro-USD, closed, resumes, resume, batch mode,
--   admitted ids, refused}: `closed` 1 when this call closed the batch, `resume` 1 when the caller must
--   publish the parent's resume (2: end the parent, a submission's root), `batch mode` 'sequential' when
--   the caller must write the chain step back itself, `admitted ids` the waiting tasks given the freed
--   slot, whose runs the caller publishes, `refused` 1 when the task had ended before and the run's usage
--   records were not written (flush_run's). The same end sent again after it ran answers as it did, and
--   writes nothing.
-- (KEYS[8..13] are the task's own hash again when it has no batch, and KEYS[14..16] when
-- admission does not apply to it.)
-- Every field of the task and of its parent that any part below reads, in one HMGET each
-- (hashes.lua): the parts read and write them through the cache, written once at the end.
-- (Not the outcome's fields, which finish_task writes: read only if the task had ended before.)
local own_fields = fields_and(USAGE_FIELDS, {'batch_id', 'batch_mode', 'todo_id', 'description', 'timeline',
  'output', 'last_step', 'waiting_batch_id'})
-- (The slot's release below checks what it answered before, when it applies: release_slot.)
if ARGV[11] == '1' then
  own_fields[#own_fields + 1] = 'release_reply'
end
hash_prefetch(KEYS[2], own_fields)
-- The parent's fields every child's end reads (the usage roll-up, the write-back); the ones only the batch's
-- closer reads (close_batch, finish_batch) are read by it, once a batch, not prefetched by every child.
if KEYS[8] ~= KEYS[2] then
  hash_prefetch(KEYS[8], {'id', 'total_tokens', 'total_cost_micros', 'budget_micros', 'todos_version'})
end
local fair = ARGV[20] == '1'
-- (Tables built whole, by constructors and `unpack`: a table grown one slot at a time is reallocated as it grows.)
local flush_keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[17], KEYS[18], KEYS[19],
  unpack(KEYS, fair and 24 or 20)}
-- The live status (ARGV[w]: here the terminal one, made by the caller, store/runs.py) goes to
-- finish_task, which writes it as it is, and the UI messages go with the outcome's own, after it
-- (one write each, not two).
-- (w: where flush_run's ARGV begins, ARGV[32] or, with fair shares off, ARGV[21].)
local w = fair and 32 or 21
local live = ARGV[w]
local n_conv, n_ui = tonumber(ARGV[w + 1]), tonumber(ARGV[w + 2])
local first_ui = w + 4 + n_conv
local flush_argv = {ARGV[1], ARGV[2], ARGV[3], ARGV[4], '1', ARGV[19], '', ARGV[w + 1], '0', ARGV[w + 3],
  unpack(ARGV, w + 4, first_ui - 1)}
local ui = {unpack(ARGV, first_ui, first_ui + n_ui - 1)}
local at = 10 + n_conv
for i = first_ui + n_ui, #ARGV do
  at = at + 1
  flush_argv[at] = ARGV[i]
end
local function say_all()
  if #ui > 0 then
    redis.call('RPUSH', KEYS[4], unpack(ui))
    redis.call('EXPIRE', KEYS[4], ARGV[2])
  end
end
-- The outcome's fields of the reply, read back from the task.
local function outcome()
  return hash_get(KEYS[2], 'id', 'status', 'summary', 'error', 'error_class', 'tokens_in',
    'tokens_out', 'cache_reads', 'cache_writes', 'cost_micros', 'batch_id', 'batch_mode', 'waiting_batch_id')
end
local flushed = flush_run(flush_keys, flush_argv)
if flushed[1] == 0 then
  if hash_get(KEYS[2], 'last_step')[1] == run_step(ARGV[1], ARGV[3]) then
    -- This very end again, after it ran (its reply was lost; the lease it held is gone with it): the same
    -- answer, from the task and what the end kept of its write-back (`end_reply`), and nothing written twice.
    local f = outcome()
    local at, closed, resumes, resume, mode, admitted = string.match(hash_get(KEYS[2], 'end_reply')[1] or '',
      '^([^:]*):(%d+):(%d+):(%d+):([^:]*):(.*)$')
    if at ~= ARGV[3] then
      closed, resumes, resume, mode, admitted = nil, nil, nil, nil, nil  -- none, or an earlier end's (a retried task)
    end
    local ids = {}
    for admitted_id in string.gmatch(admitted or '', '%S+') do
      ids[#ids + 1] = admitted_id
    end
    return {'ended', f[2], f[3] or '', f[4] or '', f[5] or '', f[6] or '0', f[7] or '0', f[8] or '0', f[9] or '0',
      f[10] or '0', tonumber(closed or '0'), tonumber(resumes or '0'), tonumber(resume or '0'), mode or '', ids,
      -- (Whether the first end refused its usage records is not kept: said refused when it had any, the run
      -- records them after, once per request key, which writes nothing where the first end wrote them.)
      tonumber(ARGV[w + 3]) > 0 and 1 or 0}
  end
  return {'fenced'}
end
if flushed[3] ~= '' and ARGV[10] == '1' then
  if flushed[4] == 0 then
    say_all()  -- (a resend of this step said them the first time)
  end
  return {'exhausted', flushed[3], flushed[5]}
end
local now, retention, maxlen = ARGV[3], ARGV[2], ARGV[4]
local before = hash_get(KEYS[2], 'status')[1]
-- A typed task's data is its record's `output` from the step that completes it, never after (a task
-- stopped before its end keeps none), and a failed run's raw error body its `error_detail` from the step that
-- fails it (not on a task a stop or an earlier end had ended: it is not that end's error); the count of invalid
-- answers stays whatever the outcome. (Written before the end, whose events take the record as it is then:
-- outbox_add.)
if ARGV[17] ~= '' and not ENDED[before] then
  hash_set(KEYS[2], ARGV[5] == 'completed' and 'output' or 'error_detail', ARGV[17])
end
finish_task({KEYS[2], KEYS[6], KEYS[5], KEYS[17], KEYS[18], KEYS[19]}, {ARGV[5], ARGV[6], ARGV[7], ARGV[8], now, retention, maxlen, live})
if tonumber(ARGV[18]) > 0 then
  hash_set(KEYS[2], 'invalid_outputs', ARGV[18])
end
redis.call('DEL', KEYS[1])  -- the lease: flush_run found it this run's, in this same call
local f = outcome()
local closed, resumes, resume, mode = 0, 0, 0, ''
if f[11] and f[11] ~= '' then
  -- A child's record names its batch's mode (delegation.py); one written before it did not.
  local got = settle_child({KEYS[8], KEYS[9], KEYS[10], KEYS[6], KEYS[13], KEYS[2], KEYS[11], KEYS[12], KEYS[7]},
    {now, retention, maxlen, f[1], ARGV[9], f[12] or ''})
  mode, resumes, resume = got[1], got[2], got[3]
  if resumes > 0 then
    closed = 1
  end
end
if mode == 'sequential' or (f[13] or '') ~= '' then
  -- A chain step stays due until the chain moved on; a task that ended with a delegation it committed and never
  -- waited on, until its children are stopped (`Run.end`, else the reconciler's `settle_ended`).
  redis.call('ZADD', KEYS[7], tonumber(now) + tonumber(ARGV[9]), f[1])
else
  redis.call('ZREM', KEYS[7], f[1])
end
-- The outcome's UI message, written as text around its one string, which cjson escapes (a task's summary
-- is a model's text): a table encoded whole costs three times that.
if f[2] == 'completed' then
  ui[#ui + 1] = '{"ts":' .. now .. ',"type":"say","say":"completion_result","text":' .. cjson.encode(f[3] or '') .. '}'
else
  ui[#ui + 1] = '{"ts":' .. now .. ',"type":"say","say":"error","text":' .. cjson.encode((f[5] or '') .. ': ' .. (f[4] or ''))
    .. '}'
end
say_all()
local admitted = {}
if ARGV[11] == '1' then
  admitted = release_slot({KEYS[14], KEYS[15], KEYS[16]},
    {f[1], ARGV[12], ARGV[13], retention, ARGV[14], ARGV[15], ARGV[16], now})
end
if fair then
  -- Its tenant's fleet slot (fair shares), whoever its parent: given to the neediest tenant's parked run.
  local fair_argv = {f[1], math.floor(tonumber(now) * 1000), retention}
  for i = 20, 31 do
    fair_argv[#fair_argv + 1] = ARGV[i]
  end
  local taken = fair_release({KEYS[20], KEYS[21], KEYS[22], KEYS[23]}, fair_argv)
  for i = 1, #taken do
    admitted[#admitted + 1] = taken[i]
  end
end
-- What a resend of this end answers, which the task's record does not say (above): kept only when its caller
-- has something to send (a closed batch, a chain's next step, admitted runs), as most children's ends do not.
if closed == 1 or mode == 'sequential' or #admitted > 0 then
  hash_set(KEYS[2], 'end_reply', now .. ':' .. closed .. ':' .. resumes .. ':' .. resume .. ':' .. mode .. ':'
    .. table.concat(admitted, ' '))
end
return {'ended', f[2], f[3] or '', f[4] or '', f[5] or '', f[6] or '0', f[7] or '0', f[8] or '0', f[9] or '0',
  f[10] or '0', closed, resumes, resume, mode, admitted, flushed[5]}

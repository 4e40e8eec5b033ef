"""Every field name of the store's Redis hashes, named once.

The task, batch and approval hashes hold a model's fields (`TaskRecord`,
`Batch`, `Approval`) plus bookkeeping that exists only in Redis: counters and
once-only flags. Python in this package uses these constants; the Lua scripts
in `lua/` cannot import them and spell the same names as literals (a field's
comment ends with the scripts that touch it, if any). Keys are in `keys.py`.
Two hashes have no fixed fields: a todo list (item id -> item JSON, and
`order`, named `coordinator.todos.ORDER_FIELD`) and a tree's live hash (task
id -> live JSON).

A hash value is always a string: None is stored as '', lists and dicts as JSON,
booleans as 0/1 (see `base._encode_record`).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "APPROVAL_OPTIONAL_FIELDS",
    "INT_FIELDS",
    "JSON_FIELDS",
    "OPTIONAL_FIELDS",
    "ApprovalField",
    "BatchField",
    "LatencyField",
    "TaskField",
]


class TaskField:
    """Fields of the task hash, `<p>:{root}:task:<id>`.

    `TaskRecord.child_ids` and `awaiting_ids` are not here: they live in their own
    keys (`children`, `awaiting`).
    """

    # -- the record (TaskRecord's fields) ---------------------------------------------
    ID: Final = "id"  # the task id (read by every task script, to name it in events)
    PARENT_ID: Final = "parent_id"  # the parent's id; '' for a root
    ROOT_ID: Final = "root_id"  # the tree's root id
    DEPTH: Final = "depth"  # 0 for a root, parent's depth + 1 below
    ANCESTORS: Final = "ancestors"  # JSON list of ancestor ids, root first (the usage roll-up's path)
    STATUS: Final = "status"  # active|delegated|completed|failed|cancelled (every task script)
    PROMPT: Final = "prompt"  # the task's instruction
    DESCRIPTION: Final = "description"  # a short label (a child's spec description)
    PROFILE: Final = "profile"  # the model profile that runs it
    TODO_ID: Final = "todo_id"  # the parent's item this child carries out; '' if none (apply_children)
    BATCH_ID: Final = "batch_id"  # the batch this task belongs to as a child; '' for a root
    WAITING_BATCH_ID: Final = "waiting_batch_id"  # the batch it waits on while delegated; '' otherwise (finish_batch)
    TOKENS_IN: Final = "tokens_in"  # own input tokens (record_usage)
    TOKENS_OUT: Final = "tokens_out"  # own output tokens (record_usage)
    CACHE_READS: Final = "cache_reads"  # own cache-read tokens (record_usage)
    CACHE_WRITES: Final = "cache_writes"  # own cache-write tokens (record_usage)
    COST_MICROS: Final = "cost_micros"  # own cost, micro-USD (record_usage)
    REQUESTS: Final = "requests"  # own model requests recorded (record_usage)
    TOTAL_TOKENS: Final = "total_tokens"  # own plus every descendant's tokens (record_usage, apply_children)
    TOTAL_COST_MICROS: Final = "total_cost_micros"  # own plus every descendant's cost (record_usage, apply_children)
    UNLINKED_TOKENS: Final = "unlinked_tokens"  # children's tokens on no row of the plan (apply_children, update_todos)
    UNLINKED_COST_MICROS: Final = "unlinked_cost_micros"  # children's cost on no row of the plan (same)
    SUMMARY: Final = "summary"  # the final answer of a completed task (finish_task)
    ERROR: Final = "error"  # why it failed or was cancelled (finish_task, stop_tasks)
    ERROR_CLASS: Final = "error_class"  # the error's kind, machine-readable (finish_task, stop_tasks)
    ERROR_DETAIL: Final = "error_detail"  # a failed model request's raw error body (end_run.lua)
    COST_SOURCE: Final = "cost_source"  # where the last request's cost came from (record_usage)
    RUNNER: Final = "runner"  # 'caller' (driven by API calls) or 'agent' (run on the fleet)
    # '1' on a submission's root (`subq.submit` with subtasks): nobody holds it, it ends as its batch closes.
    ENDS_WITH_BATCH: Final = "ends_with_batch"
    BUDGET_MICROS: Final = "budget_micros"  # the subtree's cap, micro-USD; 0: none (read by record_usage)
    NUMBER: Final = "number"  # the history number, given at creation
    COMPLETED_BY_CHILD_ID: Final = "completed_by_child_id"  # the child whose end closed its last batch (finish_batch)
    RETRIES: Final = "retries"  # times the failed task was retried by a person (retry)
    CREATED_AT: Final = "created_at"  # epoch seconds
    UPDATED_AT: Final = "updated_at"  # epoch seconds of the last change (every task script)
    FINISHED_AT: Final = "finished_at"  # epoch seconds it ended; '' while running (finish_task, stop_tasks)
    OWNER: Final = "owner"  # the API key that created the tree ('' when made on Redis or by Celery); every task
    # JSON object of the marks its state changes left, `[t_ms, state]`, bounded (coordinator/timeline.py);
    # written with the record, and by the scripts that change its state through `timeline_add`
    # (hashes.lua): start_run, flush_run, finish_task, finish_batch, release_slot, decide, stop_tasks.
    TIMELINE: Final = "timeline"
    # JSON list of its newest tool calls that ran, `[start_ms, end_ms, tool, outcome]`, at most
    # MAX_TOOL_CALLS (coordinator/timeline.py), appended by the step that keeps each (record_tool).
    TOOL_CALLS: Final = "tool_calls"
    # Compact JSON text of the JSON Schema its result data is held to, '' for none; written at creation.
    OUTPUT_SCHEMA: Final = "output_schema"
    # Compact JSON text of a completed task's validated data, '' for none; written with the completed
    # status by the run's end (end_run), read into its parent's line of the combined result (apply_children).
    OUTPUT: Final = "output"
    # How many of its model's answers broke its output schema (end_run).
    INVALID_OUTPUTS: Final = "invalid_outputs"
    # Compact JSON object of the tree's caller metadata (string keys and values), '{}' for none; written
    # at creation, the root's copied to each child as it is made; missing on records older than it.
    METADATA: Final = "metadata"
    # The tree's tenant (coordinator/tenants.py), written at creation, the root's copied to each child as it
    # is made; missing on records older than it (read as SUBQ's `default`).
    TENANT: Final = "tenant"
    # The tree's priority, 1-5, as decimal text: written at creation, the root's copied to each child; missing
    # on records older than it (read as 3). Not an INT_FIELD: a missing one reads as the default, not 0.
    PRIORITY: Final = "priority"

    # -- bookkeeping only in Redis -----------------------------------------------------
    TODOS_VERSION: Final = "todos_version"  # bumped on every change of the todo list (apply_children)
    PUBLISHED: Final = "published"  # once-only claim, its claimer's token: the task's run (a chain step) was published
    # Deliveries of the current run; reset to 0 on a batch resume (finish_batch) and a park on the provider
    # (endpoint_park).
    DELIVERIES: Final = "deliveries"
    RUN_SEQ: Final = "run_seq"  # runs of the task ever; keeps request keys unique
    RESUMES: Final = "resumes"  # times the task was resumed (finish_batch, claim_resume)
    RESUME_BATCH_ID: Final = "resume_batch_id"  # the batch whose result the resumed run answers (finish_batch)
    # JSON list of the approvals its last run asked for (set_waiting_approvals, while the run holds the lease).
    WAITING_APPROVAL_IDS: Final = "waiting_approval_ids"
    TRANSIENT_ERRORS: Final = "transient_errors"  # provider errors waited out so far (a count)
    # The failed attempts of the request now in flight (a count), kept across parks for the `wait_out` UI
    # line's attempt number; deleted when a request is answered, by a run that still holds the lease (clear_wait).
    PROVIDER_ATTEMPTS: Final = "provider_attempts"
    # The mark of the last call that counted transient errors (count_transient): the same call sent again after its
    # reply was lost finds it and counts nothing twice.
    TRANSIENT_CALL: Final = "transient_call"
    # When its run began waiting for its provider (ms), kept while the run gives its worker back, so
    # `model_wait_out_s` counts from the first failure, not from each wake (coordinator/endpoints.py); while
    # set, the task's provider timer may wake it. Set by endpoint_park, cleared with PROVIDER_ATTEMPTS
    # (clear_wait), each only while the run holds the lease.
    PROVIDER_WAIT_SINCE_MS: Final = "provider_wait_since_ms"
    REPAIRS: Final = "repairs"  # runs the reconciler published again after one was lost (a count)
    # A step sent again by the connection after it ran (its reply lost) knows itself by these, and writes
    # nothing twice: the token of the run that started last (start_run; `<token> delay <ms>` or
    # `<token> park 0 <why> <task given the slot>` for a start that waited, its answer), the last step a run wrote,
    # `<token> <now>` (flush_run, record_tool, end_run), and what its end answered that the record does
    # not say, `<now>:<closed>:<resumes>:<resume>:<batch mode>:<admitted ids>` (end_run:
    # that end's `now`, so an earlier end's, of a task retried since, is never read as this one's).
    RUN_TOKEN: Final = "run_token"
    LAST_STEP: Final = "last_step"
    END_REPLY: Final = "end_reply"
    RETRIED_AT: Final = "retried_at"  # the last retry's `now`: the same retry sent again knows itself (retry)
    # What a release of the task's slot gave to waiting runs, `<now> <id>,<id>...` (release_slot; fair_release,
    # with its call's token for `now`): the same release sent again answers the same ids. A stop's withdrawal
    # from fair shares keeps its own on the first task it names (fair_withdraw, with its call's token).
    RELEASE_REPLY: Final = "release_reply"
    FAIR_RELEASE_REPLY: Final = "fair_release_reply"
    FAIR_WITHDRAW_REPLY: Final = "fair_withdraw_reply"
    # `resumed:<a park's first approval id>`: the once-only claim of a park's resume, "<token> <resumes>".
    RESUMED_PREFIX: Final = "resumed:"
    BATCH_MODE: Final = "batch_mode"  # a child's batch's mode, written with the child (end_run)
    # JSON list of the ancestors with a budget, root first; absent on records written before
    # it was kept (then every ancestor is read). The run's start reads only these (start_run).
    BUDGET_CHAIN: Final = "budget_chain"
    # The shares of its budget (SUBQ_BUDGET_WARN_AT) whose `budget.warning` its subtree's spend has sent,
    # space-separated ('0.8'): a step that crosses one again (redelivered, repeated) sends nothing
    # (record_usage). Only a task with a budget has it.
    BUDGET_WARNED: Final = "budget_warned"
    # When (the Redis server's epoch s) a step of its run refused that run's spend, its task having been stopped
    # (flush_run): the run records it next (record_late_spend, which sets it to ''). While set, and younger
    # than a heartbeat lapse, the tree's event stream holds its end (Records.finishing): its figures are final.
    LATE_SPEND_AT: Final = "late_spend_at"

    @staticmethod
    def resumed(reason_id: str) -> str:
        """The once-only flag for resuming the task for one reason (a batch or an approval)."""
        return f"{TaskField.RESUMED_PREFIX}{reason_id}"


class BatchField:
    """Fields of the batch hash, `<p>:{root}:batch:<batch_id>` (Batch's fields and a flag)."""

    ID: Final = "id"  # the batch id (read by finish_batch)
    PARENT_ID: Final = "parent_id"  # the delegating task
    ROOT_ID: Final = "root_id"  # the tree's root id
    MODE: Final = "mode"  # parallel|sequential
    CHILD_IDS: Final = "child_ids"  # JSON list of the children in dispatch order (unlike a task's, a field)
    STATUS: Final = "status"  # running|done (finish_batch)
    RESULT: Final = "result"  # the combined result, once done (finish_batch)
    TOOL_CALL_ID: Final = "tool_call_id"  # the agent parent's delegation tool call that `result` answers
    CREATED_AT: Final = "created_at"  # epoch seconds
    FINISHED_AT: Final = "finished_at"  # epoch seconds it closed; '' while running (finish_batch)
    PUBLISHED: Final = "published"  # once-only claim, its claimer's token: the batch's work was published
    # What the close answered, "<now> <resumes> <resume>" (close_batch): a close sent again with the same `now`
    # after its reply was lost answers it again.
    CLOSE_REPLY: Final = "close_reply"

    # The batch lines hash (`batch-lines:<id>`: child id -> its line) is made with this
    # field at the delegation, so it has its retention before any child writes a line.
    LINES_OWNER: Final = "~batch"


class ApprovalField:
    """Fields of the approval hash, `<p>:{root}:approval:<approval_id>` (exactly Approval's fields)."""

    ID: Final = "id"  # the approval id
    TASK_ID: Final = "task_id"  # the task whose tool call waits (read by decide)
    ROOT_ID: Final = "root_id"  # the tree's root id
    TOOL: Final = "tool"  # the tool's name
    ARGS: Final = "args"  # JSON object of the call's arguments
    TOOL_CALL_ID: Final = "tool_call_id"  # the model's id of the call
    TODO_ID: Final = "todo_id"  # the task's todo item, if any; '' if none
    TODO_CONTENT: Final = "todo_content"  # that item's text; '' if none
    STATUS: Final = "status"  # pending|approved|denied|expired (decide)
    FEEDBACK: Final = "feedback"  # the decider's words; '' until decided (decide)
    CREATED_AT: Final = "created_at"  # epoch seconds
    DEADLINE: Final = "deadline"  # epoch seconds after which it expires
    DECIDED_AT: Final = "decided_at"  # epoch seconds of the decision; '' until decided (decide)
    DECIDED_BY: Final = "decided_by"  # the API key that decided; '' until decided, and for an expiry (decide)


class LatencyField:
    """Fields of the model-latency histogram hash, `<p>:metrics:model-latency`."""

    # `in_<ms>`: requests that took more than the next lower bound and at most <ms>;
    # `in_inf`: longer than every bound. One increment per request: the cumulative
    # Prometheus buckets (`le_<ms>`) and the count are added up when read.
    BUCKET_PREFIX: Final = "in_"
    OVER: Final = "in_inf"
    SUM_MS: Final = "sum_ms"  # their latencies added up, ms

    @staticmethod
    def bucket(bound_ms: int) -> str:
        """The bucket of requests within `bound_ms` and above the next lower bound."""
        return f"{LatencyField.BUCKET_PREFIX}{bound_ms}"


# Task fields stored as decimal strings and read back as int ('' or missing: 0).
INT_FIELDS = (
    TaskField.DEPTH, TaskField.TOKENS_IN, TaskField.TOKENS_OUT, TaskField.CACHE_READS, TaskField.CACHE_WRITES,
    TaskField.COST_MICROS, TaskField.REQUESTS, TaskField.TOTAL_TOKENS, TaskField.TOTAL_COST_MICROS, TaskField.NUMBER,
    TaskField.BUDGET_MICROS, TaskField.UNLINKED_TOKENS, TaskField.UNLINKED_COST_MICROS, TaskField.RETRIES,
    TaskField.INVALID_OUTPUTS, TaskField.TRANSIENT_ERRORS,
)  # fmt: skip
# Task fields stored as compact JSON text ('' or missing: None; metadata then reads as {}), read back as the JSON value.
JSON_FIELDS = (TaskField.OUTPUT_SCHEMA, TaskField.OUTPUT, TaskField.METADATA)
# Task fields where '' means None.
OPTIONAL_FIELDS = (
    TaskField.PARENT_ID, TaskField.TODO_ID, TaskField.BATCH_ID, TaskField.WAITING_BATCH_ID, TaskField.FINISHED_AT,
    TaskField.COMPLETED_BY_CHILD_ID,
)  # fmt: skip
# Approval fields where '' means None.
APPROVAL_OPTIONAL_FIELDS = (
    ApprovalField.TODO_ID, ApprovalField.TODO_CONTENT, ApprovalField.FEEDBACK, ApprovalField.DECIDED_AT,
    ApprovalField.DECIDED_BY,
)  # fmt: skip

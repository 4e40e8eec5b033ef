"""subq's own tools: plan, delegate, complete, and run a command where the profile enables it.

- `update_todo_list(todos)`: replace the plan (markdown or JSON items); a
  rejected update returns its error and leaves the list as it was.
- `new_task(message, description, todo_id?, profile?)`: one sequential child;
  it must be the last tool call of its response: calls after it get an error
  result and are not executed.
- `run_subagents(tasks)`: a parallel fan-out (one chord).
- `attempt_completion(result)`: ends the task with its result (an output tool), taken only
  when it is the one call of its response besides other completions: called beside other
  tools, it is answered "not taken" and the model is asked again once every other call of
  the response has its result (docs/agents.md, "Several calls in one response"). A task with
  an output schema gets `attempt_completion(result, data)` instead (`typed_completion`), built
  for its run: `data`'s parameter schema is the task's, and data that breaks it is sent back
  with every error; every invalid answer (bad data, arguments that are no object, no call at
  all) is counted and bounded in one place, `bound_invalid_answers` (docs/agents.md, "Typed results").
- `run_command(command)`: runs one command line for real (workers/runtime/commands.py:
  argv without a shell, in the profile's folder, timed out, output capped), only
  for a profile with a `run_command` table; every call needs a decision under
  the default policy (`Profile.approval_tools`) unless a rule allows its argv.

A delegation tool validates and commits through the Coordinator, then defers
(pydantic-ai's `CallDeferred`): the run ends, the runner persists the
conversation and only then publishes the children, and the parent's worker
slot is free while they run. When the batch closes, the parent is resumed and
the deferred call is answered with the combined results.

Every refusal (a bad todo update, the depth limit, an unknown profile or
todo id) is returned to the model as the tool's result and changes nothing.
A tool whose call ends as something other than `ok` raises `CallDenied` or
`CallFailed` with the text the model reads: the guarded toolset
(workers/runtime/profile_tools.py) answers the call with that text and counts
it as `denied` or `error`, so the count is set by the code that decided it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import pydantic
from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, GetJsonSchemaHandler, field_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_ai import (
    ApprovalRequired,
    CallDeferred,
    CallToolsNode,
    ModelRequestNode,
    ModelRetry,
    RunContext,
    ToolOutput,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryFeedbackPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import FunctionToolset

from coordinator import (
    OFFLINE_PROFILE,
    Profile,
    SubqError,
    SubtaskSpec,
    compact,
    error_message,
    error_path,
    ignored_lines,
    one_line,
    output_errors,
    render_markdown,
)
from coordinator.runs import Run
from workers import observe
from workers.runtime import commands
from workers.runtime.approval_policy import Verdict, verdict
from workers.runtime.planner import plan_instructions
from workers.runtime.sandbox import Sandbox
from workers.runtime.script import SCRIPT_INFO_STRING

__all__ = [
    "COMPLETION_NOT_TAKEN",
    "NEW_TASK_NOT_LAST",
    "ORCHESTRATION_PROMPT",
    "OUTPUT_INVALID",
    "PLACEHOLDER_PARAMETERS",
    "CallAnswered",
    "CallDenied",
    "CallFailed",
    "OutputInvalid",
    "RunState",
    "TypedResult",
    "bound_invalid_answers",
    "check_completion",
    "invalid_answers",
    "orchestration_tools",
    "typed_completion",
    "typed_parameters",
]

ORCHESTRATION_PROMPT = """
You plan with a todo list (update_todo_list) and may delegate work to subagents:
run_subagents for independent subtasks in parallel, new_task for one subtask whose
result you need before going on (it must be the last tool call of your response).
Each subtask is carried out against one item of your todo list. When you are done,
call attempt_completion with your result.
""".strip()
# What a completion called beside other tools reads: it was not taken, and why. The model wrote it
# before it saw those calls' results (a commit a human denies, a command that fails), so it is
# asked again with them rather than ending on a claim it could not check (docs/agents.md).
COMPLETION_NOT_TAKEN = (
    "Not taken: this response also called {others}. A task ends only after every call of the response "
    "it ends in has its result: read their results, then call attempt_completion on its own."
)
NEW_TASK_NOT_LAST = (
    "Error: not executed: new_task must be the last tool call of a response "
    "(it hands control to a subtask); call this again after the subtask's result arrives."
)


@dataclass
class RunState:
    """The deps of one agent run: the coordinator's handle on it, its profile, and its tool calls at once."""

    run: Run
    profile: Profile
    # What its commands may not see (the process's, from its settings: workers/runtime/sandbox.py).
    sandbox: Sandbox = field(default_factory=Sandbox)
    calls_at_once: asyncio.Semaphore = field(init=False)
    # The tool calls answered since the run's last progress event (tool, outcome, ms), for the next one.
    tool_calls: list[dict[str, Any]] = field(init=False, default_factory=list)
    # A typed run's attempt_completion parameters (`completion_parameters`): what `typed_parameters` gives
    # the model as the output tool's schema. None: an untyped run.
    completion_parameters: dict[str, Any] | None = None
    # The calls of the response it resumes that an earlier run answered without running (denied, interrupted),
    # said and counted then: answered again as before, but not said or counted again.
    answered: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.calls_at_once = asyncio.Semaphore(self.profile.max_tool_calls_at_once)


class CallAnswered(Exception):
    """A tool's call answered without a result of its own: `text` is what the model reads, and the call
    counts as `outcome` (raised by the tool that decided it; the guarded toolset answers and counts it). `ran`:
    the call reached what does its work (an MCP server that answered an error) and is charged its price; a call
    refused or that could not start is not."""

    outcome: ClassVar[Literal["denied", "error"]] = "error"

    def __init__(self, text: str, *, ran: bool = False) -> None:
        super().__init__(text)
        self.text = text
        self.ran = ran


class CallDenied(CallAnswered):
    """The call is refused by the profile's policy and never runs."""

    outcome = "denied"


class CallFailed(CallAnswered):
    """The call failed (or could not run): an error result, a `tool_error` line, counted as `error`."""

    outcome = "error"


class TodoInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    status: Literal["pending", "in_progress", "completed"] = "pending"


class SubtaskInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str
    message: str
    todo_id: str | None = None
    profile: str | None = None
    # A JSON Schema the child's result data is held to (checked by SubtaskSpec, as the API's subtasks are).
    output_schema: dict[str, Any] | None = None

    @field_validator("profile")
    @classmethod
    def _blank_is_left_out(cls, profile: str | None) -> str | None:
        # A model fills an optional argument with "" as often as it leaves it out: both mean the parent's profile.
        # (A caller of the API or Python who sends "" is refused: coordinator/inputs.py, profile_asked.)
        return profile if profile and profile.strip() else None


def _after_new_task(ctx: RunContext[RunState]) -> bool:
    """True when an earlier tool call of this same response is new_task."""
    for message in reversed(ctx.messages):
        if isinstance(message, ModelResponse):
            calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
            ids = [c.tool_call_id for c in calls]
            if ctx.tool_call_id in ids:
                earlier = calls[: ids.index(ctx.tool_call_id)]
                return any(c.tool_name == "new_task" for c in earlier)
    return False


def _delegate(ctx: RunContext[RunState], specs: list[SubtaskInput], mode: str) -> str:
    run = ctx.deps.run
    try:
        checked = []
        for index, spec in enumerate(specs):
            try:
                checked.append(SubtaskSpec.model_validate(spec.model_dump()))
            except pydantic.ValidationError as exc:  # a spec pydantic refused (an empty message, a bad schema)
                error = exc.errors()[0]
                where = error_path(error, ("tasks", index) if mode == "parallel" else ())
                return f"Error: {where}: {error_message(error)} (no subtask was created)"
        batch, children = run.plan.delegate(checked, mode, tool_call_id=ctx.tool_call_id or "")
    except SubqError as exc:
        return f"Error: {exc} (no subtask was created)"
    run.say("subtasks", f"Delegated {len(children)} {mode} subtask(s): " + ", ".join(c.id for c in children))
    raise CallDeferred(metadata={"batch_id": batch.id})


orchestration_tools: FunctionToolset[RunState] = FunctionToolset()


# The offline planner's view of the plan, before each request (workers/runtime/planner.py).
# A toolset of its own, given only to an offline task that plays no script (`plans_offline`):
# other runs neither read the plan per request nor pay for an instructions function.
offline_plan_toolset: FunctionToolset[RunState] = FunctionToolset()


@offline_plan_toolset.instructions
def offline_plan(ctx: RunContext[RunState]) -> str | None:
    """An offline task's plan, before each request: the offline model's planner carries it out."""
    items = ctx.deps.run.plan.todos()
    return plan_instructions(items) if items else None


def plans_offline(profile: Profile, prompt: str) -> bool:
    """Whether a run's agent carries out its plan with the offline planner: the offline model, no script."""
    return profile.model == OFFLINE_PROFILE and SCRIPT_INFO_STRING not in prompt


@orchestration_tools.tool
def update_todo_list(ctx: RunContext[RunState], todos: str | list[TodoInput]) -> str:
    """Replace your todo list. Markdown, one item a line: `[ ] pending`, `[-] in progress`, `[x] done`;
    or a JSON list of {content, status}. Items keep their subtask links and figures."""
    if _after_new_task(ctx):
        return NEW_TASK_NOT_LAST
    run = ctx.deps.run
    update: str | list[object] = todos if isinstance(todos, str) else [t.model_dump() for t in todos]
    try:
        items = run.plan.update_todos(update)
    except SubqError as exc:
        return f"Error: {exc}"
    rendered = render_markdown(items)
    run.say("todo_update", rendered)
    # Lines that look like items but are not (`* [ ] x`, `1. [ ] x`, `[] x`) were left out:
    # the model is told which, so it can write them again in the grammar.
    ignored = ignored_lines(update)
    left_out = "".join(f"\nNot read as an item: {line}" for line in ignored)
    return f"Todo list updated:\n{rendered}{left_out}"


@orchestration_tools.tool
def new_task(
    ctx: RunContext[RunState],
    message: str,
    description: str,
    todo_id: str | None = None,
    profile: str | None = None,
    output_schema: dict[str, Any] | None = None,
) -> str:
    """Delegate one subtask and wait for its result before going on. Must be your last tool call.
    With `output_schema` (a JSON Schema object), the subtask returns data in that shape, which you get as JSON."""
    if _after_new_task(ctx):
        return NEW_TASK_NOT_LAST
    spec = SubtaskInput(
        description=description, message=message, todo_id=todo_id, profile=profile, output_schema=output_schema
    )
    return _delegate(ctx, [spec], "sequential")


@orchestration_tools.tool
def run_subagents(ctx: RunContext[RunState], tasks: list[SubtaskInput]) -> str:
    """Delegate independent subtasks to run in parallel; you get all their results together. A task's
    `output_schema` (a JSON Schema object) makes it return data in that shape, which you get as JSON."""
    if _after_new_task(ctx):
        return NEW_TASK_NOT_LAST
    return _delegate(ctx, tasks, "parallel")


# Tools that apply the profile's policy themselves, after checks of their own: run_command refuses a
# command it cannot run (its profile does not enable it, the line does not parse) before anyone is
# asked to approve it. The guarded toolset (workers/runtime/profile_tools.py) leaves them to it.
SELF_GUARDED = frozenset({"run_command"})


def apply_verdict(tool: str, args: dict[str, Any], decided: Verdict) -> str | None:
    """What the policy's verdict on a call means: None to go on, a denial text for the model, or
    ApprovalRequired: the run ends and the call waits in the approvals queue, holding no worker."""
    if decided == "allow":
        return None
    if decided == "deny":
        return f"Denied by policy: {tool} {json.dumps(args)} is not allowed for this task."
    raise ApprovalRequired(metadata={"tool": tool, "args": args})


def needs_decision(ctx: RunContext[RunState], tool: str, args: dict[str, Any]) -> str | None:
    """Apply the profile's approval policy to this call (None too once a human approved it)."""
    return None if ctx.tool_call_approved else apply_verdict(tool, args, verdict(ctx.deps.profile, tool, args))


@orchestration_tools.tool
async def run_command(ctx: RunContext[RunState], command: str) -> str:
    """Run a program with its arguments in this task's working directory; you get its exit code and
    output. The line is split into words as a shell would (quotes group words), but no shell runs it:
    `;`, `|`, `&&`, `>` and `$(...)` are plain arguments. It may need a human's approval."""
    if _after_new_task(ctx):
        return NEW_TASK_NOT_LAST
    config = ctx.deps.profile.run_command
    if config is None:
        raise CallFailed("Error: run_command is not enabled for this task's profile")
    try:
        commands.parse(command)
    except ValueError as exc:  # refused before anyone is asked to approve it
        raise CallFailed(f"Error: {exc}") from None
    denied = needs_decision(ctx, "run_command", {"command": command})
    if denied:
        raise CallDenied(denied)
    run = ctx.deps.run
    run.say("command", command)
    result = await commands.run(command, config, sandbox=ctx.deps.sandbox)
    report_refused(run, "run_command", result.refused)
    run.say("command_result", result.excerpt())
    return result.text()


# A command that retries a refused host in a loop would fill the UI: the lines of one call stop here.
MAX_REFUSED_LINES = 20


def report_refused(run: Run, source: str, refused: Sequence[str]) -> None:
    """Each connection the sandbox's proxy refused (`host:port`): a `network_refused` UI line on the task
    (at most MAX_REFUSED_LINES a call, then how many more) and the worker's metric."""
    if not refused:
        return
    for address in refused[:MAX_REFUSED_LINES]:
        run.say("network_refused", address)
    if len(refused) > MAX_REFUSED_LINES:
        run.say("network_refused", f"... and {len(refused) - MAX_REFUSED_LINES} more refused connections")
    observe.network_refused(source, len(refused))


def attempt_completion(ctx: RunContext[RunState], result: str) -> str:
    """Finish your task with its result. Call it on its own, after you have read every tool result."""
    others = _other_calls(ctx)
    if others:
        # pydantic-ai takes the first output tool that succeeds and ends the run, leaving a call that
        # waits for a decision unanswered (seen: a batched git_commit dropped, the task `completed`).
        # Refused here, the completion is answered "not taken", every other call runs or waits for
        # its decision, and the model is asked again with all their results.
        ctx.deps.run.say("completion_not_taken", f"attempt_completion waits for {', '.join(others)}")
        raise ModelRetry(COMPLETION_NOT_TAKEN.format(others=", ".join(others)))
    return result


def _other_calls(ctx: RunContext[RunState]) -> list[str]:
    """The tools the response holding this completion also called (other completions aside)."""
    for message in reversed(ctx.messages):
        if isinstance(message, ModelResponse):
            calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
            if any(c.tool_call_id == ctx.tool_call_id for c in calls):
                return [c.tool_name for c in calls if c.tool_name != "attempt_completion"]
    return []


def describe_call(part: ToolCallPart) -> str:
    args = part.args if isinstance(part.args, str) else json.dumps(part.args)
    return f"{part.tool_name}({args[:500]})"


# -- typed results: attempt_completion(result, data) ----------------------------------------

# How the answer to data that broke the schema begins (the model reads it; `invalid_answers` knows it by it).
OUTPUT_INVALID = "Invalid data: "
# What the model reads after an answer with no attempt_completion call, and after one whose arguments are no
# JSON object of named arguments (each followed by how many more invalid answers fail the task).
DATA_AGAIN = ". Call attempt_completion again with data that fits the schema"
NO_COMPLETION = (
    "Invalid answer: no attempt_completion call. This task ends only with attempt_completion(result, data), "
    "data in the shape of its schema"
)
BAD_ARGUMENTS = "Invalid answer: {errors}. Call attempt_completion again with a JSON object of result and data"


class OutputInvalid(Exception):
    """A typed task's model gave its `max_invalid_outputs`-th invalid answer: the task fails, with its errors."""

    def __init__(self, answers: int, errors: Sequence[str]) -> None:
        self.answers = answers
        self.errors = list(errors)
        super().__init__(f"{answers} invalid answers; the last: " + "; ".join(self.errors))


@dataclass(frozen=True)
class TypedResult:
    """A typed task's accepted completion: its result in words, and its data as compact JSON text."""

    result: str
    data_json: str


# The typed completion's schema as pydantic-ai builds it (without the task's schema, which `typed_parameters`
# puts in before each request).
PLACEHOLDER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"result": {"type": "string"}, "data": {}},
    "required": ["result", "data"],
}


async def typed_parameters(ctx: RunContext[RunState], tool_defs: list[ToolDefinition]) -> list[ToolDefinition]:
    """Before each request (pydantic-ai's `prepare_output_tools` hook): a typed run's attempt_completion is
    given its whole schema, `data`'s being the task's (`completion_parameters`). A coroutine, as is
    `bound_invalid_answers`: pydantic-ai runs a plain `def` hook in a thread of the executor, a hop to another
    thread and back at every request and every step of every run (0.3 to 0.5 ms of a child's CPU in the tool
    threads alone, docs/benchmarks.md); neither does I/O."""
    parameters = ctx.deps.completion_parameters
    if parameters is None:
        return tool_defs
    return [
        dataclasses.replace(d, parameters_json_schema=parameters) if d.name == "attempt_completion" else d
        for d in tool_defs
    ]


class _Invalid(NamedTuple):
    """One part of a request that answers an invalid answer: where it is, its errors, what the model reads."""

    at: int
    errors: str
    text: str


def _invalid_parts(request: ModelRequest) -> list[_Invalid]:
    """The parts of a request that answer an invalid answer of a typed run: a response with no call
    (pydantic-ai's `no_output` feedback), attempt_completion arguments that are no JSON object (its
    `validation_error` retry: the tool's parameter is any object, so nothing else fails there), and data that
    broke the schema (the tool's OUTPUT_INVALID retry). A "not taken" completion is none of them."""
    found = []
    for index, part in enumerate(request.parts):
        if isinstance(part, RetryFeedbackPart) and part.retry.cause == "no_output":
            found.append(_Invalid(index, "no attempt_completion call (an answer without a tool call)", NO_COMPLETION))
        elif not isinstance(part, ToolReturnPart) or part.tool_name != "attempt_completion":
            continue
        elif isinstance(part.content, str) and part.content.startswith(OUTPUT_INVALID):
            said = part.content.removeprefix(OUTPUT_INVALID)
            errors, again, _ = said.rpartition(DATA_AGAIN)
            found.append(_Invalid(index, errors if again else said, f"{OUTPUT_INVALID}{errors}{DATA_AGAIN}"))
        elif part.retry is not None and part.retry.cause == "validation_error":
            content = part.content if isinstance(part.content, list) else [part.content]
            said = "; ".join(str(e.get("msg", e) if isinstance(e, dict) else e) for e in content)
            errors = "attempt_completion's arguments are no JSON object: " + one_line(said)[:500]
            found.append(_Invalid(index, errors, BAD_ARGUMENTS.format(errors=errors)))
    return found


def invalid_answers(messages: Sequence[ModelMessage]) -> int:
    """How many answers of this conversation were invalid (`_invalid_parts`): one per request that answers
    one, so a resumed run counts those of the runs before it."""
    return sum(1 for m in messages if isinstance(m, ModelRequest) and _invalid_parts(m))


async def bound_invalid_answers(ctx: RunContext[RunState], /, *, node: Any, result: Any) -> Any:
    """After each step (pydantic-ai's `after_node_run` hook), in a typed run: a step that answers an invalid
    answer (`_invalid_parts`) is counted with those of the whole conversation, shown as an `output_invalid`
    line, and the `max_invalid_outputs`-th fails the task (OutputInvalid); before it, the model reads what was
    wrong and how many more invalid answers fail the task. One count for every kind, checked on each."""
    # Only the step that handled a response makes a new request from it (a resumed run's first step sends
    # the last request of its history, counted already).
    if ctx.deps.completion_parameters is None or not isinstance(node, CallToolsNode):
        return result
    if not isinstance(result, ModelRequestNode) or any(m is result.request for m in ctx.messages):
        return result
    request = result.request
    found = _invalid_parts(request)
    if not found:
        return result
    answers = invalid_answers([*ctx.messages, request])
    bound = ctx.deps.profile.max_invalid_outputs
    errors = [invalid.errors for invalid in found]
    ctx.deps.run.say("output_invalid", f"answer {answers} of at most {bound}: " + "; ".join(errors))
    if answers >= bound:
        raise OutputInvalid(answers, errors)
    left = bound - answers
    warning = f" ({left} more invalid answer{'s fail' if left != 1 else ' fails'} the task)."
    for invalid in found:  # the parts of the request the model is asked with next, made for it by this step
        part = request.parts[invalid.at]
        assert isinstance(part, RetryFeedbackPart | ToolReturnPart)
        part.content = invalid.text + warning
    return result


def check_completion(schema: Mapping[str, Any], args: Mapping[str, Any]) -> tuple[TypedResult | None, list[str]]:
    """A typed completion's arguments checked: (the result, []) when they hold, else (None, every error)."""
    result, errors = args.get("result"), []
    if not isinstance(result, str):
        errors.append("result: a string is required")
    unknown = sorted(set(args) - {"result", "data"})
    if unknown:
        errors.append(f"unknown argument(s): {', '.join(unknown)} (attempt_completion takes result and data)")
    if "data" in args:
        errors += output_errors(schema, args["data"])
    else:
        errors.append("data: required: your result as JSON in the shape of the task's schema")
    if errors:
        return None, errors
    return TypedResult(str(result), compact(args["data"])), []


def typed_completion(schema: Mapping[str, Any], max_retries: int) -> ToolOutput[TypedResult]:
    """The `attempt_completion(result, data)` output tool of one typed run: `data`'s parameter schema is the
    task's `schema`, so a tool-calling model is held to it. Data that breaks it is answered OUTPUT_INVALID with
    every error, an invalid answer that `bound_invalid_answers` counts and bounds (`max_retries` bounds the
    retries pydantic-ai allows the tool, "not taken" answers included: set above that bound)."""

    class CompletionArgs(dict[str, Any]):
        """The tool's arguments as the model sent them; checked below, against the task's own schema."""

        # The tool's parameter schema is this type's (pydantic-ai's single model-like argument).
        __is_model_like__ = True

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
            return handler.generate_schema(dict[str, Any])

        @classmethod
        def __get_pydantic_json_schema__(cls, schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
            # pydantic resolves every `$ref` of a schema it generates against its own definitions, and a
            # task's schema has its own: the model is given the whole of it by `typed_parameters`.
            return dict(PLACEHOLDER_PARAMETERS)

    def attempt_completion(ctx: RunContext[RunState], completion: CompletionArgs) -> TypedResult:
        """Finish your task: `result` says it in a few sentences, and `data` is your result as JSON in the shape
        its schema gives. Call it on its own, after you have read every tool result."""
        others = _other_calls(ctx)
        if others:  # as the untyped completion (above)
            ctx.deps.run.say("completion_not_taken", f"attempt_completion waits for {', '.join(others)}")
            raise ModelRetry(COMPLETION_NOT_TAKEN.format(others=", ".join(others)))
        taken, errors = check_completion(schema, completion)
        if taken is not None:
            return taken
        raise ModelRetry(f"{OUTPUT_INVALID}{'; '.join(errors)}{DATA_AGAIN}")

    # Annotations as objects: the function is made per run, its argument type with it.
    attempt_completion.__annotations__ = {
        "ctx": RunContext[RunState], "completion": CompletionArgs, "return": TypedResult,
    }  # fmt: skip
    return ToolOutput(attempt_completion, name="attempt_completion", max_retries=max_retries)

"""The offline model's script grammar: the `subq-script` block of a task message, parsed and checked.

`parse_script` finds the one fenced block with the info string `subq-script`
in a task message and validates it into a `Script` (steps of replies, tool
calls, transient failures, usage and latency); `final_reply` is what the model
says without a script or after its last step. The message is scanned a line
at a time, so both are linear in its size. docs/offline-model.md is the
user's guide.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal, Self

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_ai.usage import RequestUsage

from coordinator import ScriptError

__all__ = [
    "MAX_LATENCY_MS",
    "MAX_SUMMARY_CHARS",
    "SCRIPT_INFO_STRING",
    "Script",
    "ScriptUsage",
    "Step",
    "ToolCall",
    "TransientFailure",
    "final_reply",
    "parse_script",
    "script_message",
]

SCRIPT_INFO_STRING = "subq-script"
# Ten minutes: longer than any API call worth simulating, short enough that a typo
# cannot park a worker slot for the task's whole time limit.
MAX_LATENCY_MS = 600_000
# A script is steps of calls with JSON arguments: a few levels deep. Far deeper is an attack.
MAX_NESTING = 64
# Keeps the default reply a one-liner when a task's first line is a paragraph.
MAX_SUMMARY_CHARS = 80

# An opening fence of three backticks and the info string, and a closing fence;
# CommonMark allows up to three spaces of indentation. One line each, matched whole: the message is scanned a line at a time, so parsing is
# linear in its size (a multi-line lazy pattern rescanned the rest of the text from every
# unclosed opening: a megabyte of openings took minutes).
_SCRIPT_OPENING = re.compile(r" {0,3}```[ \t]*" + re.escape(SCRIPT_INFO_STRING) + r"[ \t]*")
_FENCE_CLOSING = re.compile(r" {0,3}```[ \t]*")


class ToolCall(BaseModel):
    """One tool call a step makes: the tool's name and its JSON arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)


class ScriptUsage(BaseModel):
    """Token counts a step reports. `input` excludes cache tokens, as in Anthropic's protocol."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # strict: a JSON 1.5 or "7" is a mistake in the script, not a count to round or parse.
    input: int = Field(default=0, ge=0, strict=True)
    output: int = Field(default=0, ge=0, strict=True)
    cache_write: int = Field(default=0, ge=0, strict=True)
    cache_read: int = Field(default=0, ge=0, strict=True)

    def request_usage(self) -> RequestUsage:
        """As pydantic-ai counts it: `input_tokens` includes the cache reads and writes."""
        return RequestUsage(
            input_tokens=self.input + self.cache_write + self.cache_read,
            output_tokens=self.output,
            cache_write_tokens=self.cache_write,
            cache_read_tokens=self.cache_read,
        )


class TransientFailure(BaseModel):
    """The first `times` attempts of a step fail with a transient error (waited out by the runtime)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["rate_limit", "server", "timeout"]
    times: int = Field(default=1, ge=1, le=100, strict=True)


class Step(BaseModel):
    """What one model request answers: exactly one of `reply`, `tool_calls` or `fail`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reply: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1)
    fail: str | None = Field(default=None, min_length=1)
    usage: ScriptUsage | None = None
    latency_ms: int | None = Field(default=None, ge=0, le=MAX_LATENCY_MS, strict=True)
    transient: TransientFailure | None = None

    @model_validator(mode="after")
    def _exactly_one_action(self) -> Self:
        given = [name for name in ("reply", "tool_calls", "fail") if getattr(self, name) is not None]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(f"a step needs exactly one of reply, tool_calls or fail (got {got})")
        if self.fail is not None and self.usage is not None:
            # Rejected requests are not billed, and silently dropping the numbers would mislead.
            raise ValueError("a fail step reports no usage (a rejected request is not billed)")
        return self

    @property
    def kind(self) -> Literal["reply", "tool_calls", "fail"]:
        """Which of the three actions the step takes."""
        if self.reply is not None:
            return "reply"
        return "tool_calls" if self.tool_calls is not None else "fail"


class Script(BaseModel):
    """The steps of a scripted task, one per model request, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: list[Step]


def parse_script(message: str) -> Script | None:
    """The script in a task message's `subq-script` block, or None when it has none.

    Raises `ScriptError` (with the field path, such as `script.steps.1.usage.input`)
    when the block is unclosed, repeated, not JSON, or not a valid script.
    """
    blocks, openings, _ = _script_blocks(message.replace("\r\n", "\n").split("\n"))
    if not blocks and not openings:
        return None
    if openings > len(blocks) or not blocks:
        raise ScriptError("subq-script block is not closed with a line of ```", field="script")
    if len(blocks) > 1:
        # Silently playing the first of two would surprise whoever edited the second.
        raise ScriptError(f"the message has {len(blocks)} subq-script blocks; put every step in one", field="script")
    body = blocks[0]
    if _nested_deeper_than(body, MAX_NESTING):
        # Checked before parsing: json recurses once per level, and a RecursionError deep in
        # the decoder is not a clean refusal (it may even fail a finaliser on the way out).
        raise ScriptError(f"subq-script block is not valid JSON: nested deeper than {MAX_NESTING}", field="script")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        # exc.lineno counts lines of the block's body, the text the author wrote as JSON.
        raise ScriptError(
            f"subq-script block is not valid JSON: {exc.msg} (line {exc.lineno})", field="script"
        ) from None
    try:
        return Script.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _script_error(exc) from None


def _nested_deeper_than(text: str, limit: int) -> bool:
    """Whether JSON text nests arrays and objects deeper than `limit`; one pass, strings skipped."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _script_blocks(lines: list[str]) -> tuple[list[str], int, list[str]]:
    """One pass over the lines: the bodies of the closed subq-script blocks, how many opening
    lines there are, and the lines outside closed blocks (an unclosed block stays text)."""
    blocks: list[str] = []
    outside: list[str] = []
    openings = 0
    block: list[str] | None = None  # the opening line, then the body, of the block now open
    for line in lines:
        if "```" not in line:  # most lines: no fence can be on them (a substring test, not a regex)
            (outside if block is None else block).append(line)
            continue
        if block is None:
            if _SCRIPT_OPENING.fullmatch(line):
                openings += 1
                block = [line]
            else:
                outside.append(line)
            continue
        if _SCRIPT_OPENING.fullmatch(line):
            openings += 1
        if _FENCE_CLOSING.fullmatch(line):
            body = block[1:]
            blocks.append("\n".join(body) + ("\n" if body else ""))
            block = None
        else:
            block.append(line)
    return blocks, openings, outside + (block or [])


def _script_error(exc: pydantic.ValidationError) -> ScriptError:
    """The first validation error as one readable line with its dotted field path."""
    err = exc.errors()[0]
    loc = err["loc"]
    field = ".".join(["script", *(str(part) for part in loc)])
    if err["type"] == "extra_forbidden" and loc:
        allowed = ", ".join(_model_at(loc[:-1]).model_fields)
        reason = f"unknown key {loc[-1]!r} (allowed: {allowed})"
    else:
        reason = err["msg"].removeprefix("Value error, ")
    return ScriptError(f"invalid subq-script at {field}: {reason}", field=field)


def _model_at(loc: Sequence[int | str]) -> type[BaseModel]:
    """Which script model sits at a location, to list the keys it allows."""
    names = [part for part in loc if isinstance(part, str)]
    if not names:
        return Script
    by_key: dict[str, type[BaseModel]] = {"steps": Step, "usage": ScriptUsage, "tool_calls": ToolCall}
    return by_key.get(names[-1], Script)


def final_reply(message: str) -> str:
    """The reply without a script and after its last step: `Done: <first line of the task>`."""
    _, _, text = _script_blocks(message.replace("\r\n", "\n").split("\n"))
    first = next((line.strip() for line in text if line.strip()), "")
    if not first:
        return "Done."
    if len(first) > MAX_SUMMARY_CHARS:
        first = first[: MAX_SUMMARY_CHARS - 1].rstrip() + "…"
    return f"Done: {first}"


def script_message(text: str, steps: Sequence[dict[str, Any]]) -> str:
    """A task message: `text`, then a `subq-script` block playing `steps` (the writer of this grammar)."""
    return f"{text}\n\n```{SCRIPT_INFO_STRING}\n{json.dumps({'steps': list(steps)})}\n```\n"

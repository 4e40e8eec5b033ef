"""A context that never overflows: what a run's model is sent once its conversation nears the window.

The run's own message history and its journal in Redis stay whole (the original
transcript, for the export and the UI); compaction changes only what each request
SENDS, in the model wrapper every request goes through (workers/runtime/metering.py).
docs/context.md is the user's guide. Before a request whose estimated size passes
`compact_at_share` of the profile's `context_window`:

1. old tool results are elided (a line saying what was there takes each one's
   place), the newest turns' kept whole;
2. if that is not enough, the older turns are folded into a summary that a
   summariser request writes (the profile's model, or `compaction_profile`'s),
   put after the task's instruction together with the task's plan as it stands.

The task's instruction (the first request: system prompt and task message) and
the last turns are always kept, and a turn is never split: a response's tool
calls and their results are folded, elided or kept together. A compaction aims
at `TARGET_SHARE` of the threshold, so it is not needed again at the next request.
A provider's refusal of a request as too long (OpenAI's `context_length_exceeded`,
Anthropic's "prompt is too long": pydantic-ai's `ModelContextWindowExceededError`)
compacts the same way, towards half the refused request's size, and the request
is sent once more.

Each compaction is a record (`CompactionRecord`) kept beside the journal, while the
run holds its lease (coordinator/store/compaction.py): which journal messages are
folded (`folded_upto`) and whose tool results are elided (`elided_upto`), the
summary, the plan, and the tokens before and after. A record is cumulative (the
latest says it all), so a run resumed anywhere rebuilds the same view from the
journal and the latest record, and never compacts the same turns twice.

The estimate is conservative: the characters of what a request carries (every
part's text, tool calls' arguments, instructions, the tools' schemas), at
`CHARS_PER_TOKEN_ESTIMATE` a token, fewer than providers' tokenizers average, so
it counts more tokens than the provider will (except for scripts of about a
character a token, as Chinese or Japanese: the compaction after a refusal is their
guard); an image or a file counts `MEDIA_TOKENS`, not its bytes.

A window the task's instruction, tools and last turn alone (nearly) fill cannot be
helped by compacting: a request no compaction brings under the threshold is sent as
it is while it fits the window, with no record kept and no summary paid for; past
the window, the smallest compaction is made if it fits, and where none does the
task fails (`ContextTooSmall`), naming the figures.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai.exceptions import ModelContextWindowExceededError, ModelHTTPError
from pydantic_ai.messages import (
    MULTI_MODAL_CONTENT_TYPES,
    CachePoint,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    RetryPromptPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters

__all__ = [
    "CHARS_PER_TOKEN_ESTIMATE",
    "COMBINED_RESULT_SHARE",
    "KEEP_TURNS",
    "MEDIA_TOKENS",
    "METADATA_KEY",
    "TARGET_SHARE",
    "CompactionPort",
    "CompactionRecord",
    "Compactor",
    "ContextTooSmall",
    "Summariser",
    "cap_text",
    "combined_result_chars",
    "compacted_view",
    "estimate_tokens",
    "fingerprint_of",
    "folded_responses",
    "is_context_overflow",
    "is_summary_request",
    "message_adapter",
    "summary_request",
]

log = logging.getLogger(__name__)

# Characters a token, for the estimate: providers' tokenizers average about 4 for English and 3.3 for
# JSON and code; counting 3 overstates a request's tokens, so a compaction comes early, never late.
CHARS_PER_TOKEN_ESTIMATE = 3.0
# The share of a parent's window its children's combined result may fill (`combined_result_chars`).
COMBINED_RESULT_SHARE = 0.5
# What each part costs beside its text (role, ids, separators), in characters.
PART_OVERHEAD_CHARS = 16
# What one image, audio clip, video or document costs, in tokens, wherever it is (a user prompt, a tool's
# result), whatever its bytes: providers bill an image by its pixels, not its bytes (OpenAI: at most 1,105 for a
# 2048x768 image in high detail; Anthropic: about 1,600 for the 1.15-megapixel images it keeps whole), so
# counting its bytes made a 100 KB screenshot ~30k tokens. A file given by URL counts its URL's characters too.
MEDIA_TOKENS = 1_600
# The newest turns a compaction keeps whole (a turn: a response and the results of its calls); 1 where
# two do not fit.
KEEP_TURNS = 2
# A compaction aims at this share of the threshold: room for several more turns before the next one.
TARGET_SHARE = 0.6
# After a provider refused a request as too long, the request sent again aims at this share of its estimate.
OVERFLOW_SHARE = 0.5
# Of each tool result, what the summariser reads (its beginning and end).
SUMMARY_RESULT_CHARS = 1_500
# The summary's length in tokens: an eighth of the window, within these bounds.
SUMMARY_MIN_TOKENS, SUMMARY_MAX_TOKENS = 256, 4_096
# What the summariser reads at most when its model's window is not known (about 20k tokens).
SUMMARY_INPUT_CHARS_UNKNOWN_WINDOW = 60_000
# The key of a request's metadata that marks a compacted view's first request (how many responses it
# folded: the offline model counts its script's steps with them) and a summariser's request.
METADATA_KEY = "subq_compaction"

SUMMARISER_PROMPT = (
    "You compact the conversation of an AI agent that is working on a task, so that it can go on within its "
    "model's context window. Write the agent's working notes from the transcript below: what it has done, what "
    "it found (facts, figures, names, paths, ids, errors, tool results it relied on), the decisions it made and "
    "why, and what it was about to do next. Be specific and brief; no preamble. The task's instruction and plan "
    "are kept apart from your notes: do not repeat them."
)


class ContextTooSmall(Exception):
    """No compaction brings the request within its model's context window: the task fails with this."""


class CompactionRecord(BaseModel):
    """One compaction of a task's conversation, as kept in Redis (`compactions:<task id>`, JSON).

    Cumulative: the latest record says which journal messages the model reads folded into its summary
    (`[1, folded_upto)`) and whose tool results it reads elided (`[0, elided_upto)`). `fingerprint` is
    a hash of the last journal message it covers: a journal that no longer holds that message (a retry
    cut it back) does not take the record.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    number: int = Field(ge=1)
    at: float
    reason: Literal["window", "provider"]
    folded_upto: int = Field(ge=0)
    elided_upto: int = Field(ge=0)
    folded_responses: int = Field(ge=0)
    summary: str = ""
    plan: str = ""
    tokens_before: int = Field(ge=0)
    tokens_after: int = Field(ge=0)
    window: int | None = None
    summariser: str = ""  # the profile whose model wrote the summary ('' when nothing was folded)
    fingerprint: str

    @property
    def covers(self) -> int:
        """How many journal messages from the start it covers."""
        return max(self.folded_upto, self.elided_upto)


@functools.cache
def message_adapter() -> pydantic.TypeAdapter[ModelMessage]:
    """The one JSON form of a journal message, for the runner's conversation and the fingerprints here.

    Built at its first use, once a process: its schema (every message and part type) took about 0.1 s
    of CPU, paid twice at every worker's import when the runner and this module each built one (issue 43,
    point 5), and a process that never runs a task (Flower, `subq tools`, a worker that stops at its
    start) need not build it at all.
    """
    return pydantic.TypeAdapter(ModelMessage)


class Summariser(Protocol):
    """Writes a summary of a transcript: a request to a model, metered and priced as the run's own."""

    async def __call__(self, transcript: str, max_tokens: int) -> str: ...


class CompactionPort(Protocol):
    """What a compaction needs of its run."""

    def plan(self) -> str:
        """The task's plan (todo list) as it stands, rendered ('' when it has none)."""
        ...

    def keep(self, record: CompactionRecord, ui_text: str) -> None:
        """Keep the record with the run's journal, with its UI line and timeline mark (raises `LeaseLost`)."""
        ...


# -- the estimate -----------------------------------------------------------------------------


def combined_result_chars(window: int | None, max_tool_output_chars: int) -> int | None:
    """The most a parent's model reads of its children's combined result, in characters: half its window (as
    the estimate counts characters), never less than one tool result's cap; None where no window is known (the
    combined result's own bound, 256 KiB, holds). Not the tool cap alone: fifty typed children's objects are
    what the parent delegated for, and a 20,000-character cut would drop most of them."""
    if window is None:
        return None
    return max(max_tool_output_chars, int(window * CHARS_PER_TOKEN_ESTIMATE * COMBINED_RESULT_SHARE))


def estimate_tokens(messages: Sequence[ModelMessage], params: ModelRequestParameters | None = None) -> int:
    """A request's size in tokens, overstated (see the module's docstring)."""
    chars, media = 0, 0
    requests = [m for m in messages if isinstance(m, ModelRequest)]
    if requests and requests[-1].instructions:
        chars += len(requests[-1].instructions)  # sent once, though every request records them
    for message in messages:
        for part in message.parts:
            chars += PART_OVERHEAD_CHARS + len(_part_text(part))
            media += len(_media_of(part))
    if params is not None:
        for tool in [*params.function_tools, *params.output_tools]:
            chars += len(json.dumps([tool.name, tool.description, tool.parameters_json_schema]))
    return math.ceil(chars / CHARS_PER_TOKEN_ESTIMATE) + media * MEDIA_TOKENS


def _media_of(part: Any) -> list[Any]:
    """The images and files a part carries (each counts `MEDIA_TOKENS`)."""
    if isinstance(part, UserPromptPart) and not isinstance(part.content, str):
        return [c for c in part.content if isinstance(c, MULTI_MODAL_CONTENT_TYPES)]
    if isinstance(part, ToolReturnPart):
        return list(part.files)
    return []


def _media_label(item: Any) -> str:
    """An image's or a file's place in the text: its kind, and its URL if it has one (counted by its length)."""
    url = getattr(item, "url", None)
    return f"[{item.kind} {url}]" if isinstance(url, str) else f"[{item.kind}]"


def _content_text(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, TextContent):
        return item.content
    if isinstance(item, MULTI_MODAL_CONTENT_TYPES):
        return _media_label(item)
    if isinstance(item, CachePoint):
        return ""
    try:
        return json.dumps(item, default=str)
    except (TypeError, ValueError):
        return str(item)


def _part_text(part: Any) -> str:
    if isinstance(part, SystemPromptPart):
        return part.content
    if isinstance(part, UserPromptPart):
        return part.content if isinstance(part.content, str) else " ".join(_content_text(c) for c in part.content)
    if isinstance(part, ToolReturnPart):
        files = "".join(_media_label(f) for f in part.files)
        return part.tool_name + part.tool_call_id + part.model_response_str() + files
    if isinstance(part, RetryPromptPart):
        return part.model_response()
    if isinstance(part, TextPart | ThinkingPart):
        return part.content
    if isinstance(part, ToolCallPart):
        return part.tool_name + part.tool_call_id + part.args_as_json_str()
    content = getattr(part, "content", None)
    if isinstance(content, str):
        return content
    try:
        return json.dumps(content, default=str)
    except (TypeError, ValueError):
        return str(content)


# -- the view ---------------------------------------------------------------------------------


def cap_text(text: str, max_chars: int, what: str) -> str:
    """`text`, or its beginning and its end with a line saying how much of `what` was cut between them."""
    if len(text) <= max_chars:
        return text
    cut = len(text) - max_chars
    head = max_chars * 2 // 3
    tail = max_chars - head
    line = f"\n[... {cut:,} of {len(text):,} characters of {what} cut here ...]\n"
    return text[:head] + line + (text[-tail:] if tail else "")


def _elided(part: ToolReturnPart) -> ToolReturnPart:
    chars, files = len(part.model_response_str()), len(part.files)
    with_files = f" and {files} file{'s' if files != 1 else ''}" if files else ""
    note = (
        f"[result elided to keep the conversation within the model's context window: {chars:,} characters{with_files} "
        f"of {part.tool_name}'s result; call the tool again if it is still needed]"
    )
    return replace(part, content=note)


def folded_responses(messages: Sequence[ModelMessage]) -> int:
    """How many responses a compacted view's first request says it folded (0 for any other history)."""
    first = messages[0] if messages else None
    if not isinstance(first, ModelRequest) or not first.metadata:
        return 0
    marked = first.metadata.get(METADATA_KEY)
    return int(marked.get("folded_responses", 0)) if isinstance(marked, dict) else 0


# What a message's fingerprint leaves out: when it is sent. A request that was never answered (its run parked on
# a provider wait, or ended on bad output) is made again by the next run, with a new timestamp and run id and
# the same parts, while the journal keeps the first copy. Hashed with them, a record made on the new copy
# matched no journal, and the run after it compacted the turns that record had folded again, paying for a
# second summary of them.
WHEN_SENT = ("timestamp", "run_id")


def fingerprint_of(message: ModelMessage) -> str:
    """A short hash of one journal message's content (not of when it was sent), as a record names the last message
    it covers."""
    dumped = message_adapter().dump_python(message, mode="json")
    for part in dumped.get("parts", ()):
        part.pop("timestamp", None)
    content = {name: value for name, value in dumped.items() if name not in WHEN_SENT}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def fits(messages: Sequence[ModelMessage], record: CompactionRecord) -> bool:
    """Whether the journal still holds the messages `record` covers, as they were."""
    covers = record.covers
    if covers < 1 or covers > len(messages) or not isinstance(messages[0], ModelRequest):
        return False
    if record.folded_upto > 1 and (
        record.folded_upto >= len(messages) or not isinstance(messages[record.folded_upto], ModelResponse)
    ):
        return False
    return fingerprint_of(messages[covers - 1]) == record.fingerprint


def compacted_view(messages: Sequence[ModelMessage], record: CompactionRecord | None) -> list[ModelMessage]:
    """What the model is sent of `messages` under `record` (a copy: no message of the history is changed)."""
    if record is None or not fits(messages, record):
        return list(messages)
    head = messages[0]
    assert isinstance(head, ModelRequest)
    start = 1
    if record.folded_upto > 1:
        start = record.folded_upto
        marked = {**(head.metadata or {}), METADATA_KEY: {"folded_responses": record.folded_responses}}
        head = replace(head, parts=[*head.parts, UserPromptPart(_summary_block(record))], metadata=marked)
    view: list[ModelMessage] = [head]
    for index in range(start, len(messages)):
        message = messages[index]
        if index < record.elided_upto and isinstance(message, ModelRequest):
            message = _with_results_elided(message)
        view.append(message)
    return view


def _with_results_elided(request: ModelRequest) -> ModelRequest:
    if not any(isinstance(p, ToolReturnPart) for p in request.parts):
        return request
    return replace(request, parts=[_elided(p) if isinstance(p, ToolReturnPart) else p for p in request.parts])


def _summary_block(record: CompactionRecord) -> str:
    plan = f"\n\nThe task's plan as it stood then:\n{record.plan}" if record.plan else ""
    return (
        f"[Context compacted: the {record.folded_upto - 1} messages of the conversation that came here "
        f"({record.folded_responses} of your responses and what they were answered) were folded into these "
        f"notes, to stay within the model's context window.]\n\n{record.summary}{plan}"
    )


# -- the summariser's request -----------------------------------------------------------------


def summary_request(transcript: str) -> ModelRequest:
    """A summariser's request: its instructions and the transcript, marked for the offline model."""
    return ModelRequest(
        parts=[SystemPromptPart(SUMMARISER_PROMPT), UserPromptPart(transcript)],
        metadata={METADATA_KEY: {"summarise": True}},
    )


def is_summary_request(messages: Sequence[ModelMessage]) -> bool:
    first = messages[0] if messages else None
    if not isinstance(first, ModelRequest) or not first.metadata:
        return False
    marked = first.metadata.get(METADATA_KEY)
    return isinstance(marked, dict) and bool(marked.get("summarise"))


def _transcript(
    messages: Sequence[ModelMessage], start: int, end: int, previous: CompactionRecord | None, max_chars: int
) -> str:
    """The turns `[start, end)` as text for the summariser, after the notes so far; at most `max_chars`."""
    lines: list[str] = []
    if previous is not None and previous.summary and previous.folded_upto > 1:
        lines.append(f"Notes so far (from earlier turns):\n{previous.summary}\n")
    lines.append("Transcript of the turns to fold:")
    for message in messages[start:end]:
        for part in message.parts:
            lines.append(_transcript_line(part))
    text = "\n".join(line for line in lines if line)
    return cap_text(text, max_chars, "the transcript")


def _transcript_line(part: ModelResponsePart | Any) -> str:
    if isinstance(part, TextPart) and part.content.strip():
        return f"[agent] {part.content.strip()}"
    if isinstance(part, ToolCallPart):
        return f"[agent calls] {part.tool_name}({part.args_as_json_str()})"
    if isinstance(part, ToolReturnPart):
        result = cap_text(part.model_response_str(), SUMMARY_RESULT_CHARS, "this result")
        return f"[{part.tool_name} returned] {result}"
    if isinstance(part, RetryPromptPart):
        return f"[told the agent] {part.model_response()}"
    if isinstance(part, UserPromptPart):
        return f"[user] {_part_text(part)}"
    return ""


# -- choosing and making a compaction ---------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """One way to compact: elide the tool results before `boundary`, and fold the turns before it or not."""

    boundary: int
    fold: bool


def _turn_starts(messages: Sequence[ModelMessage]) -> list[int]:
    """The index of each response after the first request: where each turn starts."""
    return [i for i in range(1, len(messages)) if isinstance(messages[i], ModelResponse)]


# How providers word a refusal for a prompt past the context window: Anthropic's, OpenAI's and vLLM's, and
# llama.cpp's server (`request (4476 tokens) exceeds the available context size (4096 tokens)`, type
# `exceed_context_size_error`), whose refusal compacted nothing: the task failed.
OVERFLOW_WORDS = ("prompt is too long", "maximum context length", "exceeds the available context size")


def is_context_overflow(exc: BaseException) -> bool:
    """Whether a provider refused a request because it passes the model's context window."""
    if isinstance(exc, ModelContextWindowExceededError):
        return True
    if isinstance(exc, ModelHTTPError) and exc.status_code in (400, 413):
        body: Any = exc.body
        inner = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(inner, dict):
            if inner.get("code") == "context_length_exceeded" or inner.get("type") == "exceed_context_size_error":
                return True
            message = str(inner.get("message") or "").lower()
        else:
            message = str(inner or "").lower()
        return any(words in message for words in OVERFLOW_WORDS)
    return False


class Compactor:
    """One run's compaction: the view each request sends, and a compaction when one is due.

    `window` None: no compaction before a request (only after a provider's refusal). `records`: the
    task's kept records, oldest first (a resumed run's; a new run has none). `view` raises
    `ContextTooSmall` where no compaction brings the request within the window.
    """

    def __init__(
        self,
        port: CompactionPort,
        summarise: Summariser,
        *,
        window: int | None,
        share: float,
        summariser_name: str,
        summariser_window: int | None,
        records: Sequence[CompactionRecord] = (),
        window_of: str = "the task's profile",
    ) -> None:
        self.port = port
        self.summarise = summarise
        self.window = window
        self.share = share
        self.summariser_name = summariser_name
        self.summariser_window = summariser_window
        self.window_of = window_of  # whose `context_window` it is, for an error: "profile 'main'"
        self.latest: CompactionRecord | None = records[-1] if records else None
        self.number = max((r.number for r in records), default=0)

    @property
    def threshold(self) -> int | None:
        return None if self.window is None else int(self.window * self.share)

    async def view(self, messages: Sequence[ModelMessage], params: ModelRequestParameters) -> list[ModelMessage]:
        """What to send for `messages`: the view under the latest record, compacted further when it is due."""
        record = self.latest if self.latest is not None and fits(messages, self.latest) else None
        if self.latest is not None and record is None:
            # A retry cut the conversation back below it: the run compacts afresh when it needs to.
            log.warning("subq: compaction %d no longer fits the conversation; not applied", self.latest.number)
            self.latest = None
        current = compacted_view(messages, record)
        threshold = self.threshold
        if threshold is None:
            return current
        tokens = estimate_tokens(current, params)
        if tokens <= threshold:
            return current
        plans = self._plans(messages, record)
        plan_text = self.port.plan() if any(p.fold for p in plans) else ""
        sized = self._sized(messages, params, record, plans, plan_text, "window")
        chosen = next((p for p, t in sized if t <= int(threshold * TARGET_SHARE)), None) or next(
            (p for p, t in sized if t <= threshold), None
        )
        if chosen is None:
            # No compaction brings it under the threshold: one made anyway would be made again at every request,
            # each with a summary paid for. The request goes as it is while it fits the window; past it, the
            # smallest compaction, if that fits (sized with the longest summary: the real one may be shorter).
            assert self.window is not None
            if tokens <= self.window:
                log.info("subq: no compaction brings ~%d tokens under %d; sent as it is", tokens, threshold)
                return current
            smallest = min(sized, key=lambda pt: pt[1], default=None)
            if smallest is None or smallest[1] > self.window:
                least = min(tokens, smallest[1]) if smallest is not None else tokens
                raise ContextTooSmall(
                    f"the task's instruction, tools and last turn are ~{least:,} tokens (estimated), over "
                    f"context_window {self.window:,} of {self.window_of}: no compaction can make the request fit"
                )
            chosen = smallest[0]
        return await self._make(messages, params, record, chosen, plan_text, tokens, "window")

    async def after_overflow(
        self, messages: Sequence[ModelMessage], params: ModelRequestParameters, sent: Sequence[ModelMessage]
    ) -> list[ModelMessage] | None:
        """The view to send once more after the provider refused `sent` as too long; None when nothing more
        can be compacted (the refusal stands)."""
        record = self.latest if self.latest is not None and fits(messages, self.latest) else None
        tokens = estimate_tokens(sent, params)
        target = int(tokens * OVERFLOW_SHARE)
        if self.threshold is not None:
            target = min(target, int(self.threshold * TARGET_SHARE))
        plans = self._plans(messages, record)
        if not plans:
            return None
        plan_text = self.port.plan() if any(p.fold for p in plans) else ""
        sized = self._sized(messages, params, record, plans, plan_text, "provider")
        # The first that reaches the target, else the smallest: the provider's refusal is the only sign here.
        chosen = next((p for p, t in sized if t <= target), None) or min(sized, key=lambda pt: pt[1])[0]
        return await self._make(messages, params, record, chosen, plan_text, tokens, "provider")

    def _plans(self, messages: Sequence[ModelMessage], record: CompactionRecord | None) -> list[_Plan]:
        """The ways to compact further, least lost first: elide keeping 2 turns, then 1; fold keeping 2, then 1."""
        starts = _turn_starts(messages)
        folded = record.folded_upto if record is not None else 0
        elided = record.elided_upto if record is not None else 0
        plans: list[_Plan] = []
        for fold in (False, True):
            for keep in (KEEP_TURNS, 1):
                if len(starts) < keep:
                    continue
                boundary = starts[-keep]
                if fold and boundary > max(folded, 1) and boundary > 1:
                    plans.append(_Plan(boundary, fold=True))
                elif not fold and boundary > elided and _has_results(messages, max(elided, folded, 1), boundary):
                    plans.append(_Plan(boundary, fold=False))
        return plans

    def _summary_tokens(self) -> int:
        """How long the notes may be: the task's model reads them, so an eighth of its window (the summariser's
        where the task's is not known)."""
        window = self.window or self.summariser_window
        if window is None:
            return SUMMARY_MAX_TOKENS
        return max(SUMMARY_MIN_TOKENS, min(SUMMARY_MAX_TOKENS, window // 8))

    def _sized(
        self,
        messages: Sequence[ModelMessage],
        params: ModelRequestParameters,
        record: CompactionRecord | None,
        plans: Sequence[_Plan],
        plan_text: str,
        reason: Literal["window", "provider"],
    ) -> list[tuple[_Plan, int]]:
        """Each plan with the tokens of the view it makes, a fold's summary sized as long as one may be (it is
        not asked for before it is chosen)."""
        placeholder = "x" * int(self._summary_tokens() * CHARS_PER_TOKEN_ESTIMATE)
        return [
            (plan, estimate_tokens(compacted_view(messages, self._draft(messages, record, plan, placeholder, plan_text,
                                                                        reason)), params))
            for plan in plans
        ]  # fmt: skip

    async def _make(
        self,
        messages: Sequence[ModelMessage],
        params: ModelRequestParameters,
        record: CompactionRecord | None,
        chosen: _Plan,
        plan_text: str,
        tokens_before: int,
        reason: Literal["window", "provider"],
    ) -> list[ModelMessage]:
        """The compaction `chosen`: its summary asked for (a fold), its record kept, its view."""
        summary = ""
        if chosen.fold:
            start = max(record.folded_upto if record is not None else 1, 1)
            transcript = _transcript(messages, start, chosen.boundary, record, self._transcript_chars())
            summary = (await self.summarise(transcript, self._summary_tokens())).strip() or "(no notes were written)"
            summary = cap_text(summary, int(self._summary_tokens() * CHARS_PER_TOKEN_ESTIMATE), "the notes")
        draft = self._draft(messages, record, chosen, summary, plan_text, reason)
        view = compacted_view(messages, draft)
        final = draft.model_copy(update={"tokens_before": tokens_before, "tokens_after": estimate_tokens(view, params)})
        self.port.keep(final, _ui_line(final, record))
        self.latest, self.number = final, final.number
        return view

    def _draft(
        self,
        messages: Sequence[ModelMessage],
        record: CompactionRecord | None,
        plan: _Plan,
        summary: str,
        plan_text: str,
        reason: Literal["window", "provider"],
    ) -> CompactionRecord:
        """The record `plan` makes on top of `record` (its tokens are filled in once it is chosen)."""
        if plan.fold:
            folded, summariser = plan.boundary, self.summariser_name
        else:  # the summary and plan of the latest record stand
            folded = record.folded_upto if record is not None else 0
            summary = record.summary if record is not None else ""
            plan_text = record.plan if record is not None else ""
            summariser = record.summariser if record is not None else ""
        elided = max(plan.boundary, record.elided_upto if record is not None else 0)
        covers = max(folded, elided)
        return CompactionRecord(
            number=self.number + 1, at=time.time(), reason=reason, folded_upto=folded, elided_upto=elided,
            folded_responses=sum(isinstance(m, ModelResponse) for m in messages[1:folded]) if folded > 1 else 0,
            summary=summary, plan=plan_text, tokens_before=0, tokens_after=0, window=self.window,
            summariser=summariser, fingerprint=fingerprint_of(messages[covers - 1]),
        )  # fmt: skip

    def _transcript_chars(self) -> int:
        window = self.summariser_window or self.window
        if window is None:
            return SUMMARY_INPUT_CHARS_UNKNOWN_WINDOW
        room = int(window * self.share) - self._summary_tokens() - estimate_tokens([summary_request("")])
        return max(1_000, int(room * CHARS_PER_TOKEN_ESTIMATE))


def _has_results(messages: Sequence[ModelMessage], start: int, end: int) -> bool:
    return any(
        isinstance(m, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in m.parts) for m in messages[start:end]
    )


def _ui_line(record: CompactionRecord, previous: CompactionRecord | None) -> str:
    """The `context_compacted` line: tokens before and after, why, and what was done."""
    done: list[str] = []
    if record.elided_upto > (previous.elided_upto if previous is not None else 0):
        done.append("older tool results elided")
    if record.folded_upto > (previous.folded_upto if previous is not None else 0):
        done.append(f"{record.folded_upto - 1} older messages summarised by profile {record.summariser!r}")
    if record.reason == "provider":
        why = "the provider refused the request as too long"
    else:
        why = f"the model's context window is {record.window:,} tokens" if record.window else ""
    return (
        f"context compacted: ~{record.tokens_before:,} -> ~{record.tokens_after:,} tokens (estimated"
        f"{'; ' + why if why else ''}): {'; '.join(done) or 'nothing more to fold'}"
    )


def load_records(entries: Sequence[str]) -> list[CompactionRecord]:
    """The kept records (JSON), oldest first; one that cannot be read is left out, with a warning."""
    records = []
    for entry in entries:
        try:
            records.append(CompactionRecord.model_validate_json(entry))
        except pydantic.ValidationError:
            log.warning("subq: a compaction record could not be read; left out")
    return records


# A summariser as the runner makes one: a coroutine function of (transcript, max tokens).
SummariserFn = Callable[[str, int], Awaitable[str]]

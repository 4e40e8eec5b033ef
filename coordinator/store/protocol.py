"""The step protocol: every Lua script's KEYS, ARGV and reply, declared once.

A script's call is a frozen dataclass here (`EndRun`, `StartRun`, ...): its fields, in
order, are the script's KEYS and ARGV, each with the line its `.lua` header says of it.
From that one declaration come

- the registration: `Scripts` (base.py) registers each `Call` subclass's script, with
  the scripts it `uses` inlined, and sends it with its WAIT when it is `acknowledged`;
- the packing: `call.pack()` lays the fields out as KEYS and ARGV (a `count_of` field is
  the length of the tail it counts, so no caller counts by hand);
- the typed reply: `call.decode(raw)` turns the script's reply into a typed value;
- the header: `render_header(Call)` is what the script's `.lua` header must say of its
  KEYS, ARGV and reply, line for line (tests/test_protocol.py holds every file to it).

A store part calls a script as `self.scripts(FinishTask(task=..., events=..., ...))`.

Fields are declared with `key`, `keys` (a variadic tail of keys), `arg`, `args` (a tail
of arguments; a tail's items may be tuples, laid out flat: `retry`'s 5 values per task),
`count` (an argument that is a tail's length) and `splice` (a `Group` of keys and
arguments several scripts share, laid out where it stands: `RunKeys`, `StepWrites`, or
a whole call one script makes inside another, as `record_tool` makes `flush_run`'s).
A tail comes last among the KEYS or the ARGV, after it only other tails.

To add a script: write `lua/<name>.lua` with its prose header; declare its `Call` here
(`script=`, `uses=` for the scripts it calls, `returns=`, `acknowledged=True` for a step a
caller sees, and `decode` for its typed reply, or a `Flag` for a script that answers 1 or 0); put its rendered lines into the header below
the prose (`python -c "from coordinator.store.protocol import CALLS, render_header;
print(*render_header(CALLS['<name>']), sep='\\n')"`); and send it from its store part as
`self.scripts(<Call>(...))`. tests/test_protocol.py then checks the header, the indexes the
body reads, and that every file of lua/ is declared.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, cast

from coordinator.models import Mark, RetryRefused, Usage
from coordinator.replies import (
    BatchClosed,
    ChildSettled,
    Decided,
    Ending,
    EndpointState,
    FairHealed,
    LateSpendRecorded,
    QuotaVerdict,
    StartReply,
    Stepped,
    TransientCount,
    UsageRecorded,
)

__all__ = [
    "CALLS",
    "Call",
    "Group",
    "QuotaVerdict",
    "ScriptArg",
    "StartReply",
    "render_header",
]

ScriptArg = str | int | float
R = TypeVar("R")

# Width of a rendered header line: a wrapped description goes on in lines that start `--   `.
HEADER_WIDTH = 110


# -- declaring fields ---------------------------------------------------------------------


def key(doc: str) -> Any:
    """One key: KEYS[i]."""
    return field(metadata={"slot": "key", "doc": doc})


def keys(doc: str) -> Any:
    """A variadic tail of keys: KEYS[i..]."""
    return field(metadata={"slot": "keys", "doc": doc})


def arg(doc: str, *, optional: bool = False) -> Any:
    """One argument: ARGV[i]. An optional one (None) is left off the end of ARGV."""
    if optional:
        return field(default=None, metadata={"slot": "arg", "doc": doc, "optional": True})
    return field(metadata={"slot": "arg", "doc": doc})


def args(doc: str) -> Any:
    """A variadic tail of arguments: ARGV[i..]; tuples among its items are laid out flat."""
    return field(metadata={"slot": "args", "doc": doc})


def count(doc: str, of: str) -> Any:
    """An argument that is the length of the tail `of`, computed when packed."""
    return field(init=False, default=0, metadata={"slot": "arg", "doc": doc, "count_of": of})


def splice(doc: str, *, expand: bool = False) -> Any:
    """A `Group`'s keys and arguments, laid out here: in the header, one line per side (its `doc`),
    or, with `expand`, each of its own lines."""
    return field(metadata={"slot": "splice", "doc": doc, "expand": expand})


# -- groups and calls ---------------------------------------------------------------------


class _Packed(NamedTuple):
    """How `pack` lays out one field, or a run of plain keys or plain arguments declared one after another,
    read from the declarations once per class (`Group._plan`). A run is read in one `attrgetter` call: a
    step's two packs read some 80 fields, and a `getattr` and an `append` each were most of their calls."""

    slot: str
    read: Callable[[Any], Any]  # the field's value, or a run's values as a tuple (`many`)
    many: bool
    count_of: str  # a `count` field's tail, else ""
    optional: bool


def _plan_of(fields: Sequence[dataclasses.Field[Any]]) -> tuple[_Packed, ...]:
    plan: list[_Packed] = []
    run: list[str] = []
    run_slot = ""

    def close_run() -> None:
        if run:
            plan.append(_Packed(run_slot, attrgetter(*run), len(run) > 1, "", False))
            run.clear()

    for f in fields:
        slot, count_of, optional = f.metadata["slot"], f.metadata.get("count_of", ""), bool(f.metadata.get("optional"))
        if slot in ("key", "arg") and not count_of and not optional:
            if slot != run_slot:
                close_run()
            run_slot = slot
            run.append(f.name)
            continue
        close_run()
        run_slot = ""
        plan.append(_Packed(slot, attrgetter(f.name), False, count_of, optional))
    close_run()
    return tuple(plan)


class Group:
    """Keys and arguments declared as dataclass fields (see the module's docstring)."""

    # Each class's fields as `pack` lays them out: read from `dataclasses.fields` on the first pack, not on
    # every one (two packs a run's start and end; the field walk was most of their Python, bench/thread_cpu.py).
    _plans: ClassVar[dict[type[Group], tuple[_Packed, ...]]] = {}

    @classmethod
    def _plan(cls) -> tuple[_Packed, ...]:
        plan = Group._plans.get(cls)
        if plan is None:
            plan = Group._plans[cls] = _plan_of(dataclasses.fields(cast(Any, cls)))
        return plan

    def pack(self) -> tuple[list[str], list[ScriptArg]]:
        """This group's KEYS and ARGV, in declaration order."""
        out_keys: list[str] = []
        out_args: list[ScriptArg] = []
        for slot, read, many, count_of, optional in self._plan():
            if count_of:
                out_args.append(len(getattr(self, count_of)))
                continue
            value = read(self)
            if many:
                (out_keys if slot == "key" else out_args).extend(value)
            elif slot == "key":
                out_keys.append(value)
            elif slot == "arg":
                if value is not None or not optional:
                    out_args.append(value)
            elif slot in ("keys", "args"):  # each item one name or value, or a tuple of them
                out = out_keys if slot == "keys" else out_args
                for item in value:
                    out.extend(item) if isinstance(item, tuple) else out.append(item)
            else:
                sub_keys, sub_args = cast(Group, value).pack()
                out_keys += sub_keys
                out_args += sub_args
        return out_keys, out_args


class Call(Group, Generic[R]):
    """One call of one script: its fields are the script's KEYS and ARGV; `decode` types its reply."""

    script: ClassVar[str] = ""
    uses: ClassVar[tuple[str, ...]] = ()
    returns: ClassVar[str] = ""
    acknowledged: ClassVar[bool] = False
    standalone: ClassVar[bool] = True

    def __init_subclass__(
        cls,
        *,
        script: str = "",
        uses: tuple[str, ...] = (),
        returns: str = "",
        acknowledged: bool = False,
        standalone: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        cls.script, cls.uses, cls.returns = script, uses, returns
        cls.acknowledged, cls.standalone = acknowledged, standalone
        if script:
            if script in CALLS:
                raise TypeError(f"{script}.lua is declared twice: {CALLS[script].__name__} and {cls.__name__}")
            CALLS[script] = cls

    @classmethod
    def decode(cls, raw: Any) -> R:
        """The script's reply, typed; a script only other scripts call has no Python reply."""
        raise NotImplementedError(f"{cls.script}.lua is called only from other scripts")


class Flag(Call[bool]):
    """A call whose script answers 1 or 0 (a Lua number, or nil for 0): a bool."""

    @classmethod
    def decode(cls, raw: Any) -> bool:
        return bool(raw)


# Every script of lua/ (hashes.lua is the prelude of all, not a script), by file name.
CALLS: dict[str, type[Call[Any]]] = {}


# -- rendering a header -------------------------------------------------------------------


def _typed(f: dataclasses.Field[Any], doc: str) -> str:
    """An argument's line: its Python type, then what it is (a tail of tuples: what its doc says)."""
    name = str(f.type).removesuffix(" | None")
    if f.metadata["slot"] == "args":
        item = name.removeprefix("Sequence[").removesuffix("]")
        return f"each {item}: {doc}" if item in ("str", "int", "float") else doc
    return f"{name}: {doc}"


# A header line: its first index, its last (None for a tail, which takes every index from the first on), its text.
_Line = tuple[int, int | None, str]
# What one field puts on a header: its side ("key" or "arg"), its width (None for a tail), its text.
_Entry = tuple[str, int | None, str]


class _Side:
    """The lines of one side of a header (KEYS or ARGV), numbered as fields fill it: a tail comes last."""

    def __init__(self, group: type[Group], side: str) -> None:
        self.group, self.side = group, side
        self.lines: list[_Line] = []
        self.at = 1
        self.tail = False

    def put(self, width: int | None, text: str) -> None:
        if self.tail and width is not None:
            raise TypeError(f"{self.group.__name__}: a fixed {self.side} after a tail")
        last = None if width is None else self.at + width - 1
        self.lines.append((self.at, last, text))
        if width is None:
            self.tail = True
        else:
            self.at += width


def _layout(group: type[Group]) -> tuple[list[_Line], list[_Line]]:
    """Each line of the group's KEYS and ARGV: (first index, last index or None for a tail, text)."""
    sides = {"key": _Side(group, "key"), "arg": _Side(group, "arg")}
    for f in dataclasses.fields(cast(Any, group)):
        for side, width, text in _entries(group, f):
            sides[side].put(width, text)
    return sides["key"].lines, sides["arg"].lines


def _entries(group: type[Group], f: dataclasses.Field[Any]) -> list[_Entry]:
    """What the field `f` of `group` puts on the header, by its slot."""
    slot, doc = f.metadata["slot"], f.metadata["doc"]
    if slot == "key":
        return [("key", 1, doc)]
    if slot == "keys":
        return [("key", None, doc)]
    if slot == "arg":
        optional = "(optional) " if f.metadata.get("optional") else ""
        return [("arg", 1, optional + _typed(f, doc))]
    if slot == "args":
        return [("arg", None, _typed(f, doc))]
    return _spliced_entries(group, f)


def _spliced_entries(group: type[Group], f: dataclasses.Field[Any]) -> list[_Entry]:
    """A splice's lines: each line of its group where it expands, else one line a side standing for them all
    (its doc naming the side), as wide as they are together or a tail if one of them is."""
    inner_keys, inner_args = _layout(_splice_type(group, f))
    entries: list[_Entry] = []
    for side, lines in (("key", inner_keys), ("arg", inner_args)):
        if not lines:
            continue
        if f.metadata["expand"]:
            entries += [(side, None if last is None else last - first + 1, text) for first, last, text in lines]
        else:
            fixed = all(last is not None for _, last, _ in lines)
            width = sum(cast(int, last) - first + 1 for first, last, _ in lines) if fixed else None
            entries.append((side, width, f.metadata["doc"].format(side="KEYS" if side == "key" else "ARGV")))
    return entries


def _splice_type(group: type[Group], f: dataclasses.Field[Any]) -> type[Group]:
    found = globals().get(str(f.type))
    if not (isinstance(found, type) and issubclass(found, Group)):
        raise TypeError(f"{group.__name__}.{f.name}: a splice must be a Group of this module, not {f.type}")
    return found


def _index(name: str, first: int, last: int | None, tail_seen: bool) -> str:
    if last is None:
        return f"{name}[..]" if tail_seen else f"{name}[{first}..]"
    return f"{name}[{first}]" if first == last else f"{name}[{first}..{last}]"


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, HEADER_WIDTH - 3, initial_indent="-- ", subsequent_indent="--   ")


def render_header(call: type[Call[Any]]) -> list[str]:
    """The lines a script's `.lua` header must hold, in order: each KEYS and ARGV line, then Returns."""
    lines: list[str] = []
    for name, side in zip(("KEYS", "ARGV"), _layout(call), strict=True):
        tail_seen = False
        for first, last, text in side:
            lines += _wrapped(f"{_index(name, first, last, tail_seen)} {text}")
            tail_seen = tail_seen or last is None
    return lines + _wrapped(f"Returns {call.returns}")


def declared_header(lua_text: str) -> list[str]:
    """The KEYS, ARGV and Returns lines of a `.lua` file's opening comment (each with its `--   ` lines)."""
    out: list[str] = []
    going_on = False
    for line in lua_text.splitlines():
        if not line.startswith("--"):
            break
        if line.startswith(("-- KEYS[", "-- ARGV[", "-- Returns ")):
            out.append(line)
            going_on = True
        elif going_on and line.startswith("--   "):
            out.append(line)
        else:
            going_on = False
    return out


# -- typed replies --------------------------------------------------------------------------


def _strs(reply: Any) -> list[str]:
    # The client decodes replies (decode_responses=True): a Lua string comes back a str.
    return [str(item) for item in reply]


def _stepped(raw: Any) -> Stepped:
    if int(raw[0]) == 0:
        return Stepped(leased=False, status="", exhausted=None)
    return Stepped(leased=True, status=str(raw[1]), exhausted=str(raw[2]) or None, refused_spend=bool(int(raw[4])))


# -- groups several scripts share ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunKeys(Group):
    """The keys of a run's step (flush_run's first six; end_run's and record_tool's too)."""

    lease: str = key("lease")
    task: str = key("task hash")
    conversation: str = key("conversation")
    ui_messages: str = key("UI messages")
    live: str = key("tree live hash")
    events: str = key("tree events")


@dataclass(frozen=True, kw_only=True)
class OutboxKeys(Group):
    """A tree's outbox (outbox_add's KEYS), in every step that can cause an event (coordinator/outbound.py)."""

    hooks: str = key("the tree's hooks hash")
    outbox: str = key("the tree's outbox hash")
    pending: str = key("the pending deliveries of every tree")


# -- argument tuples: a tail's items, built by name and laid out flat by `pack` ---------------------


class UsageArgs(NamedTuple):
    """Each response's usage (or a tool call's price), as flush_run reads it: 7 values."""

    request_key: str
    tokens_in: int
    tokens_out: int
    cache_reads: int
    cache_writes: int
    cost_micros: int
    cost_source: str

    @classmethod
    def of(cls, request_key: str, usage: Usage, cost_micros: int, cost_source: str) -> UsageArgs:
        return cls(
            request_key=request_key, tokens_in=usage.tokens_in, tokens_out=usage.tokens_out,
            cache_reads=usage.cache_reads, cache_writes=usage.cache_writes, cost_micros=cost_micros,
            cost_source=cost_source,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StepWrites(Group):
    """What a run did since its last step (flush_run's ARGV from its seventh; end_run's from its 32nd, or its 21st
    with fair shares off)."""

    live: str = arg("live status JSON, or ''")
    n_conversation: int = count("how many conversation messages", of="conversation")
    n_ui: int = count("how many UI messages", of="ui_messages")
    n_usage: int = count("how many usage records", of="usage")
    conversation: Sequence[str] = args("the conversation messages")
    ui_messages: Sequence[str] = args("then the UI messages")
    usage: Sequence[UsageArgs] = args(
        "then 7 values per usage record (request key, tokens in, tokens out, cache reads, cache writes, "
        "cost micro-USD, cost source)"
    )
    marks: Sequence[Mark] = args(
        "then, to the end, 2 per timeline mark the run took between steps (t ms, state: coordinator/timeline.py)"
    )


# -- the scripts ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AuditAdd(
    Flag,
    script="audit_add",
    returns="1 when the entry was added, 0 when this very entry had been added before, 2 when a refusal was "
    "counted and not logged (its actor's minute was full).",
):
    stream: str = key("the audit stream")
    refused: str = key("the refused requests' counts by reason")
    mark: str = key("this entry's mark")
    window: str = key("the count of its actor's refusals put on the log this minute (a refusal's)")
    mark_s: int = arg("how long the mark is kept, seconds")
    max_entries: int = arg("the most entries kept")
    oldest_kept: str = arg("the oldest entry id kept (`<ms>-0`)")
    reason: str = arg("the refusal's reason ('' for an entry that is not a refusal)")
    logged_per_min: int = arg("the most refusals of one actor put on the log a minute")
    fields: Sequence[tuple[str, str]] = args("the entry's fields and values")


@dataclass(frozen=True, kw_only=True)
class DeadLetterAdd(
    Flag,
    script="dead_letter_add",
    returns="1 when the entry was kept, 0 when the same message is on the list already.",
):
    letters: str = key("the dead-letter list")
    marks: str = key("the marks of the messages on it (a zset: the message's digest, scored in the order kept)")
    entry: str = arg("the entry (JSON)")
    digest: str = arg("the message's digest (its delivery tag, task id and body; else its raw text)")
    max_entries: int = arg("the most entries kept")


@dataclass(frozen=True, kw_only=True)
class Admit(
    Call[None],
    script="admit",
    standalone=False,
    returns="{'run', 0}, {'wait', 0} (queued in the admission list), or {'delay', ms, the start reserved (ms)}.",
):
    running: str = key("the tree's running set")
    parent_running: str = key("the parent's running-children set")
    admission: str = key("the tree's admission list")
    last_start: str = key("the tree's last-start time")
    task_id: str = arg("task id")
    per_parent: int = arg("per-parent limit (0: none)")
    per_tree: int = arg("per-tree limit (0: none)")
    stagger_ms: int = arg("stagger ms (0: none)")
    now_ms: int = arg("now ms")
    retention_s: int = arg("retention seconds")
    reserved_ms: int = arg("the start this task's delayed start reserved (ms; 0: none)")


@dataclass(frozen=True, kw_only=True)
class ApplyChildren(
    Call[int],
    script="apply_children",
    acknowledged=True,
    returns="how many were applied now.",
):
    parent: str = key("parent hash")
    todos: str = key("parent todos (hash: item id -> JSON, order -> ids)")
    awaiting: str = key("parent awaiting set")
    events: str = key("tree events stream")
    lines: str = key("batch lines (hash: child id -> line)")
    children: Sequence[str] = keys("child hashes")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    child_ids: Sequence[str] = args("child ids, in the order of their hashes in KEYS")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class FinishBatch(
    Call[None],
    script="finish_batch",
    standalone=False,
    returns="the parent's resume count when closed now (the caller then resumes the parent under that number, "
    "so a resume is published once), 0 when closed before.",
):
    batch: str = key("batch hash")
    parent: str = key("parent hash")
    parent_ui: str = key("parent UI messages")
    awaiting: str = key("parent awaiting set")
    events: str = key("tree events stream")
    result: str = arg("combined result text")
    ui_message: str = arg("UI message JSON")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    closer: str = arg("the child that completed it")


@dataclass(frozen=True, kw_only=True)
class CloseBatch(
    Call[BatchClosed],
    script="close_batch",
    uses=("finish_batch",),
    acknowledged=True,
    returns="{resumes, resume}: the parent's resume count when closed now (0: closed before) and 1 when the "
    "caller must publish the parent's resumed run, 2 when it must end the parent (a submission's root).",
):
    batch: str = key("batch hash")
    parent: str = key("parent hash")
    parent_ui: str = key("parent UI messages")
    awaiting: str = key("parent awaiting set")
    events: str = key("tree events stream")
    lines: str = key("batch lines")
    due: str = key("the due list")
    todos: str = key("parent todos")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    resume_grace_s: float = arg("resume grace seconds")

    @classmethod
    def decode(cls, raw: Any) -> BatchClosed:
        return BatchClosed(resumes=int(raw[0]), resume=int(raw[1]))


@dataclass(frozen=True, kw_only=True)
class Decide(
    Call[Decided],
    script="decide",
    uses=("outbox_add",),
    acknowledged=True,
    returns="{outcome, reason id}: outcome 'resume' when this decision (or this very decision sent again after it "
    "ran) ended its task's wait and no run holds the task's lease: its caller publishes the resume, claimed for "
    "the reason id (the first approval of the park this decision ended: read here, as a later park of the task "
    "may list others by the time the caller claims); 'ok' when it was decided otherwise; 'stopped' for a person's "
    "decision on a call whose task has ended (a stop whose expiry of its calls has not come yet): the call expires "
    "now, as the stop's expiry would, and the decision is refused; 'late', nothing written, for an approval made at "
    "or after the approval's deadline (its caller expires it); or the approval's status when it was not pending "
    "(or 'missing'). The reason id is '' but for 'resume'.",
):
    approval: str = key("the approval hash")
    pending: str = key("the pending-approvals zset")
    events: str = key("tree events stream")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side})")
    due: str = key("the due list")
    approval_id: str = arg("approval id")
    status: str = arg("new status (approved|denied|expired)")
    feedback: str = arg("feedback")
    now: float = arg("now")
    events_maxlen: int = arg("events max length")
    task_prefix: str = arg("the prefix of the tree's task hashes")
    approval_prefix: str = arg(
        "the prefix of its approval hashes (the task's hash and its other approvals are named from the "
        "approval's record, as start_run reads ancestors: a tree's keys share one prefix)"
    )
    decided_by: str = arg("who decided: the API key's name ('' for an expiry), written with the decision")
    retention_s: int = arg("retention seconds")
    lease_prefix: str = arg("the prefix of the tree's leases (named from the approval's record, as the task's hash)")
    look_at: float = arg("when the reconciler looks at the task whose wait this decision ends (epoch s)")
    withdraw: str | None = arg(
        "'1': a withdrawal, the expiry of a call whose run stopped before it asked for all its calls: it ends no "
        "task's wait (the task is its newer run's, or the reconciler's)",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> Decided:
        return Decided(outcome=str(raw[0]), reason_id=str(raw[1]))


@dataclass(frozen=True, kw_only=True)
class EndpointFailed(
    Call[EndpointState],
    script="endpoint_failed",
    returns="{ms until the endpoint may be tried again, failures in a row}.",
):
    endpoint: str = key("the hash of the endpoint's view the error marks (its host's, or a model's)")
    now_ms: int = arg("now ms")
    base_ms: int = arg("backoff base ms")
    cap_ms: int = arg("backoff cap ms")
    jitter: float = arg("jitter, in [0, 1)")
    asked_ms: int = arg("the wait the provider asked for (Retry-After, retry-after-ms), ms; -1: none")
    error: str = arg("the error line")
    keep_ms: int = arg("how long the hash outlives the endpoint's wait, ms")

    @classmethod
    def decode(cls, raw: Any) -> EndpointState:
        return EndpointState(wait_ms=int(raw[0]), failures=int(raw[1]))


@dataclass(frozen=True, kw_only=True)
class EndpointRecovered(
    Call[list[str]],
    script="endpoint_recovered",
    returns="the ids of the tasks parked on those views: none when no view was down.",
):
    mark: str = key("this call's mark")
    n_keys: int = count("how many keys follow the mark", of="views")
    mark_s: int = arg("how long the mark is kept, seconds")
    views: Sequence[str] = keys(
        "each view's hash (its host's, then a model's), then each view's parked tasks, in that order"
    )

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class EndpointGate(
    Call[EndpointState],
    script="endpoint_gate",
    returns="{wait ms (0: send it now), failures in a row, the last error line, the view ('host', 'model'; '': up)}.",
):
    endpoint: str = key("the endpoint host's hash")
    model: str = key("the hash of the model's view of the endpoint")
    now_ms: int = arg("now ms")
    token: str = arg("the asking run's token")
    probe_lease_ms: int = arg("the probe's lease ms")
    recheck_ms: int = arg("how long to wait, at most, before asking again while another run's probe is out (ms)")

    @classmethod
    def decode(cls, raw: Any) -> EndpointState:
        return EndpointState(wait_ms=int(raw[0]), failures=int(raw[1]), error=str(raw[2]), view=str(raw[3]))


@dataclass(frozen=True, kw_only=True)
class FairKeys(Group):
    """The fleet-wide keys of fair shares between tenants (coordinator/admission.py): start_run's, end_run's and
    fair_release's."""

    wanting: str = key("the tenants that want a slot")
    policies: str = key("the tenants' policies")
    holding: str = key("the runs holding a slot, fleet-wide")
    capacity: str = key("the fleet's capacity")


@dataclass(frozen=True, kw_only=True)
class FairArgs(Group):
    """How fair shares between tenants are read (the tenant keys' names, the bounds): start_run's, end_run's and
    fair_release's, after their own."""

    on: int = arg("1: fair shares between tenants are on (nothing below is read when 0)")
    tenant_head: str = arg("a tenant key's head (the keys module's name up to the tenant)")
    running_tail: str = arg("the tail of a tenant's running set")
    parked_tail: str = arg("the tail of its parked runs")
    queued_tail: str = arg("the tail of its announced runs")
    task_head: str = arg("a task hash key's head (up to the root id)")
    task_middle: str = arg("its middle (between the root id and the task id)")
    queued_ms: int = arg("how long an announced run counts as queued, ms")
    capacity: int = arg("the fleet's capacity while no heartbeat has counted it (this worker's concurrency)")
    fill: int = arg("how many parked runs one freed slot may give a slot (more when the fleet grew)")
    default_tenant: str = arg("the tenant of a record without one")
    default_priority: int = arg("the priority of a record without one")


# How many keys and arguments fair shares splice in (a start with them off leaves all but `on` off).
_FAIR_KEYS = dataclasses.fields(FairKeys)
_FAIR_ARGS = dataclasses.fields(FairArgs)


@dataclass(frozen=True, kw_only=True)
class FairAdmit(
    Call[None],
    script="fair_admit",
    standalone=False,
    uses=("fair_score", "fair_take"),
    returns="{'run', ''} (it holds a slot of its tenant) or {'wait', reason, the task id given the slot or ''}.",
):
    wanting: str = key("the tenants that want a slot")
    policies: str = key("the tenants' policies")
    holding: str = key("the runs holding a slot, fleet-wide")
    capacity_key: str = key("the fleet's capacity")
    task_id: str = arg("task id")
    tenant: str = arg("its tenant")
    priority: int = arg("its priority")
    now_ms: int = arg("now ms")
    tenant_head: str = arg("a tenant key's head")
    running_tail: str = arg("the tail of a tenant's running set")
    parked_tail: str = arg("the tail of its parked runs")
    queued_tail: str = arg("the tail of its announced runs")
    queued_ms: int = arg("how long an announced run counts as queued, ms")
    capacity: int = arg("the fleet's capacity while no heartbeat has counted it (this worker's concurrency)")
    retention_s: int = arg("retention seconds")
    task_head: str = arg("a task hash key's head")
    task_middle: str = arg("its middle")


@dataclass(frozen=True, kw_only=True)
class FairAnnounce(
    Call[None],
    script="fair_announce",
    uses=("fair_score",),
    returns="nothing.",
):
    wanting: str = key("the tenants that want a slot")
    policies: str = key("the tenants' policies")
    running: str = key("the tenant's running set")
    parked: str = key("its parked runs")
    queued: str = key("its announced runs")
    tenant: str = arg("the tenant")
    now_ms: int = arg("now ms")
    queued_ms: int = arg("how long an announced run counts as queued, ms")
    retention_s: int = arg("retention seconds")
    task_ids: Sequence[str] = args("the runs published now")

    @classmethod
    def decode(cls, raw: Any) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class FairBeat(Call[int], script="fair_beat", returns="the fleet's capacity."):
    workers: str = key("the worker processes by their last heartbeat")
    slots: str = key("each process's concurrency")
    capacity: str = key("the fleet's capacity")
    policies: str = key("the tenants' policies")
    worker: str = arg("this process")
    concurrency: int = arg("its concurrency")
    live_since: float = arg("the oldest heartbeat that is still live (epoch s)")
    capacity_ttl_s: int = arg("how long the capacity stands without a beat, seconds")
    table: Sequence[tuple[str, str]] = args("then 2 per tenant (name, 'weight max_running'), `*` among them")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class FairRelease(
    Call[list[str]],
    script="fair_release",
    uses=("fair_score", "fair_take"),
    returns="the ids given a slot (the caller publishes their runs; by this very call, when it is sent again).",
):
    fair: FairKeys = splice("the fleet-wide keys of fair shares", expand=True)
    task_id: str = arg("task id")
    now_ms: int = arg("now ms")
    retention_s: int = arg("retention seconds")
    args: FairArgs = splice("how fair shares are read", expand=True)
    call: str = arg(
        "this call's own token, kept with what it gave: only its resend carries it again (none from end_run, whose "
        "`end_reply` answers its resend)"
    )
    while_run: str = arg(
        "the token of the run that frees its slot: only while it is the task's last start (its `run_token`); "
        "nothing freed nor given otherwise ('': whichever run)"
    )
    while_status: str = arg(
        "only while the task's status is one of these, space-separated ('': whatever it is): nothing freed nor "
        "given otherwise"
    )
    while_asked: str | None = arg(
        "the prefix of the run's tree's approval hashes: only while one of the calls its task waits on is still "
        "pending: nothing freed nor given otherwise",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class FairWithdraw(
    Call[list[str]],
    script="fair_withdraw",
    uses=("fair_score", "fair_take", "fair_release"),
    returns="the ids given a slot (fair_release's: the caller publishes their runs).",
):
    fair: FairKeys = splice("the fleet-wide keys of fair shares", expand=True)
    tenant: str = arg("the tenant")
    now_ms: int = arg("now ms")
    retention_s: int = arg("retention seconds")
    shares: FairArgs = splice("how fair shares are read", expand=True)
    call: str = arg("this call's own token, kept with what it gave on the first run's task: only its resend carries it")
    task_ids: Sequence[str] = args("the runs stopped")

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class FairHeal(
    Call[FairHealed],
    script="fair_heal",
    uses=("fair_score", "fair_take"),
    returns="{the runs whose slot was freed, the runs to publish again}.",
):
    fair: FairKeys = splice("the fleet-wide keys of fair shares", expand=True)
    due: str = key("the due list")
    mark: str = key("this call's mark: what it answered, kept for the same call sent again (its reply lost)")
    now_ms: int = arg("now ms")
    look_at: float = arg("when the reconciler looks at a released run (epoch s)")
    limit: int = arg("how many parked runs one call releases while fair shares are off")
    retention_s: int = arg("retention seconds")
    args: FairArgs = splice("how fair shares are read", expand=True)
    lease_middle: str = arg("a lease key's middle (between the root id and the task id; its head is a task's)")
    mark_s: int = arg("how long the mark is kept, seconds")

    @classmethod
    def decode(cls, raw: Any) -> FairHealed:
        return FairHealed(freed=_strs(raw[0]), started=_strs(raw[1]))


@dataclass(frozen=True, kw_only=True)
class FairScore(
    Call[None],
    script="fair_score",
    standalone=False,
    returns="its score now (a number, or '+inf'), or false when it wants nothing.",
):
    wanting: str = key("the tenants that want a slot (zset)")
    policies: str = key("the tenants' policies (hash)")
    running: str = key("the tenant's running set")
    parked: str = key("its parked runs")
    queued: str = key("its runs announced in the broker's queue")
    tenant: str = arg("tenant")
    now_ms: int = arg("now ms")
    queued_ms: int = arg("how long an announced run counts as queued, ms")


@dataclass(frozen=True, kw_only=True)
class FairTake(
    Call[None],
    script="fair_take",
    standalone=False,
    uses=("fair_score",),
    returns="the task id given the slot, or false.",
):
    wanting: str = key("the tenants that want a slot")
    policies: str = key("the tenants' policies")
    holding: str = key("the runs holding a slot, fleet-wide (hash: task id -> tenant)")
    tenant_head: str = arg("a tenant key's head (the keys module's name up to the tenant)")
    running_tail: str = arg("the tail of a tenant's running set")
    parked_tail: str = arg("the tail of its parked runs")
    queued_tail: str = arg("the tail of its announced runs")
    now_ms: int = arg("now ms")
    queued_ms: int = arg("how long an announced run counts as queued, ms")
    retention_s: int = arg("retention seconds")
    task_head: str = arg("a task hash key's head (up to the root id)")
    task_middle: str = arg("its middle (between the root id and the task id)")
    own_tenant: str | None = arg(
        "take from this tenant's parked runs alone, not the neediest tenant's (fair_admit.lua: an arrival of a"
        " tenant whose parked runs come before it)",
        optional=True,
    )
    before: float | None = arg("with ARGV[10], only a parked run whose place is before this score", optional=True)


@dataclass(frozen=True, kw_only=True)
class FinishTask(
    Call[str | None],
    script="finish_task",
    uses=("outbox_add",),
    acknowledged=True,
    returns="the task's status after the call (the earlier one if it was already terminal), or false when the "
    "task does not exist.",
):
    task: str = key("task hash")
    events: str = key("tree events stream")
    live: str = key("tree live hash")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side})")
    status: str = arg("status (completed|failed|cancelled)")
    summary: str = arg("summary")
    error: str = arg("error")
    error_class: str = arg("error class")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    live_status: str | None = arg(
        "the terminal live status JSON (state: the status above, ts: now), written as it is (without it, the "
        "stored one is read and made terminal)",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> str | None:
        return None if raw is None else str(raw)


@dataclass(frozen=True, kw_only=True)
class FlushRun(
    Call[Stepped],
    script="flush_run",
    uses=("outbox_add", "record_usage"),
    returns="{1, status, exhausted, resent, refused} (status '' when called by end_run; resent 1 when this was the "
    "same step again, nothing written twice; refused 1 when its task had ended and its usage records were not "
    "written: the run records them by record_late_spend), or {0} when the lease is not this run's (nothing "
    "written).",
):
    run: RunKeys = splice("the run's keys", expand=True)
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side}: a budget warning, record_usage)")
    ancestors: Sequence[str] = keys("ancestor hashes (parent first, root last)")
    token: str = arg("token")
    retention_s: int = arg("retention seconds")
    now: float = arg("now")
    events_maxlen: int = arg("events max length")
    by_end_run: int = arg(
        "1 when end_run calls it: the task's status is not read back, and the task hash's retention is left "
        "to the end (it refreshes each key it writes once)"
    )
    budget_warn_at: float = arg("the share of a budget whose crossing sends `budget.warning` (record_usage)")
    writes: StepWrites = splice("what the run did since its last step", expand=True)

    @classmethod
    def decode(cls, raw: Any) -> Stepped:
        return _stepped(raw)


@dataclass(frozen=True, kw_only=True)
class EndRun(
    Call[Ending],
    script="end_run",
    uses=(
        "outbox_add",
        "record_usage",
        "flush_run",
        "finish_task",
        "apply_children",
        "finish_batch",
        "close_batch",
        "settle_child",
        "release_slot",
        "fair_score",
        "fair_take",
        "fair_release",
    ),
    acknowledged=True,
    returns="{'fenced'} (nothing written), {'exhausted', holder, refused} (the flush was written; the caller "
    "stops the holder's subtree and ends the run again), or {'ended', status, summary, error, error class, tokens "
    "in, tokens out, cache reads, cache writes, cost micro-USD, closed, resumes, resume, batch mode, admitted "
    "ids, refused}: `closed` 1 when this call closed the batch, `resume` 1 when the caller must publish the "
    "parent's resume (2: end the parent, a submission's root), `batch mode` 'sequential' when the caller must write the chain step back itself, "
    "`admitted ids` the waiting tasks given the freed slot, whose runs the caller publishes, `refused` 1 when "
    "the task had ended before and the run's usage records were not written (flush_run's). The same end sent "
    "again after it ran answers as it did, and writes nothing.",
):
    run: RunKeys = splice("as flush_run (lease, task, conversation, UI, live, events)")
    due: str = key("the due list")
    parent: str = key("parent hash")
    todos: str = key("parent todos")
    awaiting: str = key("parent awaiting set")
    batch: str = key("batch hash")
    parent_ui: str = key("parent UI messages")
    lines: str = key("batch lines")
    running: str = key("the tree's running set")
    admission: str = key("its admission list")
    parent_running: str = key("the parent's running-children set")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side})")
    fair: FairKeys = splice("the fleet-wide keys of fair shares (fair_release's)")
    ancestors: Sequence[str] = keys("ancestor hashes (parent first, root last)")
    token: str = arg("token")
    retention_s: int = arg("retention seconds")
    now: float = arg("now")
    events_maxlen: int = arg("events max length")
    status: str = arg("status")
    summary: str = arg("summary")
    error: str = arg("error")
    error_class: str = arg("error class")
    resume_grace_s: float = arg("resume grace seconds")
    stop_on_budget: int = arg("1: end on the budget check (a run that completed)")
    free_slot: int = arg("1: free a run slot (admission limits set, a child)")
    per_parent: int = arg("per-parent limit")
    per_tree: int = arg("per-tree limit")
    task_prefix: str = arg("the prefix of the tree's task hashes")
    running_children_prefix: str = arg("the prefix of its running-children sets")
    admission_scan: int = arg("how many waiting tasks to look at")
    kept: str = arg(
        "what the end keeps beyond its text, written with the status: a completed typed task's data, compact JSON, "
        "as its `output`; an unsuccessful end's raw error body as its `error_detail` ('' for none)"
    )
    invalid_outputs: int = arg("its model's answers that broke its output schema (kept on the record when above 0)")
    budget_warn_at: float = arg("the share of a budget whose crossing sends `budget.warning` (record_usage)")
    fair_args: FairArgs = splice("how fair shares are read (fair_release's, after its own three)")
    writes: StepWrites = splice("flush_run's ARGV from its seventh (what the run did since its last step)")

    # Where fair shares' keys and, after their `on`, the rest of their arguments lie: KEYS[20..23], ARGV[21..31].
    _FAIR_KEYS_AT: ClassVar[int] = 19
    _FAIR_REST_AT: ClassVar[int] = 20

    def pack(self) -> tuple[list[str], list[ScriptArg]]:
        """As declared, but with fair shares off only their `on` (0) is sent, not their keys nor the rest of their
        arguments: end_run.lua then finds the ancestors at KEYS[20..] and flush_run's ARGV from ARGV[21]
        (each key or argument costs the server about 1 K instructions a call, bench/script_cost.py)."""
        out_keys, out_args = super().pack()
        if not self.fair_args.on:
            del out_keys[self._FAIR_KEYS_AT : self._FAIR_KEYS_AT + len(_FAIR_KEYS)]
            del out_args[self._FAIR_REST_AT : self._FAIR_REST_AT + len(_FAIR_ARGS) - 1]
        return out_keys, out_args

    @classmethod
    def decode(cls, raw: Any) -> Ending:
        if raw[0] == "exhausted":
            return Ending("exhausted", holder=str(raw[1]), refused_spend=bool(int(raw[2])))
        if raw[0] != "ended":
            return Ending(str(raw[0]))
        (_, status, summary, error, error_class, t_in, t_out, c_reads, c_writes, cost, closed, resumes, resume,
         mode, admitted_ids, refused) = raw  # fmt: skip
        return Ending(
            "ended", status=str(status), summary=str(summary), error=str(error), error_class=str(error_class),
            usage=Usage(tokens_in=int(t_in), tokens_out=int(t_out), cache_reads=int(c_reads), cache_writes=int(c_writes)),
            cost_micros=int(cost), closed=bool(int(closed)), resumes=int(resumes), resume=int(resume),
            batch_mode=str(mode), admitted=_strs(admitted_ids), refused_spend=bool(int(refused)),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Lead(Flag, script="lead", returns="1 when the candidate leads now, 0 when another does."):
    lease: str = key("the lease")
    candidate: str = arg("this candidate's id")
    lease_ms: int = arg("the lease time, ms")


@dataclass(frozen=True, kw_only=True)
class MarkTimeline(
    Flag,
    script="mark_timeline",
    returns="1 when marked, 0 when the mark changed nothing (the state it has, or after an outcome).",
):
    task: str = key("task hash")
    now: float = arg("now, epoch seconds")
    state: str = arg("the state marked (coordinator/timeline.py)")


@dataclass(frozen=True, kw_only=True)
class RateLimit(
    Call[int],
    script="rate_limit",
    returns="0 when the request may start now (it is counted), else the ms to wait.",
):
    requests: str = key("the provider's request-times zset")
    rpm: int = arg("limit per minute")
    now_ms: int = arg("now ms")
    member: str = arg("a unique member for this request")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class RecordTool(
    Call[Stepped],
    script="record_tool",
    uses=("outbox_add", "record_usage", "flush_run"),
    returns="flush_run's reply: {1, status, exhausted, resent, refused}, or {0} when the lease is not this run's (nothing "
    "written: another run owns the task and answers the call itself).",
):
    results: str = key("the task's tool-results hash")
    tool_call_id: str = arg("tool call id")
    result: str = arg("the result (JSON) to keep, or '' for a call answered without running (kept empty)")
    outcome_field: str = arg("the counter field of the outcome (`tool:<tool>:<outcome>`)")
    ms_field: str = arg("the time field (`tool:<tool>:ms`)")
    ms: int = arg("the call's ms (0: not added)")
    flush: FlushRun = splice("flush_run's {side}")

    @classmethod
    def decode(cls, raw: Any) -> Stepped:
        return _stepped(raw)


@dataclass(frozen=True, kw_only=True)
class RecordUsage(
    Call[UsageRecorded],
    script="record_usage",
    uses=("outbox_add",),
    returns="{recorded, exhausted}: recorded is 1, 0 (this request was recorded before) or -1 (the task has "
    "ended, e.g. was cancelled, and ARGV[12] is not '1': a step refuses spend after a stop, and its run records it "
    "by record_late_spend); exhausted is the id of the topmost task (nearest the root) whose budget the subtree "
    "total has reached, or ''.",
):
    task: str = key(
        "task hash (its `usage_keys` field lists the request keys already recorded, space-separated: read and "
        "written with the figures, no key of its own)"
    )
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side}: a budget warning)")
    ancestors: Sequence[str] = keys("ancestor task hashes (parent first, root last)")
    request_key: str = arg(
        "request key (unique per request of the task, no spaces; `tool:<call id, URL-quoted>` for a tool call's price, "
        "which is spend but no model request: it counts no request and keeps the source)"
    )
    tokens_in: int = arg("tokens in")
    tokens_out: int = arg("tokens out")
    cache_reads: int = arg("cache reads")
    cache_writes: int = arg("cache writes")
    cost_micros: int = arg("cost micro-USD")
    cost_source: str = arg("cost source")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    budget_warn_at: float = arg(
        "the share of a budget (0 < share < 1) whose crossing sends the budgeted task's `budget.warning`, once: "
        "its `budget_warned` field keeps the shares warned"
    )
    refresh_task: str | None = arg(
        "'0': leave the task hash's retention to the caller (end_run refreshes it once)", optional=True
    )
    late: str | None = arg(
        "'1': a response its run had before its task was stopped, recorded after the stop (record_late_spend)",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> UsageRecorded:
        return UsageRecorded(recorded=int(raw[0]), exhausted=str(raw[1]) or None)


@dataclass(frozen=True, kw_only=True)
class RecordLateSpend(
    Call[LateSpendRecorded],
    script="record_late_spend",
    uses=("outbox_add", "record_usage"),
    returns="{recorded, exhausted}: how many of the records were recorded now (a record recorded before is not "
    "counted again), and the id of the topmost task (nearest the root) whose budget its subtree has reached once "
    "they were, '' when none was recorded now or none is reached (its caller stops that subtree unless it has "
    "ended, as a step's caller does).",
):
    task: str = key("task hash (stopped since its run's last step, or one whose step Redis failed)")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side}: a budget warning, record_usage)")
    ancestors: Sequence[str] = keys("ancestor hashes (parent first, root last)")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    budget_warn_at: float = arg("the share of a budget whose crossing sends `budget.warning` (record_usage)")
    todos_prefix: str = arg("the prefix of the tree's todo lists")
    lines_prefix: str = arg("the prefix of the tree's batch lines")
    clears_mark: int = arg(
        "1: the spend a step refused for a stop, whose mark (`late_spend_at`) this call clears; 0: spend its worker "
        "kept when Redis failed a step (the heartbeat's), which leaves the mark to the run that set it"
    )
    usage: Sequence[UsageArgs] = args(
        "7 values per usage record (request key, tokens in, tokens out, cache reads, cache writes, cost "
        "micro-USD, cost source)"
    )

    @classmethod
    def decode(cls, raw: Any) -> LateSpendRecorded:
        return LateSpendRecorded(recorded=int(raw[0]), exhausted=str(raw[1]) or None)


@dataclass(frozen=True, kw_only=True)
class ClaimResume(
    Call[int],
    script="claim_resume",
    returns="the resume count the caller publishes the task's resumed run under, 0 when another claimed it.",
):
    task: str = key("task hash")
    field: str = arg("the claim's field (`resumed:<reason id>`)")
    token: str = arg("this claim's token")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class SaveApproval(
    Call[str],
    script="save_approval",
    uses=("outbox_add",),
    returns="1 when saved, 0 when it was saved before, -1 when its task has ended, -2 when the lease is not the "
    "run's (nothing written).",
):
    approval: str = key("the approval hash")
    pending: str = key("the pending-approvals zset")
    task: str = key("the task hash of the run whose call waits")
    lease: str = key("its lease")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side})")
    approval_id: str = arg("approval id")
    created_at: float = arg("created at: the event's time and the pending list's score")
    retention_s: int = arg("retention seconds")
    task_id: str = arg("the task whose tool call waits")
    event_fields: str = arg("the event's own fields, a JSON object")
    token: str = arg("the token of the run that parks the call, which must hold the lease ('' for a save of no run's)")
    record: Sequence[str] = args("the record's fields and values, in pairs")

    @classmethod
    def decode(cls, raw: Any) -> str:
        """'saved', 'before' (saved before: this very save sent again), 'ended' (its task has ended: its run was
        stopped before its call was saved) or 'fenced' (its run lost the lease: it stalled past its lapse, and a
        newer run of the task may have started)."""
        return {1: "saved", 0: "before", -1: "ended"}.get(int(raw), "fenced")


@dataclass(frozen=True, kw_only=True)
class SetWaitingApprovals(
    Flag,
    script="set_waiting_approvals",
    returns="1 when written, 0 when the lease is not the run's (nothing written).",
):
    lease: str = key("the task's lease")
    task: str = key("its task hash")
    token: str = arg("the token of the run that parked the calls ('' for a park of no run's)")
    approval_ids: str = arg("the approvals it parked, a JSON list")


@dataclass(frozen=True, kw_only=True)
class ReleaseLease(
    Flag,
    script="release_lease",
    returns="1 when released, or gone while this run is still the task's last (its lease lapsed, or this very "
    "call ran before: its own resend); 0 when another run has started since.",
):
    lease: str = key("the task's lease")
    task: str = key("its task hash")
    due: str = key("the due list")
    token: str = arg("this run's token")
    reset_deliveries: int = arg(
        "1: also count the task's deliveries anew (a run handed back to the queue was not lost: "
        "SUBQ_MAX_DELIVERIES counts losses), in this same step: a run that started since keeps its count"
    )
    unwatch: str = arg(
        "the task's id to take off the due list as the lease is freed (a provider's wait, which its timer ends), "
        "'' for none: never after a lease that lapsed, when its timer may have published it since"
    )


@dataclass(frozen=True, kw_only=True)
class ReleaseSlot(
    Call[list[str]],
    script="release_slot",
    returns="the ids admitted now (removed from the list, added to the running sets; by this very call, when it "
    "is sent again).",
):
    running: str = key("the tree's running set")
    admission: str = key("the tree's admission list")
    parent_running: str = key("the task's parent's running-children set")
    task_id: str = arg("task id")
    per_parent: int = arg("per-parent limit")
    per_tree: int = arg("per-tree limit")
    retention_s: int = arg("retention seconds")
    task_prefix: str = arg("the prefix of the tree's task hashes")
    running_children_prefix: str = arg("the prefix of its running-children sets")
    admission_scan: int = arg("how many waiting tasks to look at, from the list's head")
    now: float = arg("now (epoch s)")
    while_status: str = arg(
        "only while the task's status is one of these, space-separated ('': whatever it is): nothing freed nor "
        "admitted otherwise"
    )
    while_run: str = arg(
        "the token of the run that frees its slots: only while it is the task's last start (its `run_token`); "
        "nothing freed nor admitted otherwise ('': whichever run)"
    )
    while_asked: str | None = arg(
        "the prefix of the tree's approval hashes: only while one of the calls the task waits on is still pending: "
        "nothing freed nor admitted otherwise",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class RenewLeases(
    Call[list[int]],
    script="renew_leases",
    returns="the indexes (1-based) of the leases that were lost: lapsed, or taken by another.",
):
    leases: Sequence[str] = keys("the leases")
    lease_ms: int = arg("the lease time, ms")
    tokens: Sequence[str] = args("the holder's token of each lease, in the order of KEYS")

    @classmethod
    def decode(cls, raw: Any) -> list[int]:
        return [int(i) for i in raw]


class RetryTaskKeys(NamedTuple):
    """A task a retry touches: 4 keys."""

    task: str
    ui_messages: str
    lease: str
    conversation: str


class RetryBatchKeys(NamedTuple):
    """A batch a retry re-opens: 5 keys."""

    batch: str
    lines: str
    parent: str
    awaiting: str
    todos: str


class RetryTaskArgs(NamedTuple):
    """A task to retry: 5 values."""

    task_id: str
    role: str  # 'run' or 'wait'
    batch_index: int  # the index (1-based) of the batch its slot is in (0: none)
    keep: int  # for 'wait', how many conversation messages to keep (else 0)
    length: int  # for 'wait', how many it must have now (else 0)


class RetryBatchArgs(NamedTuple):
    """A batch a retry re-opens: 3 values."""

    batch_id: str
    state: str  # 'open' or 'closed'
    parent_id: str


@dataclass(frozen=True, kw_only=True)
class Retry(
    Call[list[int] | RetryRefused],
    script="retry",
    acknowledged=True,
    returns="{'retried', {retry count of each task, in order}} (also to this very retry sent again after it "
    "ran) or {'refused', id, why, detail}: why is 'missing', 'status' (detail: the status), 'caller', 'budget' "
    "(detail: the error), 'leased', 'batch' (detail: the batch's status), 'parent' (id: an open batch's parent, "
    "detail: its status, not 'delegated'), 'chain' or 'conversation' (it changed).",
):
    due: str = key("the due list")
    live: str = key("tree live hash")
    events: str = key("tree events stream")
    task_keys: Sequence[RetryTaskKeys] = keys(
        "4 keys per task: task hash, its UI messages, its lease, its conversation"
    )
    batch_keys: Sequence[RetryBatchKeys] = keys(
        "then 5 keys per batch: batch hash, batch lines, parent hash, parent awaiting set, parent todos"
    )
    now: float = arg("now (epoch s)")
    look_at: float = arg("when the reconciler looks at the first task to run (epoch s)")
    pace_s: float = arg("s: each task to run after it is looked at this much later than the one before it")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    n_tasks: int = count("number of tasks", of="tasks")
    n_batches: int = count("number of batches", of="batches")
    tasks: Sequence[RetryTaskArgs] = args(
        "5 per task: id, 'run' or 'wait', the index (1-based) of the batch its slot is in (0: none), for "
        "'wait' how many conversation messages to keep and how many it must have now (else 0, 0)"
    )
    batches: Sequence[RetryBatchArgs] = args(
        "then 3 per batch: batch id, 'open' (still running: its slot is re-opened) or 'closed' (re-opened for "
        "its parent, a task to 'wait' here), the parent id"
    )

    @classmethod
    def decode(cls, raw: Any) -> list[int] | RetryRefused:
        if raw[0] == "refused":
            return RetryRefused(str(raw[1]), str(raw[2]), str(raw[3]))
        return [int(n) for n in raw[1]]


@dataclass(frozen=True, kw_only=True)
class SettleChild(
    Call[ChildSettled],
    script="settle_child",
    uses=("apply_children", "finish_batch", "close_batch"),
    acknowledged=True,
    returns="{mode, resumes, resume}: `resumes` the parent's resume count when this call closed the batch (0 "
    "otherwise), `resume` 1 when the caller must publish the parent's resumed run, 2 when it must end the parent "
    "(a submission's root).",
):
    parent: str = key("parent hash")
    todos: str = key("parent todos")
    awaiting: str = key("parent awaiting set")
    events: str = key("tree events stream")
    lines: str = key("batch lines")
    child: str = key("child hash")
    batch: str = key("batch hash")
    parent_ui: str = key("parent UI messages")
    due: str = key("the due list")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    child_id: str = arg("child id")
    resume_grace_s: float = arg("resume grace seconds")
    mode: str = arg("the batch's mode when the caller knows it ('' if not)")

    @classmethod
    def decode(cls, raw: Any) -> ChildSettled:
        return ChildSettled(mode=str(raw[0] or ""), resumes=int(raw[1]), resume=int(raw[2]))


@dataclass(frozen=True, kw_only=True)
class StartRun(
    Call[StartReply],
    script="start_run",
    uses=("admit", "fair_score", "fair_take", "fair_admit"),
    returns="{verdict, {deliveries, run sequence, exhausted}}: verdict 'run' (the lease is this run's; the same "
    "start sent again after it ran answers so too, from what it wrote), "
    "'missing', 'other' (not an agent's, ended or delegated: the caller takes its slow path), 'leased' (another "
    "run holds the lease), 'asked' (a call its run parked still waits for a person's decision), 'wait' (queued "
    "on the admission list for a slot), 'delay' (the counts are {ms to "
    "wait}) or 'park' (parked for a slot of its tenant; the counts are {0, why: 'max_running', 'share', "
    "'fleet' or 'order', the task id given the slot instead or ''}); a 'delay' or 'park' sent again answers as it did.",
):
    task: str = key("task hash")
    lease: str = key("lease")
    due: str = key("the due list")
    live: str = key("tree live hash")
    events: str = key("tree events stream")
    ui_messages: str = key("UI messages")
    running: str = key("the tree's running set")
    admission: str = key("the tree's admission list")
    last_start: str = key("its last-start time")
    fair: FairKeys = splice("the fleet-wide keys of fair shares", expand=True)
    token: str = arg("token")
    lease_s: int = arg("lease seconds")
    look_at: float = arg("when the reconciler looks next (epoch s)")
    now: float = arg("now")
    events_maxlen: int = arg("events max length")
    task_prefix: str = arg(
        "the prefix of the tree's task hashes (the budget check reads the ancestors' with a budget, "
        "`budget_chain`, or every ancestor's on a record without it: a tree's keys share one prefix, and subq "
        "runs on one Redis, so reading keys named in the task's own record is safe here)"
    )
    per_parent: int = arg("per-parent run limit")
    per_tree: int = arg("per-tree run limit")
    stagger_ms: int = arg("start stagger ms (0: none)")
    now_ms: int = arg("now in ms")
    retention_s: int = arg("retention seconds")
    running_children_prefix: str = arg(
        "the prefix of the tree's running-children sets (the parent's is read from the record, as the ancestors' above)"
    )
    approval_prefix: str = arg(
        "the prefix of the tree's approval hashes (those its record says it waits on, as the ancestors' above)"
    )
    fair_args: FairArgs = splice("how fair shares are read", expand=True)

    def pack(self) -> tuple[list[str], list[ScriptArg]]:
        """As declared, but with fair shares off only their `on` (0) is sent, not their keys nor the rest of their
        arguments: start_run.lua reads none of them then, and each key or argument costs the server about 1 K
        instructions a call (28 K of a start's 364 K, bench/script_cost.py)."""
        out_keys, out_args = super().pack()
        if self.fair_args.on:
            return out_keys, out_args
        return out_keys[: -len(_FAIR_KEYS)], out_args[: -len(_FAIR_ARGS) + 1]

    @classmethod
    def decode(cls, raw: Any) -> StartReply:
        verdict, counts = str(raw[0]), raw[1]
        if verdict == "run":
            deliveries, run_seq, exhausted = counts
            return StartReply(
                verdict, deliveries=int(deliveries), run_seq=int(run_seq), exhausted=str(exhausted) or None
            )
        if verdict == "park":
            return StartReply(verdict, parked_for=str(counts[1]), admitted=tuple(str(i) for i in counts[2:] if i))
        return StartReply(verdict, delay_ms=int(counts[0]) if verdict in ("wait", "delay") else 0)


@dataclass(frozen=True, kw_only=True)
class StopTasks(
    Call[list[str]],
    script="stop_tasks",
    uses=("outbox_add",),
    acknowledged=True,
    returns="the ids of the tasks stopped now (by this very call, when it is sent again), the top first.",
):
    events: str = key("tree events stream")
    live: str = key("tree live hash")
    outbox: OutboxKeys = splice("the tree's outbox (outbox_add's {side})")
    due: str = key("the due list")
    tasks: Sequence[str] = keys("task hashes (the subtree's top first)")
    top_status: str = arg("status of the top")
    status: str = arg("status of the rest")
    top_error: str = arg("error of the top")
    error: str = arg("error of the rest")
    top_class: str = arg("error class of the top")
    error_class: str = arg("error class of the rest")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")
    due_at: float = arg("when a task stopped now is due (epoch s; 0: not put on the due list)")

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class OutboxAdd(
    Call[int],
    script="outbox_add",
    returns="how many deliveries were written.",
):
    outbox: OutboxKeys = splice("the tree's outbox", expand=True)
    task_id: str = arg("the task id")
    event_type: str = arg("the event type; `task.<x>` of a task other than the root is `child.<x>`")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    fields: str = arg("the event's own fields, a JSON object ('' for none: an end's are read from its record)")
    record_of: str | None = arg(
        "an end's task hash (finish_task, stop_tasks; called from Lua alone): each delivery keeps the fields of "
        "the record an event reads (EVENT_FIELDS) as they are now, and every attempt sends them (read_claimed), "
        "not the record as it is then (a retry of the tree clears a failed task's error)",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class ClaimDeliveries(
    Call[list[str]],
    script="claim_deliveries",
    returns="the members claimed (`<root id> <delivery id>`), oldest first.",
):
    pending: str = key("the pending deliveries of every tree (member `<root id> <delivery id>`, score: due ms)")
    now_ms: int = arg("now ms")
    lease_ms: int = arg("how long a claim holds a delivery, ms: past it (its worker died) another takes it")
    limit: int = arg("the most to claim")

    @classmethod
    def decode(cls, raw: Any) -> list[str]:
        return _strs(raw)


@dataclass(frozen=True, kw_only=True)
class SettleDelivery(
    Call[str],
    script="settle_delivery",
    returns="the delivery's state after the call, or '' when it is gone (its tree expired).",
):
    outbox: OutboxKeys = splice("the tree's outbox", expand=True)
    counts: str = key("the attempts' outcomes counted by `<event type> <outcome>` (the metrics)")
    delivery_id: str = arg("the delivery id")
    member: str = arg("its member of the pending deliveries")
    state: str = arg(
        "pending (redeliver: due now, attempts from 0), retrying, delivered, gone (a 410: its subscription "
        "ends) or given_up"
    )
    next_at: float = arg("when to try again, epoch seconds (retrying)")
    last: str = arg("the attempt's answer, one line ('' for none)")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    attempts: int = arg("the attempts the delivery had when claimed (-1: whatever it has)")

    @classmethod
    def decode(cls, raw: Any) -> str:
        return str(raw or "")


class DeliveryTree(NamedTuple):
    """A settled delivery's tree, as settle_delivery's KEYS[1..2]: 2 keys."""

    hooks: str
    outbox: str


class DeliveryOutcome(NamedTuple):
    """An attempt's outcome, as settle_delivery's ARGV[1..5] and ARGV[8]: 6 values."""

    delivery_id: str
    member: str
    state: str
    next_at: float
    last: str
    attempts: int


@dataclass(frozen=True, kw_only=True)
class ClaimedNames(Group):
    """How a claimed delivery's keys are named (read_claimed's ARGV[1..4]): the keys module's names, cut where
    the root and task ids go."""

    tree_head: str = arg("a tree key's head (up to the root id)")
    outbox_tail: str = arg("a tree's outbox hash's tail (after the root id)")
    hooks_tail: str = arg("a tree's hooks hash's tail")
    task_middle: str = arg("a task hash key's middle (between the root id and the task id)")


class ClaimedRead(NamedTuple):
    """A claimed delivery as read_claimed reads it: its member, its entry (JSON), its subscription's event
    patterns and target (JSON; None when gone), its task's fields (None each when the task has expired); or,
    for one whose entry does not decode, `refused` (why) and the attempts settle_delivery reads it to have."""

    member: str
    entry: str
    patterns: str | None
    target: str | None
    values: list[str | None]
    refused: str = ""
    attempts: int = 0


@dataclass(frozen=True, kw_only=True)
class ReadClaimed(
    Call[None],
    script="read_claimed",
    standalone=False,
    returns="per claimed delivery to attempt, oldest first: {its member, its entry (JSON), its subscription's "
    "event patterns (false when gone), its target (JSON; false when gone), the fields' values (false for each "
    "when the task has expired)}; or, for one whose entry does not decode (not JSON, or without a hook or "
    "task_id), {its member, why, the attempts settle_delivery reads it to have}.",
):
    pending: str = key("the pending deliveries of every tree")
    names: ClaimedNames = splice("how a claimed delivery's keys are named", expand=True)
    retention_s: int = arg("retention seconds")
    members: Sequence[str] = args("the claimed members (`<root id> <delivery id>`)")


@dataclass(frozen=True, kw_only=True)
class SettleAndClaim(
    Call[list[ClaimedRead]],
    script="settle_and_claim",
    uses=("settle_delivery", "claim_deliveries", "read_claimed"),
    returns="per claimed delivery to attempt, as read_claimed reads it; none when the limit is 0.",
):
    pending: str = key("the pending deliveries of every tree (member `<root id> <delivery id>`, score: due ms)")
    counts: str = key("the attempts' outcomes counted by `<event type> <outcome>` (the metrics)")
    trees: Sequence[DeliveryTree] = keys("2 keys per outcome: its tree's hooks hash, its tree's outbox hash")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")
    now_ms: int = arg("now ms")
    lease_ms: int = arg("how long a claim holds a delivery, ms: past it (its worker died) another takes it")
    limit: int = arg("the most to claim (0: none)")
    names: ClaimedNames = splice("how a claimed delivery's keys are named, as read_claimed's {side}[1..4]")
    n_outcomes: int = count("number of outcomes", of="outcomes")
    outcomes: Sequence[DeliveryOutcome] = args(
        "6 per outcome, as settle_delivery takes them: the delivery id, its member of the pending deliveries, "
        "its state (retrying, delivered, gone or given_up), when to try again (epoch s), the attempt's answer, "
        "the attempts it had when claimed (-1: any)"
    )

    @classmethod
    def decode(cls, raw: Any) -> list[ClaimedRead]:
        return [
            ClaimedRead(str(row[0]), str(row[1]), row[2], row[3], list(row[4]))
            if len(row) == 5
            else ClaimedRead(str(row[0]), "", None, None, [], refused=str(row[1]), attempts=int(row[2]))
            for row in raw
        ]


@dataclass(frozen=True, kw_only=True)
class ToolSlot(
    Call[int],
    script="tool_slot",
    returns="when the call's slot lease ends (ms) when it holds a slot now, else 0 (it waits and asks again).",
):
    slots: str = key("the glob's slots zset (member: the call, score: when its lease ends, ms)")
    limit: int = arg("the limit")
    now_ms: int = arg("now ms")
    lease_ms: int = arg("lease ms")
    member: str = arg("the call's member")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class FreeToolSlot(
    Flag,
    script="free_tool_slot",
    returns="1 when freed; 0 when the call holds it no more (taken again since, or its lease lapsed).",
):
    slots: str = key("the glob's slots zset")
    member: str = arg("the call's member")
    lease_ends_ms: int = arg("when the take that frees it said its lease ends, ms")


@dataclass(frozen=True, kw_only=True)
class KeepTrees(
    Call[int],
    script="keep_trees",
    returns="how many keys were given their retention again.",
):
    trees_keys: Sequence[str] = keys("for each tree, in ARGV's order: its root's task hash, then its keys")
    retention_ms: int = arg("retention ms")
    floor_ms: int = arg("a key with less than this many ms left is given its retention again")
    counts: Sequence[int] = args("how many keys of KEYS are each tree's, its root's hash not counted")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


class UnwatchKeys(NamedTuple):
    """A task the due list may forget: 2 keys."""

    lease: str
    task: str


@dataclass(frozen=True, kw_only=True)
class Unwatch(
    Call[int],
    script="unwatch",
    returns="how many were taken off.",
):
    due: str = key("the due list")
    tasks: Sequence[UnwatchKeys] = keys("2 keys per task id of ARGV, in its order: its lease, its task hash")
    while_status: str = arg("the status the task must still have to be taken off ('' for any)")
    task_ids: Sequence[str] = args("task ids")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class Rewatch(
    Flag,
    script="rewatch",
    returns="1 when its place was put back, 0 when a step has watched it since this step's watch (left as it is).",
):
    due: str = key("the due list")
    task_id: str = arg("task id")
    watched_at: float = arg("the time this step's watch wrote")
    due_before: str = arg("the time it was due before that watch ('' when it was not on the list)")


@dataclass(frozen=True, kw_only=True)
class UnwatchParked(
    Flag,
    script="unwatch_parked",
    returns="1 while one of its approvals is pending (taken off unless leased), 0 when none is (nothing written).",
):
    due: str = key("the due list")
    lease: str = key("its lease")
    task: str = key("its task hash")
    task_id: str = arg("task id")
    approval_prefix: str = arg(
        "the prefix of its tree's approval hashes (named from the task's own record, as decide.lua)"
    )


@dataclass(frozen=True, kw_only=True)
class RemoveServedTimers(
    Call[int],
    script="remove_served_timers",
    returns="how many were removed.",
):
    timers: str = key("the timers zset (member `<kind>:<id>`, score: due epoch s)")
    served: Sequence[tuple[str, float]] = args("2 per timer served: its name, the time it was read at (epoch s)")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class ClearWait(
    Flag,
    script="clear_wait",
    returns="1 when cleared, 0 when the lease is not this run's (nothing written).",
):
    lease: str = key("lease")
    task: str = key("task hash")
    token: str = arg("the run's token")


@dataclass(frozen=True, kw_only=True)
class CountTransient(
    Call[TransientCount | None],
    script="count_transient",
    returns="{transient errors in all, failed attempts of the request in flight}, or {} when the lease is not this "
    "run's (nothing written).",
):
    lease: str = key("lease")
    task: str = key("task hash")
    token: str = arg("the run's token")
    errors: int = arg("how many more requests failed")
    call: str = arg(
        "a mark new to this call, kept on the task (`transient_call`): the same call sent again after its reply "
        "was lost finds it and answers the counts without adding to them"
    )

    @classmethod
    def decode(cls, raw: Any) -> TransientCount | None:
        if not raw:
            return None
        return TransientCount(total=int(raw[0]), attempts=int(raw[1]))


@dataclass(frozen=True, kw_only=True)
class SetLive(
    Flag,
    script="set_live",
    returns="1 when written, 0 when the task has ended or is gone (nothing written).",
):
    task: str = key("task hash")
    live: str = key("tree live hash")
    events: str = key("tree events")
    task_id: str = arg("task id")
    status: str = arg("its live status JSON")
    state: str = arg("its state (the status's `state`)")
    retention_s: int = arg("retention seconds")
    events_maxlen: int = arg("events max length")


@dataclass(frozen=True, kw_only=True)
class MarkToolStarted(
    Flag,
    script="mark_tool_started",
    returns="1 when noted, 0 when the lease is not the run's (nothing written).",
):
    lease: str = key("the task's lease")
    journal: str = key("its tool results (the journal)")
    token: str = arg("the run's token")
    field_name: str = arg("the call's field (`started:<call id>`)")
    retention_s: int = arg("retention seconds")


@dataclass(frozen=True, kw_only=True)
class EndpointPark(
    Flag,
    script="endpoint_park",
    returns="1 when parked, 0 when the lease is not the run's (nothing written).",
):
    timers: str = key("the fleet's timers zset")
    parked: str = key("the view's parked list")
    task: str = key("the task hash")
    lease: str = key("its lease")
    timer: str = arg("the task's timer")
    wake_at_s: float = arg("when it wakes (epoch s)")
    task_id: str = arg("task id")
    keep_s: int = arg("how long the parked list is kept, seconds")
    since_ms: int = arg("when its wait began, epoch ms")
    token: str = arg("the run's token ('' for a park of no run's: not checked)")
    now_s: float = arg("now (epoch s)")


@dataclass(frozen=True, kw_only=True)
class KeepCompaction(
    Call[str],
    script="keep_compaction",
    acknowledged=True,
    returns="'kept', 'fenced' when the lease is not this run's, or 'kept_before' when the task has a compaction of "
    "that number already (nothing written).",
):
    lease: str = key("lease")
    task: str = key("task hash")
    compactions: str = key("the task's compaction records")
    ui_messages: str = key("UI messages")
    token: str = arg("the run's token")
    number: int = arg("the record's number (1 for the task's first)")
    record: str = arg("the record (JSON)")
    ui_message: str = arg("the context_compacted UI message (JSON)")
    now: float = arg("now")
    retention_s: int = arg("retention seconds")

    @classmethod
    def decode(cls, raw: Any) -> str:
        return str(raw)


# Not acknowledged on its own: the root's creation follows it at once with its WAIT, and replicas take the
# master's writes in one ordered stream, so that WAIT covers this count too (under Sentinel a submit
# waited for its replicas twice).
@dataclass(frozen=True, kw_only=True)
class TenantSubmit(
    Call[QuotaVerdict],
    script="tenant_submit",
    returns="{1} when the root is counted (or was before: a retried submit of the same root), or {0, quota, "
    "used, limit, retry after ms} when a quota refuses it (nothing written).",
):
    submits: str = key("the tenant's submits zset (root id -> ms)")
    roots: str = key("the tenant's running roots zset (root id -> ms)")
    spend: str = key("the tenant's spend hash (epoch hour -> micro-USD)")
    root_id: str = arg("the new root's id")
    now_ms: int = arg("now ms")
    submits_per_minute: int = arg("submits per minute (0: no quota)")
    max_running_roots: int = arg("roots running at once (0: no quota)")
    max_cost_micros_per_day: int = arg("micro-USD per rolling day (0: no quota)")
    retention_s: int = arg("retention seconds (the running roots zset's lifetime)")
    retried: str | None = arg(
        "'1': a root that ended, run again by a retry: counted among the running roots again (its submit was "
        "counted when it was made), under max_running_roots and the day's spend",
        optional=True,
    )

    @classmethod
    def decode(cls, raw: Any) -> QuotaVerdict:
        if int(raw[0]) == 1:
            return QuotaVerdict(accepted=True)
        return QuotaVerdict(
            accepted=False, quota=str(raw[1]), used=int(raw[2]), limit=int(raw[3]), retry_after_ms=int(raw[4])
        )


@dataclass(frozen=True, kw_only=True)
class PruneRoots(
    Call[int],
    script="prune_roots",
    returns="how many roots were taken out.",
):
    roots: str = key("the tenant's running roots zset (root id -> ms)")
    tasks: Sequence[str] = keys("the task hash of each root of ARGV's triples, in their order")
    retention_s: int = arg("retention seconds (the running roots zset's lifetime)")
    now_ms: float = arg("now ms: the new score of each root counted anew")
    n_ended: int = count("how many roots the prune read as ended", of="ended")
    ended: Sequence[tuple[str, float, str]] = args(
        "3 per root read as ended: its id, its score as read, its status as read ('' for no record)"
    )
    long_running: Sequence[str] = args("then the roots read as running, counted long ago: counted anew at now")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)


@dataclass(frozen=True, kw_only=True)
class TenantSpend(
    Call[int],
    script="tenant_spend",
    returns="the tenant's micro-USD in the rolling day, this cost included.",
):
    spend: str = key("the tenant's spend hash (epoch hour -> micro-USD)")
    counted: str = key("the tenant's counted requests zset (`<task id>:<request key>` -> ms)")
    request: str = arg("the request (`<task id>:<request key>`)")
    cost_micros: int = arg("cost micro-USD")
    now_ms: int = arg("now ms")

    @classmethod
    def decode(cls, raw: Any) -> int:
        return int(raw)

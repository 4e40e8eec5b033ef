"""The operations' inputs, one pydantic model each, and the checks they share (a prompt, a reason, a page, a budget,
a tree's metadata and a history's filter on it).

    CreateTaskInput   POST /v1/tasks, `subq run`            CancelInput     a cancel's reason
    SubmitInput       the Celery task `subq.submit`        DecisionInput   an approval's decision
    DelegateInput     POST /v1/tasks/{id}/subtasks         TodosInput      a todo list's replacement
    RetryInput        POST /v1/tasks/{id}/retry, `subq retry`: alone, or every failed task of the tree

Each model is the one definition of its operation's input: the HTTP API reads its
request body with it, `subq.submit` its message, and the CLI and the Python client
build it from their arguments before they call the operation or send anything, so
a malformed input gets the same error whichever way it comes (`parse` words
pydantic's first error as the API does: `subtasks.1.message: Field required`).
pydantic checks the shape (types, required and unknown fields, a mode); the
service's own checks below check the content (a blank prompt, a budget), so they
say it in the service's words. A check raises subq's `ValidationError`, which is
no ValueError: pydantic lets it through as it is, naming its field.

Light on purpose (pydantic, no Redis, no Celery, no FastAPI): the Python client
installs with httpx and pydantic only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal, DecimalException, InvalidOperation
from typing import Annotated, Any, Literal, Self

import pydantic
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, WithJsonSchema

from coordinator import ids
from coordinator.errors import NotFoundError, ProfileError, ValidationError
from coordinator.models import (
    FINISHING_AMONG_MAX,
    MAX_PROMPT_CHARS,
    DelegationMode,
    SubtaskSpec,
    TaskStatus,
    TodoStatus,
    usd_to_micros,
)
from coordinator.output_schema import NO_RUN_NO_OUTPUT, OutputSchema, SchemaProblem
from coordinator.subscriptions import CeleryCallback, OnComplete, Webhook, Webhooks
from coordinator.tenants import (
    DEFAULT_PRIORITY,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TENANT_NAME_PATTERN,
    check_priority,
    check_tenant_name,
)
from coordinator.text import all_shown, lone_surrogate, shown_value, shows

__all__ = [
    "DEFAULT_PAGE",
    "MAX_CURSOR",
    "MAX_ERROR_CHARS",
    "MAX_METADATA_KEYS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_PAGE",
    "MAX_PROMPT_CHARS",
    "MAX_SUBTASKS",
    "META_PREFIX",
    "CancelInput",
    "CreateTaskInput",
    "DecisionInput",
    "DelegateInput",
    "Metadata",
    "OperationInput",
    "RetryInput",
    "SubmitInput",
    "TodoUpdate",
    "TodosInput",
    "check_dead_letter_limit",
    "check_delivery_id",
    "check_finishing_among",
    "check_history_query",
    "check_metadata",
    "check_root_id",
    "check_subscriptions",
    "check_wait_timeout",
    "error_message",
    "error_path",
    "finishing_among",
    "input_error",
    "meta_filter",
    "meta_pairs",
    "one_line",
    "profile_asked",
    "sendable_profile",
    "text_field",
    "to_micros",
    "visible_text",
]

# An idempotency key is an id the caller chose (a UUID, a message id), and a cancel's reason,
# read by the parent's model and by people, a paragraph: neither is a document. The service
# checks them with these too; a denial's feedback is bounded by the API.
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_REASON_CHARS = 2000
MAX_FEEDBACK_CHARS = 10_000
# History pages: enough for a screen, bounded so one call stays cheap.
DEFAULT_PAGE = 50
MAX_PAGE = 500
# Cursors are offsets into a Redis sorted set: kept within a JSON-safe integer (a larger one would reach Redis
# as an out-of-range index, and above it an offset cannot be a real position).
MAX_CURSOR = 2**53

# One line of an error is enough to act on; no traceback crosses over.
MAX_ERROR_CHARS = 300

# A tree's caller metadata (`metadata`: the caller's job id, customer, ticket) is a few tags, not a
# document: every record of the tree carries a copy, and every history line shows it.
MAX_METADATA_KEYS = 16
# Keys are names (`customer`, `job.id`): no `=`, space or `&`, so `--meta customer=acme` and
# `?meta.customer=acme` split at the first `=` with no quoting, whatever the value holds.
MAX_METADATA_KEY_CHARS = 64
METADATA_KEY_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# An id, a name or a short label fits; a value is not where a caller keeps a document.
MAX_METADATA_VALUE_CHARS = 256
# A history filter on a metadata value: `meta.<key>=<value>` (GET /v1/tasks?meta.customer=acme).
META_PREFIX = "meta."


def text_field(value: object, field: str, max_chars: int) -> str:
    """A non-empty string of at most `max_chars`, or a ValidationError naming `field`."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", field=field)
    if len(value) > max_chars:
        raise ValidationError(f"{field} is {len(value)} characters; the limit is {max_chars}", field=field)
    where = lone_surrogate(value)
    if where is not None:
        raise ValidationError(f"{field} holds a lone surrogate {where}, which is no character", field=field)
    return value


def profile_asked(profile: str | None, field: str = "profile", left_out: str = "the default profile") -> str | None:
    """A profile's name as asked, or None when left out (for `left_out`); an empty name is a ProfileError naming
    `field`: it would have read as `left_out`, which the caller did not name."""
    if profile is not None and not profile.strip():
        raise ProfileError(f"{field} must not be empty: leave it out for {left_out}", field=field)
    return profile


def sendable_profile(profile: str | None) -> str | None:
    """A profile's name as a request body can carry it, or a ProfileError: one with a lone surrogate (a
    command-line argument that is not UTF-8) was an encoding error in the HTTP client, a traceback from the CLI.
    (The service names the profiles it knows instead, which a client cannot.)"""
    if profile is not None and (where := lone_surrogate(profile)) is not None:
        raise ProfileError(
            f"Invalid profile: {shown_value(profile)} holds a lone surrogate {where}, which is no character",
            field="profile",
        )
    return profile


def idempotency_key(value: object) -> str:
    """An idempotency key: a non-empty string within its limit, of printable characters.

    A key's claim is `<API key name>` and a line break before it (the key alone for a caller with no API key):
    a key holding a line break, `ci` and `abc` on two lines, would have been API key ci's `abc`, and answered
    with its tree."""
    key = text_field(value, "idempotency_key", MAX_IDEMPOTENCY_KEY_CHARS)
    if not key.isprintable():
        raise ValidationError(
            "idempotency_key must be printable: no line breaks, tabs or control characters", field="idempotency_key"
        )
    return key


def one_line(text: str, max_chars: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line, whitespace collapsed, cut to `max_chars` with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= max_chars else line[: max_chars - 1] + "…"


def visible_text(text: str) -> str:
    """`text` as it may be shown: every character but the new line that is not drawn as itself written as its
    escape.

    A model's words (a plan item, an error, a tool call's arguments) reach an
    operator's terminal and browser. On a terminal an ESC starts a sequence (clear
    the screen, retitle the window, write the clipboard with OSC 52) and a CR
    overwrites the line; anywhere, a bidi override or a zero-width character makes
    text read as something other than it is. Written as `\\x1b`, `\\r`, `\\u202e`,
    they are only text. (Python's non-printable: Unicode's Other and Separator
    categories, but the ASCII space.) And the printable characters drawn as
    nothing: variation selectors after a URL showed an approver the URL alone,
    while they carried bytes of the model's choosing to the tool.
    """
    if all_shown(text):
        return text
    return "".join(ch if ch == "\n" or shows(ch) else ascii(ch)[1:-1] for ch in text)


def _shown_key(key: str) -> str:
    """A refused key as an error names it: visible, and cut (it is the caller's text, of any length)."""
    shown = visible_text(key)
    return shown if len(shown) <= MAX_METADATA_KEY_CHARS else shown[:MAX_METADATA_KEY_CHARS] + "…"


def _metadata_value(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{field} must be a string, not {type(value).__name__}", field=field)
    if not value or len(value) > MAX_METADATA_VALUE_CHARS:
        raise ValidationError(
            f"{field} is {len(value)} characters; a value is 1 to {MAX_METADATA_VALUE_CHARS}", field=field
        )
    # A tag is shown on terminals and pages and matched exactly by a filter: a control character (an ESC,
    # a new line), a bidi override or a zero-width character would make two tags read alike or break a line.
    hidden = next((ch for ch in value if not shows(ch)), None)
    if hidden is not None:
        raise ValidationError(
            f"{field} holds the non-printable character {hidden!a}: a value is printable text", field=field
        )
    return value


def _metadata_key(key: object, prefix: str) -> str:
    if not isinstance(key, str) or not METADATA_KEY_RE.fullmatch(key):
        shown = _shown_key(key) if isinstance(key, str) else repr(key)
        raise ValidationError(
            f"{prefix}: the key {shown!r} is not 1 to {MAX_METADATA_KEY_CHARS} characters of A-Z a-z 0-9 _ . -",
            field=f"{prefix}.{shown}" if isinstance(key, str) and key else prefix,
        )
    return key


def check_metadata(value: object, field: str = "metadata") -> dict[str, str]:
    """A tree's caller metadata: at most MAX_METADATA_KEYS string keys (`[A-Za-z0-9_.-]`, 1 to 64) each
    with a string value (1 to 256 printable characters), or a ValidationError naming `metadata.<key>`."""
    if not isinstance(value, Mapping):
        raise ValidationError(f"{field} must be an object of string keys and values", field=field)
    if len(value) > MAX_METADATA_KEYS:
        raise ValidationError(f"{field} has {len(value)} keys; the limit is {MAX_METADATA_KEYS}", field=field)
    return {_metadata_key(key, field): _metadata_value(item, f"{field}.{key}") for key, item in value.items()}


def meta_filter(pairs: Iterable[tuple[str, str]], option: str = META_PREFIX.rstrip(".")) -> dict[str, str]:
    """Key/value pairs a history must match (`?meta.customer=acme`) as one map, checked as a tree's metadata
    is (`meta.<key>` named); a key given twice is refused rather than one of its values silently dropped."""
    found: dict[str, str] = {}
    for key, value in pairs:
        if key in found:
            raise ValidationError(f"{option} names the key {_shown_key(key)!r} twice", field=f"{META_PREFIX}{key}")
        found[key] = value
    return check_metadata(found, "meta")


def meta_pairs(words: Iterable[str], option: str) -> dict[str, str]:
    """`KEY=VALUE` words (`subq run --meta`, `subq history --meta`, the web view's filter) as a metadata map,
    split at the first `=` (a key holds none) and checked as `check_metadata` checks a tree's."""
    pairs = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValidationError(f"{option} {_shown_key(word)!r} is not KEY=VALUE (e.g. customer=acme)", field="meta")
        pairs.append((key, value))
    return meta_filter(pairs, option)


def check_root_id(root_id: str, field: str = "root_id") -> str:
    """A root's id as a filter takes it (`--root`, `?root_id=`), or an error naming `field`: a NotFoundError for
    no id's shape (a lone surrogate among them), a ValidationError for a child's or a batch's id, which matched
    no root and answered an empty page where the API refused it."""
    root = ids.root_of(root_id, field=field)
    if root != root_id:
        raise ValidationError(f"{field}: {root_id} is not a root task (its root is {root})", field=field)
    return root_id


# A delivery id, `<event id>.<subscription>` (coordinator/store/lua/outbox_add.lua): the API's path takes this
# shape alone (coordinator/api/control.py, DeliveryId), and the client and the service check it before a request.
DELIVERY_ID_RE = re.compile(r"evt_[A-Za-z0-9_-]{1,80}_[0-9]{1,12}\.[0-9a-z]{1,4}")


def check_delivery_id(task_id: str, delivery_id: str) -> str:
    """A delivery id of the shape subq gives one, or the NotFoundError of an unknown delivery: checked before a
    request (".." or "a/b" became another route) or a Redis command (a lone surrogate is no UTF-8) is made of it."""
    if not DELIVERY_ID_RE.fullmatch(delivery_id):
        raise NotFoundError(f"Unknown delivery {shown_value(delivery_id)} of task {task_id}", field="delivery_id")
    return delivery_id


def check_wait_timeout(timeout_s: float) -> None:
    """A wait's bound in seconds, 0 or more (inf: no end), or a ValidationError. `not >=`: NaN compares false with
    everything, and a NaN deadline never came."""
    if not timeout_s >= 0:
        raise ValidationError(f"timeout_s must be 0 or more seconds, not {timeout_s!r}", field="timeout_s")


def check_history_query(
    status: str | None, root_id: str | None, limit: int, cursor: int, metadata: Mapping[str, str] | None = None
) -> None:
    """A history query's filters and page, or a ValidationError naming the first bad one.

    `metadata`: only the tasks whose tree carries every one of these key/value pairs (`meta.<key>`)."""
    if metadata is not None:
        check_metadata(metadata, "meta")
    if status is not None and status not in {s.value for s in TaskStatus}:
        allowed = ", ".join(s.value for s in TaskStatus)
        raise ValidationError(f"status must be one of {allowed}, not {status!r}", field="status")
    if not 1 <= limit <= MAX_PAGE:
        raise ValidationError(f"limit must be between 1 and {MAX_PAGE}", field="limit")
    if not 0 <= cursor <= MAX_CURSOR:
        raise ValidationError(f"cursor must be between 0 and {MAX_CURSOR}", field="cursor")
    if root_id is not None:
        check_root_id(root_id)


def finishing_among(among: str) -> list[str]:
    """GET .../finishing?among=: the task ids a waiter's last look named, comma-separated (none when empty), at
    most FINISHING_AMONG_MAX, or a ValidationError; `Coordinator.finishing_runs` checks each is of the tree."""
    named = among.split(",") if among else []
    if len(named) > FINISHING_AMONG_MAX:
        raise ValidationError(f"among names {len(named)} task ids; at most {FINISHING_AMONG_MAX}", field="among")
    return named


def check_finishing_among(task_id: str, among: Sequence[str]) -> None:
    """The tasks a waiter's last look named, or a ValidationError naming the first that is not a task of
    `task_id`'s tree (a key that may read the tree may read each of them)."""
    root = ids.root_of(task_id)
    for task in among:
        if not ids.is_task_id(task) or ids.root_of(task) != root:
            raise ValidationError(f"among: {task[:64]!r} is not a task of the tree of {task_id}", field="among")


def check_dead_letter_limit(limit: object) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValidationError(f"limit must be an integer between 1 and {MAX_PAGE}", field="limit")


def to_micros(value: object, field: str) -> int:
    """A budget in USD as integer micro-USD (0: none); a positive number or an error naming the field."""
    if value is None:
        return 0
    try:
        number = isinstance(value, (int, float, str, Decimal)) and not isinstance(value, bool)
        usd = Decimal(str(value)) if number else None
    except InvalidOperation:
        usd = None
    if usd is None or not usd.is_finite() or usd <= 0:
        raise ValidationError(f"{field} must be a positive number of US dollars, not {value!r}", field=field)
    try:
        micros = usd_to_micros(usd)
    except DecimalException:  # beyond the precision or range of decimal arithmetic: no budget is that large
        raise ValidationError(f"{field} is too large: {value!r}", field=field) from None
    if micros < 1:
        raise ValidationError(f"{field} must be at least one micro-dollar (0.000001)", field=field)
    return micros


# -- the operations' inputs ----------------------------------------------------------------


def _schema_problem(error: Mapping[str, Any]) -> SchemaProblem | None:
    cause = (error.get("ctx") or {}).get("error")
    return cause if isinstance(cause, SchemaProblem) else None


def error_path(error: Mapping[str, Any], prefix: tuple[str | int, ...] = ()) -> str:
    """Where one of pydantic's errors is, dotted (`subtasks.1.message`); an output schema's problem goes on
    into the schema (`output_schema.properties.total.type`, coordinator/output_schema.py)."""
    parts = [str(part) for part in (*prefix, *error["loc"])]
    problem = _schema_problem(error)
    return ".".join([*parts, problem.where] if problem is not None and problem.where else parts)


def error_message(error: Mapping[str, Any]) -> str:
    """What one of pydantic's errors says (an output schema's problem in its own words, without pydantic's
    `Value error, `)."""
    problem = _schema_problem(error)
    return problem.reason if problem is not None else str(error["msg"])


def input_error(exc: pydantic.ValidationError) -> ValidationError:
    """pydantic's first error as the service's: `path: message`, naming the path, as the HTTP API words it."""
    error = exc.errors()[0]
    path, message = error_path(error), error_message(error)
    return ValidationError(f"{path}: {message}" if path else message, field=path or None)


class OperationInput(BaseModel):
    """An operation's input: unknown fields are refused (a typo is an error naming it, not an ignored option)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> Self:
        """The input from a message, a body or a command's arguments, or the ValidationError of its first problem."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise input_error(exc) from None


def _budget(value: object) -> object:
    to_micros(value, "budget_usd")  # in the service's words: a positive number of US dollars
    return value


# The todo-list grammar (coordinator/todos.py) checks a plan when the service reads it and
# names the failing item (`todos.1.content`, code `invalid_todos`); the schema declares the
# accepted shapes for the OpenAPI document and leaves checking to it.
_TODO_UPDATE_SCHEMA: dict[str, Any] = {
    "description": (
        "The plan: markdown checkbox lines ('[ ] pending', '[-] in progress', '[x] done'), "
        "or a list of {content, status} items"
    ),
    "anyOf": [
        {"type": "string", "examples": ["[ ] Collect figures\n[-] Summarise feedback"]},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "content": {"type": "string"},
                    "status": {"type": "string", "enum": [s.value for s in TodoStatus]},
                },
                "required": ["content"],
                "additionalProperties": False,
            },
        },
    ],
}
TodoUpdate = Annotated[Any, WithJsonSchema(_TODO_UPDATE_SCHEMA)]

# Free text the service's `text_field` checks: not blank, within its limit.
Prompt = Annotated[
    str,
    AfterValidator(lambda text: text_field(text, "prompt", MAX_PROMPT_CHARS)),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS, "description": "The task's text"}),
]
IdempotencyKey = Annotated[
    str,
    AfterValidator(idempotency_key),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_CHARS}),
]
Reason = Annotated[
    str,
    AfterValidator(lambda reason: text_field(reason, "reason", MAX_REASON_CHARS)),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_REASON_CHARS}),
]
# At most SUBQ_MAX_FANOUT's own bound, counted before the specs past it are checked: an output schema is checked as
# its spec is read (RE2 compiles its patterns), so a list of 20,000 was read whole before the service's count refused
# it. The setting's own limit (256 by default) is the service's check (`check_subtasks`).
MAX_SUBTASKS = 10_000
Subtasks = Annotated[list[SubtaskSpec], Field(min_length=1, max_length=MAX_SUBTASKS)]


def _metadata_or_none(value: object) -> object:
    return None if value is None else check_metadata(value)


# Checked in the service's words (`metadata.customer is 300 characters; ...`), whichever face it came from.
Metadata = Annotated[
    dict[str, str] | None,
    BeforeValidator(_metadata_or_none),
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "maxProperties": MAX_METADATA_KEYS,
                    "propertyNames": {"pattern": f"^{METADATA_KEY_RE.pattern}$"},
                    "additionalProperties": {"type": "string", "minLength": 1, "maxLength": MAX_METADATA_VALUE_CHARS},
                    "examples": [{"customer": "acme", "ticket": "T-1234"}],
                },
                {"type": "null"},
            ],
            "description": (
                "The caller's tags for the tree (a job id, a customer, a ticket; values printable text): every "
                "task of the tree carries them, and the history filters by them (`meta.<key>=<value>`)"
            ),
        }
    ),
]


def _priority_or_none(value: object) -> object:
    return None if value is None else check_priority(value)


def _tenant_or_none(value: object) -> object:
    return None if value is None else check_tenant_name(value)


# A root's priority, checked in the service's words (`priority must be an integer from 1 to 5 ...`).
Priority = Annotated[
    int | None,
    BeforeValidator(_priority_or_none),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX}, {"type": "null"}],
            "description": (
                f"{PRIORITY_MIN}-{PRIORITY_MAX} (default {DEFAULT_PRIORITY}): within its tenant's share, a higher "
                "priority starts first; cut to the tenant's max_priority (docs/tenants.md)"
            ),
        }
    ),
]
TenantName = Annotated[
    str | None,
    BeforeValidator(_tenant_or_none),
    WithJsonSchema({"anyOf": [{"type": "string", "pattern": TENANT_NAME_PATTERN.pattern[2:-2]}, {"type": "null"}]}),
]

_PROFILE = "A configured model profile; the default when omitted"
_KEY = "A key of the caller's choosing: a retried request with the same key returns the first root"
_MODE = "parallel (all at once) or sequential (a chain)"


class _Subscriptions(OperationInput):
    webhooks: Webhooks = None
    on_complete: OnComplete = None


def check_subscriptions(webhooks: object, on_complete: object) -> tuple[list[Webhook] | None, CeleryCallback | None]:
    """A root's `webhooks` and `on_complete` as the service takes them from Python (models or plain dicts),
    read with the API's own shapes, or a ValidationError naming the field (`webhooks.0.url`)."""
    given = _Subscriptions.parse({"webhooks": webhooks, "on_complete": on_complete})
    return given.webhooks, given.on_complete


class CreateTaskInput(OperationInput):
    """Create a root task. New optional fields (e.g. `budget_usd`) slot in as defaults, keeping old inputs valid."""

    prompt: Prompt
    todos: TodoUpdate | None = None
    profile: str | None = Field(default=None, description=_PROFILE)
    run: StrictBool = Field(
        default=False,
        description="true: start the task as an agent on the fleet; false: the caller owns it and delegates",
    )
    budget_usd: Annotated[Decimal | None, BeforeValidator(_budget)] = Field(
        default=None, gt=0, max_digits=12, decimal_places=6,
        description="Most the whole tree may spend, in US dollars; it stops there (docs/control.md)",
    )  # fmt: skip
    idempotency_key: IdempotencyKey | None = Field(default=None, description=_KEY)
    output_schema: OutputSchema = None
    metadata: Metadata = None
    webhooks: Webhooks = None
    on_complete: OnComplete = None
    priority: Priority = None

    @pydantic.model_validator(mode="after")
    def _a_schema_needs_a_run(self) -> Self:
        if self.output_schema is not None and not self.run:
            raise ValidationError(NO_RUN_NO_OUTPUT, field="output_schema")
        return self


class SubmitInput(OperationInput):
    """`subq.submit`'s keyword arguments (docs/celery-contract.md): a root, and at once its subtasks if given.

    Its `run` defaults to true: a producer that sends only a prompt starts an agent.
    """

    prompt: Prompt
    todos: TodoUpdate | None = None
    profile: str | None = Field(default=None, description=_PROFILE)
    run: StrictBool = True
    subtasks: Subtasks | None = None
    mode: DelegationMode | None = Field(default=None, description=_MODE)
    idempotency_key: IdempotencyKey | None = Field(default=None, description=_KEY)
    output_schema: OutputSchema = None
    metadata: Metadata = None
    webhooks: Webhooks = None
    on_complete: OnComplete = None
    priority: Priority = None
    # Whom the tree runs for (a producer without an API key names it here; None: SUBQ_DEFAULT_TENANT).
    tenant: TenantName = None

    @pydantic.model_validator(mode="after")
    def _subtasks_need_a_caller_owned_root(self) -> Self:
        if self.output_schema is not None and not self.run:
            raise ValidationError(NO_RUN_NO_OUTPUT, field="output_schema")
        if self.subtasks is None and self.mode is not None:
            raise ValidationError("mode applies only together with subtasks", field="mode")
        if self.subtasks is not None and self.run:
            raise ValidationError(
                "subtasks need run=false: the caller owns a parent it delegates to "
                "(an agent root, run=true, plans its own subtasks)",
                field="run",
            )
        return self


class DelegateInput(OperationInput):
    """Delegate subtasks to children of a task."""

    mode: DelegationMode = Field(default="parallel", description=_MODE)
    # SubtaskSpec is the domain's own spec, so a field added there (budget_usd) reaches every face unchanged.
    subtasks: Subtasks


class TodosInput(OperationInput):
    """Replace a task's todo list: links and figures of existing items survive."""

    todos: TodoUpdate


class CancelInput(OperationInput):
    """Cancel a task and its whole subtree."""

    reason: Reason = Field(description="Why: the parent and the history read it")


class RetryInput(OperationInput):
    """Retry a failed task, or every failed task of its tree (coordinator/retry.py). An empty body retries the task alone."""

    failed: StrictBool = Field(
        default=False,
        description="Retry every failed task of the task's subtree, children before parents, not the task alone",
    )


class DecisionInput(OperationInput):
    """Approve or deny a tool call waiting for a decision."""

    decision: Literal["approve", "deny"]
    feedback: str | None = Field(
        default=None, max_length=MAX_FEEDBACK_CHARS, description="What the model is told on a denial"
    )

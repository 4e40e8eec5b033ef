"""What the operator commands reach the system through: Redis directly, or the HTTP API.

    RedisBackend   the Coordinator on SUBQ_REDIS_URL (local use; needs broker credentials)
    ApiBackend     the HTTP client on SUBQ_API_URL with SUBQ_API_TOKEN (needs no Redis access)

Both answer the same operations with the same models and raise the same
SubqErrors (the API sends each error's code and message, and the client raises
its class again), so a command prints the same lines and exits with the same
code either way. `up`, `worker`, `api`, `flower` and `demo` start processes on
Redis and never use a backend.

Each is imported when a command runs: RedisBackend loads the service (Celery,
kombu, redis-py), ApiBackend only httpx and the models.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, Protocol

from coordinator.deadletters import DeadLetter
from coordinator.inputs import MAX_PROMPT_CHARS, check_dead_letter_limit, check_history_query, text_field, to_micros
from coordinator.models import Approval, HistoryItem, LiveState, TaskRecord, TodoItem
from coordinator.tree import TreeNode

if TYPE_CHECKING:
    from coordinator.client import SubqClient
    from coordinator.service import Coordinator

__all__ = ["ApiBackend", "Backend", "RedisBackend"]

# Events read from the tree's Redis stream at once by a live view: a burst of
# child events becomes one redraw.
EVENTS_PER_READ = 500


class Backend(Protocol):
    """The operations the operator commands use."""

    def create_task(
        self, prompt: str, *, todos: str | None, profile: str | None, budget_usd: str | None
    ) -> TaskRecord: ...
    def get_task(self, task_id: str) -> TaskRecord: ...
    def get_todos(self, task_id: str) -> list[TodoItem]: ...
    def tree(self, task_id: str) -> TreeNode: ...
    def messages(self, task_id: str, kind: Literal["ui", "api"]) -> list[dict[str, Any]]: ...
    def list_tasks(
        self, *, status: str | None, root_id: str | None, limit: int, cursor: int
    ) -> tuple[list[HistoryItem], int | None]: ...
    def snapshot(self, root_id: str) -> dict[str, LiveState]: ...
    def cancel(self, task_id: str, reason: str) -> TaskRecord: ...
    def list_approvals(self, root_id: str | None) -> list[Approval]: ...
    def decide(self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None) -> Approval: ...
    def dead_letters(self, limit: int) -> list[DeadLetter]: ...
    def count_dead_letters(self) -> int: ...
    def purge_dead_letters(self) -> int: ...
    def watch(self, root_id: str) -> Watch: ...
    def close(self) -> None: ...


class Watch(Protocol):
    """Wakes a live view when the tree's event stream moves on."""

    def wait(self, timeout_s: float) -> None:
        """Return once something happened in the tree since the last call, or after timeout_s."""

    def close(self) -> None: ...


class RedisBackend:
    """The Coordinator, on the Redis of the settings."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def create_task(self, prompt: str, *, todos: str | None, profile: str | None, budget_usd: str | None) -> TaskRecord:
        return self.coord.create_task(prompt, todos=todos, profile=profile, run=True, budget_usd=budget_usd)

    def get_task(self, task_id: str) -> TaskRecord:
        return self.coord.get_task(task_id)

    def get_todos(self, task_id: str) -> list[TodoItem]:
        return self.coord.get_todos(task_id)

    def tree(self, task_id: str) -> TreeNode:
        from coordinator.tree import build_tree

        return build_tree(self.coord, task_id)

    def messages(self, task_id: str, kind: Literal["ui", "api"]) -> list[dict[str, Any]]:
        return self.coord.messages(task_id, kind)

    def list_tasks(
        self, *, status: str | None, root_id: str | None, limit: int, cursor: int
    ) -> tuple[list[HistoryItem], int | None]:
        return self.coord.list_tasks(status=status, root_id=root_id, limit=limit, cursor=cursor)

    def snapshot(self, root_id: str) -> dict[str, LiveState]:
        return self.coord.snapshot(root_id)

    def cancel(self, task_id: str, reason: str) -> TaskRecord:
        return self.coord.cancel(task_id, reason)

    def list_approvals(self, root_id: str | None) -> list[Approval]:
        return self.coord.list_approvals(root_id)

    def decide(self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None) -> Approval:
        return self.coord.decide(approval_id, decision, feedback)

    def dead_letters(self, limit: int) -> list[DeadLetter]:
        return self.coord.dead_letters(limit)

    def count_dead_letters(self) -> int:
        return self.coord.count_dead_letters()

    def purge_dead_letters(self) -> int:
        return self.coord.purge_dead_letters()

    def watch(self, root_id: str) -> Watch:
        return _StreamWatch(self.coord, root_id)

    def close(self) -> None:
        self.coord.close()


class _StreamWatch:
    """Blocking reads of the tree's Redis stream, from its newest entry on."""

    def __init__(self, coord: Coordinator, root_id: str) -> None:
        self.coord = coord
        self.root_id = root_id
        self.after = coord.last_event_id(root_id)

    def wait(self, timeout_s: float) -> None:
        events = self.coord.read_events(
            self.root_id, self.after, block_ms=max(1, round(timeout_s * 1000)), count=EVENTS_PER_READ
        )
        self.after = events[-1][0] if events else self.after

    def close(self) -> None:
        pass


class ApiBackend:
    """The HTTP client, on the API of SUBQ_API_URL with the token SUBQ_API_TOKEN.

    Where the API's request schema refuses an input before the service sees it (an
    empty prompt, a negative budget, a history page out of range), the input is
    checked here first with the service's own check, so the error reads the same as
    on Redis and nothing is sent.
    """

    def __init__(self, client: SubqClient, url: str, token: str | None) -> None:
        self.client = client
        self.url = url
        self.token = token

    def create_task(self, prompt: str, *, todos: str | None, profile: str | None, budget_usd: str | None) -> TaskRecord:
        text_field(prompt, "prompt", MAX_PROMPT_CHARS)
        to_micros(budget_usd, "budget_usd")
        return self.client.create_task(prompt, todos=todos, profile=profile, run=True, budget_usd=budget_usd)

    def get_task(self, task_id: str) -> TaskRecord:
        return self.client.get_task(task_id)

    def get_todos(self, task_id: str) -> list[TodoItem]:
        return self.client.get_todos(task_id)

    def tree(self, task_id: str) -> TreeNode:
        return self.client.tree(task_id)

    def messages(self, task_id: str, kind: Literal["ui", "api"]) -> list[dict[str, Any]]:
        return self.client.messages(task_id, kind)

    def list_tasks(
        self, *, status: str | None, root_id: str | None, limit: int, cursor: int
    ) -> tuple[list[HistoryItem], int | None]:
        check_history_query(status, root_id, limit, cursor)
        return self.client.list_tasks(status=status, root_id=root_id, limit=limit, cursor=cursor)

    def snapshot(self, root_id: str) -> dict[str, LiveState]:
        return self.client.snapshot(root_id)

    def cancel(self, task_id: str, reason: str) -> TaskRecord:
        return self.client.cancel(task_id, reason)

    def list_approvals(self, root_id: str | None) -> list[Approval]:
        return self.client.list_approvals(root_id)

    def decide(self, approval_id: str, decision: Literal["approve", "deny"], feedback: str | None) -> Approval:
        return self.client.decide(approval_id, decision, feedback)

    def dead_letters(self, limit: int) -> list[DeadLetter]:
        check_dead_letter_limit(limit)
        return self.client.dead_letters(limit)

    def count_dead_letters(self) -> int:
        return self.client.count_dead_letters()

    def purge_dead_letters(self) -> int:
        return self.client.purge_dead_letters()

    def watch(self, root_id: str) -> Watch:
        from coordinator.client import SubqClient

        # A client of its own: the stream is read in a thread while the view reads the tree.
        return _SseWatch(SubqClient(self.url, self.token), root_id)

    def close(self) -> None:
        self.client.close()


class _SseWatch:
    """The tree's server-sent events, read by a daemon thread that flags each one.

    The thread ends with the stream (its `end` event, once the root has settled)
    or when the view closes the watch.
    """

    def __init__(self, client: SubqClient, root_id: str) -> None:
        self.client = client
        self.changed = threading.Event()
        self.failure: BaseException | None = None
        self.closing = False
        self._thread = threading.Thread(target=self._read, args=(root_id,), daemon=True, name="subq-follow")
        self._thread.start()

    def _read(self, root_id: str) -> None:
        try:
            for _event in self.client.events(root_id):
                self.changed.set()
        except Exception as exc:  # reported by the next wait(), on the view's thread
            self.failure = exc
        self.changed.set()

    def wait(self, timeout_s: float) -> None:
        self.changed.wait(timeout_s)
        self.changed.clear()
        if self.failure is not None and not self.closing:
            failure, self.failure = self.failure, None
            raise failure

    def close(self) -> None:
        self.closing = True
        self.client.close()

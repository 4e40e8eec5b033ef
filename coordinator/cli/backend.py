"""What the operator commands reach the system through, and how a live view hears it move.

A command holds one `Operations` (coordinator/operations.py) whichever way it
reaches the system: the `Coordinator` on SUBQ_REDIS_URL (local use; needs the
broker's credentials), or the HTTP client `SubqClient` on SUBQ_API_URL with
SUBQ_API_TOKEN (needs no Redis access). Both answer every operation with the
same models and raise the same SubqErrors (the client checks input with the
service's own checks before sending, and raises each error code's class
again), so a command prints the same lines and exits with the same code either
way. `up`, `worker`, `api`, `flower` and `demo` start processes on Redis and
never use one.

The only thing that differs by transport is how a live view (`run --follow`)
hears the tree move: the Redis stream, or the API's server-sent events (`watch`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from coordinator.client import SubqClient
    from coordinator.operations import Operations
    from coordinator.service import Coordinator

    def _both_are_operations(coord: Coordinator, client: SubqClient) -> tuple[Operations, Operations]:
        """The type checker's proof that the service and the client answer the same operations."""
        return coord, client


__all__ = ["Watch", "watch"]

# Events read from the tree's Redis stream at once by a live view: a burst of
# child events becomes one redraw.
EVENTS_PER_READ = 500


class Watch(Protocol):
    """Wakes a live view when the tree's event stream moves on."""

    def wait(self, timeout_s: float) -> None:
        """Return once something happened in the tree since the last call, or after timeout_s."""

    def close(self) -> None: ...


def watch(ops: Operations, root_id: str) -> Watch:
    """How `ops` hears the tree of `root_id` move: its Redis stream, or the API's event stream."""
    from coordinator.client import SubqClient

    if isinstance(ops, SubqClient):
        # A client of its own: the stream is read in a thread while the view reads the tree.
        return _SseWatch(ops.fork(), root_id)
    from coordinator.service import Coordinator

    assert isinstance(ops, Coordinator), f"no watch for {type(ops).__name__}"
    return _StreamWatch(ops, root_id)


log = logging.getLogger(__name__)


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


class _SseWatch:
    """The tree's server-sent events, read by a daemon thread that flags each one.

    The thread ends with the stream (its `end` event, once the root has settled)
    or when the view closes the watch.
    """

    def __init__(self, client: SubqClient, root_id: str) -> None:
        self.client = client
        self.changed = threading.Event()
        self.closing = False
        self._thread = threading.Thread(target=self._read, args=(root_id,), daemon=True, name="subq-follow")
        self._thread.start()

    def _read(self, root_id: str) -> None:
        # The stream only wakes the view early: the view reads the tree itself at least once a second, and says
        # what fails there. So a stream that failed past its resumes (a proxy that cuts every long response, say)
        # leaves the view to its own reads, rather than end a follow whose tree the API still serves.
        try:
            for _event in self.client.events(root_id):
                self.changed.set()
        except Exception as exc:
            if not self.closing:
                log.info("subq: the event stream of %s failed (%s); following by reading the tree", root_id, exc)
        self.changed.set()

    def wait(self, timeout_s: float) -> None:
        self.changed.wait(timeout_s)
        self.changed.clear()

    def close(self) -> None:
        self.closing = True
        self.client.close()

"""The provider port: a run's view of its model's endpoints, as the fleet keeps them (coordinator/endpoints.py).

Before each request a run asks the gate; after a transient error it marks the endpoint down
(endpoint_failed.lua decides the wait: this port passes on its answer); an answer clears it.
A run whose wait is long gives its worker back (`park`). The port also keeps what the run
knows of its task's wait across parks: when it began, and its request's failed attempts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import endpoints
from coordinator.ports.steps import Released, Steps, lose_lease
from coordinator.replies import EndpointState

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["ProviderPort"]


class ProviderPort:
    """One run's provider endpoints: the gate, a failure, an answer, the wait and its timeline."""

    def __init__(self, run: Steps, plane: Plane) -> None:
        self._run = run
        self._plane = plane
        # When the task began waiting for its provider across runs (ms; 0: not waiting), read on first need.
        self._wait_since_ms: int | None = None
        # The failed attempts of the request in flight, as counted on the task by this run (0: none).
        self._attempts = 0

    def gate(self, endpoint: str, model: str) -> EndpointState:
        """Whether the next request to `model` may go to `endpoint` now (its host's view and the model's, one
        round trip); this run may become a view's probe."""
        return endpoints.gate(self._plane, endpoint, model, self._run.token)

    def failed(self, endpoint: str, model: str, error: str, asked_s: float | None) -> EndpointState:
        """A request to `endpoint` failed transiently: the view it marks (`model`'s, or with "" the host's) is
        down for the fleet; how long to wait (endpoint_failed.lua's answer)."""
        return endpoints.failed(self._plane, endpoint, model, error, asked_s)

    def answered(self, endpoint: str, model: str, *, was_down: bool) -> None:
        """`endpoint` answered a request to `model` (with "": answered, of a model whose view stays down): the
        fleet forgets those views' failures (only if they had some: the healthy path costs nothing), and wakes
        the runs parked on them."""
        if was_down:
            endpoints.recovered(self._plane, endpoint, model)

    def transient_errors(self, lines: Sequence[str]) -> None:
        """Requests sent and failed transiently, to be sent again: each counted on the task (`transient_errors`)
        and told in a `wait_out` UI line with the request's attempt number, both kept on the task across parks."""
        if not lines:
            return
        self._run.flush()
        counted = self._plane.store.endpoints.count_transient_errors(self._run.task.id, len(lines), self._run.token)
        if counted is None:
            lose_lease(self._run)
        self._attempts = counted.attempts
        for number, what in enumerate(lines, start=counted.attempts - len(lines) + 1):
            self._run.say("wait_out", f"{what}: waiting it out (attempt {number})")

    def wait_over(self) -> None:
        """A response arrived: a task whose run had given its worker back to wait forgets when its wait began,
        and its request's failed attempts (once a run: a run woken from a park may not have read them)."""
        if self._wait_since_ms != 0 or self._attempts:
            self._plane.store.endpoints.clear_wait(self._run.task.id, self._run.token)
        self._wait_since_ms = 0
        self._attempts = 0

    def wait_since_ms(self) -> int | None:
        """When this task began waiting for its provider, if an earlier run of it gave its worker back to wait."""
        if self._wait_since_ms is None:
            self._wait_since_ms = self._plane.store.endpoints.wait_since_ms(self._run.task.id) or 0
        return self._wait_since_ms or None

    def waiting(self, endpoint: str, *, waiting: bool) -> None:
        """Open (or close) a `wait:provider` on the task's timeline, and say so in its live status."""
        run, what = self._run, f"endpoint:{endpoint}"
        opened = what not in run.waits.open
        run.waits.note(run.writes, "provider", what, waiting=waiting)
        if waiting and opened:  # shown now, not after the wait: the step is written at once
            run.live.write_state(run.task, run.writes, "waiting_provider", waiting_for="provider")
            run.flush()

    def park(self, endpoint: str, model: str, wake_at_s: float, since_ms: int) -> Released:
        """The run gives its worker back until `wake_at_s` (or until the view of `endpoint` it waits for,
        `model`'s or with "" its host's, is back): its timer is set first, then `end` saves it and frees its
        lease and slot."""
        run = self._run
        self.waiting(endpoint, waiting=True)
        if not endpoints.park(self._plane, run.task, endpoint, model, wake_at_s, since_ms, run.token):
            lose_lease(run)
        return Released("waiting_provider", wake_at_s=wake_at_s)

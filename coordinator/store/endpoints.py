"""Provider endpoints as the fleet sees them: down or up, the one probe, and the runs parked on each.

Each endpoint has two kinds of view: its host's (`keys.endpoint(endpoint)`: refused or dropped
connections, timeouts) and one per model it serves (`keys.endpoint(endpoint, model)`: what the
provider said of that model). `model=""` names the host's view wherever a view is named.
The rules (when to wait, who probes, how long to back off) are coordinator/endpoints.py's;
this part reads and writes them atomically: `endpoint_gate.lua` before a request (both views
of it, in one step), `endpoint_failed.lua` after a transient error, and `endpoint_recovered.lua`
once a request to a view that was down is answered.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from coordinator.ids import root_of
from coordinator.replies import HOST, MODEL, EndpointState, TransientCount
from coordinator.store.base import RESEND_MARK_S, Part, _str_map, translate_redis_errors
from coordinator.store.fields import TaskField
from coordinator.store.protocol import (
    ClearWait,
    CountTransient,
    EndpointFailed,
    EndpointGate,
    EndpointPark,
    EndpointRecovered,
)

__all__ = ["EndpointStore"]


class EndpointStore(Part):
    """Two kinds of hash per endpoint (its host's, one per model), the runs parked on each, and a parked
    task's first wait."""

    @translate_redis_errors
    def gate(self, endpoint: str, model: str, token: str, probe_lease_ms: int, recheck_ms: int) -> EndpointState:
        """Whether a request to `model` at `endpoint` may go now (its host's view and the model's); the run
        `token` becomes the probe of each view that is due one."""
        return self.scripts(
            EndpointGate(
                endpoint=self.keys.endpoint(endpoint), model=self.keys.endpoint(endpoint, model), now_ms=_now_ms(),
                token=token, probe_lease_ms=probe_lease_ms, recheck_ms=recheck_ms,
            )
        )  # fmt: skip

    @translate_redis_errors
    def failed(
        self,
        endpoint: str,
        model: str,
        error: str,
        *,
        base_ms: int,
        cap_ms: int,
        jitter: float,
        asked_ms: int | None,
        keep_ms: int,
    ) -> EndpointState:
        """Mark a view of `endpoint` down after a transient error (`model`'s, or with "" its host's); the
        wait before it may be tried again."""
        marked = self.scripts(
            EndpointFailed(
                endpoint=self.keys.endpoint(endpoint, model), now_ms=_now_ms(), base_ms=base_ms, cap_ms=cap_ms,
                jitter=jitter, asked_ms=-1 if asked_ms is None else asked_ms, error=error, keep_ms=keep_ms,
            )
        )  # fmt: skip
        return dataclasses.replace(marked, error=error, view=MODEL if model else HOST)

    @translate_redis_errors
    def recovered(self, endpoint: str, model: str = "") -> list[str]:
        """A request to `endpoint` was answered: forget its host's failures, and `model`'s when given (an
        answer about another model says nothing of it); returns the tasks parked on those views, taken off
        their lists (endpoint_recovered.lua: the same call sent again after its reply was lost answers them
        again). The caller wakes them with `wake_now`, a step of its own: the fleet's timers are a key of
        another slot, and the wake is idempotent (a task parked between the two wakes by its timer).
        """
        views = [""] + ([model] if model else [])
        return self.scripts(
            EndpointRecovered(
                mark=self.keys.endpoint_recovered(endpoint, uuid.uuid4().hex), mark_s=RESEND_MARK_S,
                views=[self.keys.endpoint(endpoint, m) for m in views]
                + [self.keys.endpoint_parked(endpoint, m) for m in views],
            )
        )  # fmt: skip

    @translate_redis_errors
    def park(
        self,
        endpoint: str,
        model: str,
        task_id: str,
        timer: str,
        wake_at_s: float,
        since_ms: int,
        keep_s: float,
        token: str = "",
    ) -> bool:
        """A run gives its worker back until `wake_at_s`: its timer, its place on the parked list of the
        view it waits for (`model`'s, or with "" its host's), and when its wait began (kept on the task,
        so its `model_wait_out_s` counts from there), in one step (endpoint_park.lua); only while the run of
        lease `token` holds the lease ('' for a park no run makes: not checked). False, with nothing written,
        when it does not. The tasks on that list whose wake time has passed leave it (their timers serve them), so
        a long outage keeps on it only the tasks still waiting, not every task that ever parked there."""
        root = root_of(task_id)
        return self.scripts(
            EndpointPark(
                timers=self.keys.timers(), parked=self.keys.endpoint_parked(endpoint, model),
                task=self.keys.task(root, task_id), lease=self.keys.lease(root, task_id), timer=timer,
                wake_at_s=wake_at_s, task_id=task_id, keep_s=int(keep_s), since_ms=since_ms, token=token,
                now_s=time.time(),
            )
        )  # fmt: skip

    @translate_redis_errors
    def wake_now(self, timers: list[str]) -> None:
        """Bring these timers forward to now (only those still set: a timer already served stays gone)."""
        if timers:
            self.client.zadd(self.keys.timers(), dict.fromkeys(timers, time.time()), xx=True, lt=True)

    @translate_redis_errors
    def wait_since_ms(self, task_id: str) -> int | None:
        """When the task's run began waiting for its provider, if a run of it gave its worker back to wait."""
        value = self.client.hget(self.keys.task(root_of(task_id), task_id), TaskField.PROVIDER_WAIT_SINCE_MS)
        return int(str(value)) if value else None

    @translate_redis_errors
    def clear_wait(self, task_id: str, token: str) -> bool:
        """A request of the task was answered: its wait, and its failed attempts' count, are over; only while
        the run of lease `token` holds the task's lease (a fenced run's answer leaves a newer park's wait)."""
        root = root_of(task_id)
        return self.scripts(
            ClearWait(lease=self.keys.lease(root, task_id), task=self.keys.task(root, task_id), token=token)
        )

    @translate_redis_errors
    def count_transient_errors(self, task_id: str, errors: int, token: str) -> TransientCount | None:
        """`errors` more requests of the task failed transiently: its transient errors in all, and the failed
        attempts of the request now in flight, both kept on the task, so they go on across parks; only while the
        run of lease `token` holds the task's lease (None, nothing written: a fenced run's failures are not the
        newer run's attempts). Counted once when sent again after its reply was lost (its call's mark)."""
        root = root_of(task_id)
        return self.scripts(
            CountTransient(
                lease=self.keys.lease(root, task_id),
                task=self.keys.task(root, task_id),
                token=token,
                errors=errors,
                call=uuid.uuid4().hex,
            )
        )

    @translate_redis_errors
    def state(self, endpoint: str, model: str = "") -> dict[str, str]:
        """A view's hash as stored (its host's, or `model`'s; {} while it is up): tests and operators."""
        return _str_map(self.client.hgetall(self.keys.endpoint(endpoint, model)))


def _now_ms() -> int:
    return int(time.time() * 1000)

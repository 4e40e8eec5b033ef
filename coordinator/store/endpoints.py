"""Provider endpoints as the fleet sees them: down or up, the one probe, and the runs parked on each.

The rules (when to wait, who probes, how long to back off) are coordinator/endpoints.py's;
this part reads and writes them atomically: `endpoint_gate.lua` before a request,
`endpoint_failed.lua` after a transient error, and a delete once a request succeeds.
"""

from __future__ import annotations

import time

from coordinator.ids import root_of
from coordinator.store.base import Part, _str_map, _strs, translate_redis_errors
from coordinator.store.fields import TaskField
from coordinator.store.protocol import EndpointFailed, EndpointGate

__all__ = ["EndpointStore"]

# What the fleet knows of an endpoint (coordinator/endpoints.py's `Gate`): the ms to wait before
# sending (0: send now), the failures in a row, the last error line ('' while it is up).
GateReply = tuple[int, int, str]


class EndpointStore(Part):
    """One hash per endpoint (`keys.endpoint`), the runs parked on it, and a parked task's first wait."""

    @translate_redis_errors
    def gate(self, endpoint: str, token: str, probe_lease_ms: int, recheck_ms: int) -> GateReply:
        """Whether a request to `endpoint` may go now; the run `token` becomes its probe if it is due one."""
        return self.scripts(
            EndpointGate(
                endpoint=self.keys.endpoint(endpoint), now_ms=_now_ms(), token=token, probe_lease_ms=probe_lease_ms,
                recheck_ms=recheck_ms,
            )
        )  # fmt: skip

    @translate_redis_errors
    def failed(
        self, endpoint: str, error: str, *, base_ms: int, cap_ms: int, jitter: float, asked_ms: int | None, keep_ms: int
    ) -> GateReply:
        """Mark `endpoint` down after a transient error; the wait before it may be tried again."""
        wait_ms, failures = self.scripts(
            EndpointFailed(
                endpoint=self.keys.endpoint(endpoint), now_ms=_now_ms(), base_ms=base_ms, cap_ms=cap_ms, jitter=jitter,
                asked_ms=-1 if asked_ms is None else asked_ms, error=error, keep_ms=keep_ms,
            )
        )  # fmt: skip
        return wait_ms, failures, error

    @translate_redis_errors
    def recovered(self, endpoint: str) -> list[str]:
        """A request to `endpoint` succeeded: forget its failures; returns the tasks parked on it.

        Two steps, not one script: the endpoint's hash and the fleet's timers are global keys of
        different slots, and both steps are idempotent (a task parked between them wakes by its timer).
        """
        if not self.client.delete(self.keys.endpoint(endpoint)):
            return []  # it was up: nothing parked on it (one command on the healthy path)
        parked = self.keys.endpoint_parked(endpoint)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zrange(parked, 0, -1)
            pipe.delete(parked)
            task_ids, _ = pipe.execute()
        return _strs(task_ids)

    @translate_redis_errors
    def park(self, endpoint: str, task_id: str, timer: str, wake_at_s: float, since_ms: int, keep_s: float) -> None:
        """A run gives its worker back until `wake_at_s`: its timer, its place on the endpoint's parked
        list, and when its wait began (kept on the task, so its `model_retry_for_s` counts from there)."""
        parked = self.keys.endpoint_parked(endpoint)
        task = self.keys.task(root_of(task_id), task_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zadd(self.keys.timers(), {timer: wake_at_s})  # first: a crash after it still wakes the task
            pipe.zadd(parked, {task_id: wake_at_s})
            pipe.expire(parked, int(keep_s))
            # A wait is not a loss: SUBQ_MAX_DELIVERIES counts runs lost with their worker.
            pipe.hset(task, mapping={TaskField.PROVIDER_WAIT_SINCE_MS: since_ms, TaskField.DELIVERIES: 0})
            pipe.execute()

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
    def clear_wait_since(self, task_id: str) -> None:
        self.client.hdel(self.keys.task(root_of(task_id), task_id), TaskField.PROVIDER_WAIT_SINCE_MS)

    @translate_redis_errors
    def state(self, endpoint: str) -> dict[str, str]:
        """The endpoint's hash as stored ({} while it is up): tests and operators."""
        return _str_map(self.client.hgetall(self.keys.endpoint(endpoint)))


def _now_ms() -> int:
    return int(time.time() * 1000)

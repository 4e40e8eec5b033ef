"""A provider endpoint's health, one view for the whole fleet: runs wait out an outage together.

An endpoint is a provider's `host:port` (the worker names it from the profile's
`base_url`, workers/runtime/providers.py), and one endpoint serves many models
(OpenAI's, OpenRouter's, a LiteLLM proxy's, an Ollama server's). What the fleet
knows of it lives in Redis (`keys.endpoint`, coordinator/store/endpoints.py) as
two kinds of view, so every run of every worker process reads the same answer
and one model's outage is not its host's:

- the host's: what the transport says (a refused or dropped connection, a
  timeout): no request to any model of the endpoint goes while it is down;
- one per model: what the provider answers of that model (429, 5xx, 529 and
  the Retry-After that comes with them): only that model's requests wait, so a
  fallback to another model on the same endpoint is sent at once.

Before each request a run asks the gate, which reads both views of its model
in one step: both up (send), either down until a time still to come (wait for
it), or a view's wait over: the first run to ask sends one request, that view's
probe, and the others wait for its answer. A transient error marks its view
down for an exponential backoff with jitter, from `SUBQ_MODEL_BACKOFF_BASE_S` up
to `SUBQ_MODEL_BACKOFF_MAX_S`, or for as long as the provider asked when that is
longer (the rule is `endpoint_failed.lua`'s; this module reads its answer). An
answer (a response, or a refusal) clears the host's view and its model's, and
wakes the runs parked on them; an HTTP error clears the host's view too (the
host answered), while it marks the model's.

A run whose wait is short sleeps through it; a longer one gives its worker back
(`park`): its conversation is saved, its lease and run slot are freed, and a timer
(`provider-wait:<task id>`, served by the reconciler like an approval's deadline)
publishes its run again when the view it waits for may be tried, or at once when
another run finds that view back. How long a run keeps waiting before it fails is
its profile's `model_wait_out_s`, counted from its first failure (kept on the
task across parks, as are its failed attempts: `transient_errors` on the record,
and the attempt number of the `wait_out` line). The worker's side of this is
workers/runtime/providers.py.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from coordinator import approvals, dispatch
from coordinator.errors import NotFoundError
from coordinator.models import TaskStatus
from coordinator.replies import HOST, MODEL, EndpointState

if TYPE_CHECKING:
    from coordinator.models import TaskRecord
    from coordinator.plane import Plane

__all__ = [
    "HOST",
    "KEEP_MS",
    "MODEL",
    "PROBE_LEASE_MS",
    "PROBE_RECHECK_MS",
    "PROVIDER_TIMER",
    "EndpointState",
    "failed",
    "gate",
    "park",
    "recovered",
    "timer",
    "wake",
]

log = logging.getLogger(__name__)

# The timer kind of a parked run (`provider-wait:<task id>`), served by the reconciler.
PROVIDER_TIMER = "provider-wait"
# A probe holds the endpoint's one try at most this long: a probe lost with its worker, or stopped
# mid-request, lets another run try after it (a long generation may then see a second probe).
PROBE_LEASE_MS = 30_000
# Runs waiting for another run's probe ask again this often (a probe's answer takes one request).
PROBE_RECHECK_MS = 1_000
# An endpoint's state outlives its last wait by an hour, then it is forgotten (as up): a provider
# nobody calls any more leaves nothing behind, and one that is called again is probed by its next request.
KEEP_MS = 3_600_000


def timer(task_id: str) -> str:
    return f"{PROVIDER_TIMER}:{task_id}"


def gate(plane: Plane, endpoint: str, model: str, token: str) -> EndpointState:
    """Whether a request to `model` at `endpoint` may go now; the run `token` becomes the probe when one is due."""
    return plane.store.endpoints.gate(endpoint, model, token, PROBE_LEASE_MS, PROBE_RECHECK_MS)


# The longest wait a provider's Retry-After marks a view down for, fleet-wide. `Retry-After: 1000000000` (or an
# HTTP date of the year 9999) marked the model down for decades: no request was sent to it again, so no answer
# could clear it, and every task of it failed at once. Past this, one probe asks again.
MAX_ASKED_WAIT_S = 3600.0


def failed(plane: Plane, endpoint: str, model: str, error: str, asked_s: float | None) -> EndpointState:
    """Mark a view of `endpoint` down after a transient error: `model`'s, or with "" its host's (`asked_s`:
    the provider's Retry-After); the wait, as endpoint_failed.lua decided it."""
    settings = plane.settings
    return plane.store.endpoints.failed(
        endpoint,
        model,
        error,
        base_ms=max(1, int(settings.model_backoff_base_s * 1000)),
        cap_ms=max(1, int(settings.model_backoff_max_s * 1000)),
        jitter=random.random(),
        asked_ms=None if asked_s is None else max(0, int(min(asked_s, MAX_ASKED_WAIT_S) * 1000)),
        keep_ms=KEEP_MS,
    )


def recovered(plane: Plane, endpoint: str, model: str = "") -> None:
    """`endpoint` answered a request of `model` (with "": it answered, of a model whose own view stays as
    it is): forget those views' failures, and wake the runs parked on them now."""
    parked = plane.store.endpoints.recovered(endpoint, model)
    if parked:
        plane.store.endpoints.wake_now([timer(task_id) for task_id in parked])
        log.info("subq: %s%s is back; waking %d parked runs", endpoint, f" ({model})" if model else "", len(parked))


def park(
    plane: Plane, task: TaskRecord, endpoint: str, model: str, wake_at_s: float, since_ms: int, token: str = ""
) -> bool:
    """Before a run gives its worker back to wait for a view of `endpoint` (`model`'s, or with "" its
    host's): its timer, and its first wait's time; only while the run of lease `token` holds the lease ('' for
    a park no run makes). False, with nothing written, when it does not."""
    keep_s = KEEP_MS / 1000 + max(0.0, wake_at_s - since_ms / 1000)
    return plane.store.endpoints.park(endpoint, model, task.id, timer(task.id), wake_at_s, since_ms, keep_s, token)


def wake(plane: Plane, task_id: str) -> None:
    """A parked run's timer is due: publish its run again (the reconciler's step; idempotent).

    The timer acts only while the task still waits for its provider: `provider_wait_since_ms` is set at the
    park and cleared by the first answer a run of it gets. A timer served twice (a tick that failed after
    this step and before the served timers were removed) can come due again after the woken run was
    answered and then parked on an approval or delegated: publishing then would run the task again beside
    its pending approval (a second approval of the same call), so such a timer is dropped.
    """
    try:
        record = plane.store.records.get_task(task_id)
    except NotFoundError:
        return  # its tree has expired
    if record.status.terminal or record.status == TaskStatus.DELEGATED:
        return  # stopped while it waited (the stop ended it), or waits for its children (their batch resumes it)
    if approvals.undecided(plane, task_id):
        return  # waits for a person: a decision, or its expiry timer, resumes it
    if plane.store.endpoints.wait_since_ms(task_id) is None:
        return  # a run of it was answered since it parked: the wait this timer ends is over
    if plane.store.convergence.triage([task_id])[0].leased:
        # A run of it holds the lease: one woken twice, or the run that parked it and has not let its
        # lease go yet. Its timer is set again for after the grace, and the tick keeps it (its time
        # moved); a watch would not do, as the parking run's release unwatches the task. Never earlier
        # than it is set: a newer park's later wake time stands.
        plane.store.convergence.add_timer(timer(task_id), time.time() + plane.settings.reconcile_grace_s, later=True)
        return
    plane.store.convergence.watch([task_id], plane.settings.reconcile_grace_s)  # first: a lost publish is redone
    # Said before the publish: the run it starts may write `running` first, which a later `queued` would cover.
    plane.store.events.set_live(record, "queued")
    dispatch.publish_restart(plane.app, record)

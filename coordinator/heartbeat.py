"""A worker process's heartbeat: it renews the leases of the runs it holds, and drains them on shutdown.

Each beat also adds the latencies its runs measured since the last one to the fleet's
model-latency histogram (`LatencyTally`), in one round trip of its own rather than inside
each run's end; and records the spend its runs could not write because Redis was away
(`LateSpends`), until Redis takes it.

A run's lease (`<p>:{root}:lease:<task>`) lives `SUBQ_HEARTBEAT_LAPSE_S` and is
renewed every third of that by one thread per process, for all of its runs at
once (`renew_leases.lua`), beside the process's entry in `<p>:workers`. A
process that dies stops renewing, so its runs' leases lapse within the lapse
and the reconciler publishes those runs again. A lease found lost (the process
was cut off from Redis for longer than the lapse, and another run may own the
task now) fences its run: `Run.fenced`, after which it writes nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from coordinator import budgets, quotas
from coordinator.models import Spend, TaskRecord, format_usd

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["HAND_BACK_MARGIN_S", "LATE_SPEND_KEEP_S", "Heartbeat", "LateSpends", "LatencyTally", "Leased"]

log = logging.getLogger(__name__)

# A draining run whose model request is still in flight this close to the end of the grace
# abandons the request, so that it is handed back before the worker is killed.
HAND_BACK_MARGIN_S = 3.0
# How long a process keeps trying to record its runs' spend that Redis refused (LateSpends): as long as a delivery's
# retries wait out an outage (workers/tasks.py, about a quarter of an hour). Past it the spend is logged as lost.
LATE_SPEND_KEEP_S = 900.0


class LatencyTally:
    """The model requests' latencies (ms) one process's runs measured and its heartbeat has not added yet.

    Its runs count each response here, in memory, and the heartbeat (the thread that renews the
    runs' leases while the process holds any) adds what it holds to the fleet's histogram at each
    beat and when it stops (`MetricStore.add_latencies`, one round trip), not each run's steps: two
    increments inside a child's end were 3.6% of the server's instructions for the child's two steps
    (docs/benchmarks.md, "The latency histogram off a child's steps"). It is a monitoring figure, not
    a task's state: it lags by at most a beat; a process killed outright loses the latencies of its
    last beat, as it loses its own Prometheus histogram (workers/observe.py); an add Redis refused
    waits for the next beat (or, after the last run, the next run or the worker's shutdown); and an
    add whose reply was lost and which the connection sends again counts twice.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies_ms: list[float] = []

    def observe(self, latency_ms: float) -> None:
        with self._lock:
            self._latencies_ms.append(latency_ms)

    def take(self) -> list[float]:
        """What it holds, left empty."""
        with self._lock:
            taken, self._latencies_ms = self._latencies_ms, []
        return taken

    def put_back(self, latencies_ms: list[float]) -> None:
        """What `take` gave and Redis did not take: added with the next beat."""
        with self._lock:
            self._latencies_ms.extend(latencies_ms)


@dataclass
class _Owed:
    """Spend of a run that Redis refused, and since when (monotonic s)."""

    task: TaskRecord
    spends: tuple[Spend, ...]
    refused: bool  # a stop's refusal (recording it clears the task's mark), or a step Redis failed
    since: float
    warned: bool = False  # a refusal was logged: once an item, not at every beat

    def __str__(self) -> str:
        tokens = sum(spend.usage.tokens_in + spend.usage.tokens_out for spend in self.spends)
        cost = format_usd(sum(spend.cost_micros for spend in self.spends))
        return f"{len(self.spends)} response(s) of {self.task.id}, {tokens} tokens, {cost}"


class LateSpends:
    """Spend of this process's runs that Redis refused, which its heartbeat records at each beat until Redis takes
    it, for LATE_SPEND_KEEP_S at most (record_late_spend.lua, once per request key, on a task stopped or not).

    Two moments leave a run's spend (responses its provider billed) in the worker alone. A stopped run reads in
    its step's reply that the stop refused the spend, and records it next (`Run._spent_before_the_stop`): with
    Redis away just then, its retried delivery finds the task stopped and runs nothing. And a step that Redis
    failed leaves the spend the run held for it (`Run.abandon`): the retried delivery makes those requests again
    (billed again, recorded again under the new run's keys), knowing nothing of this run's. Kept here, either is
    recorded once Redis is back, a beat later at most; one its step had written before its reply was lost is
    written once. A process killed meanwhile loses it, as it loses a response it had not written
    (docs/architecture.md, "Known gaps"). An item stays here until it is recorded or given up, so the process
    sees it owed while a beat tries it; one `record` at a time, so the shutdown's last try waits for a beat's."""

    def __init__(self, budget_stopped: Callable[[TaskRecord], None] | None = None) -> None:
        self._lock = threading.Lock()  # guards `_owed`
        self._recording = threading.Lock()  # one `record` at a time
        self._owed: list[_Owed] = []
        # Told of each subtree a recorded spend stopped (the worker counts it: `RunHooks.budget_stopped`).
        self._budget_stopped = budget_stopped or (lambda task: None)

    def owe(self, task: TaskRecord, spends: Sequence[Spend], *, refused: bool) -> None:
        with self._lock:
            self._owed.append(_Owed(task, tuple(spends), refused, time.monotonic()))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._owed)

    def record(self, plane: Plane, *, last: bool = False) -> None:
        """Record what is owed, in order, until Redis refuses one (each refusal costs the client's retries, so the
        rest wait for the next beat with it). An item refused, or left behind a refusal, is kept; or logged as
        lost when it has been kept LATE_SPEND_KEEP_S, or when this is the process's `last` try (its shutdown)."""
        with self._recording:
            with self._lock:
                owed = list(self._owed)
            settled: set[int] = set()
            refusal: Exception | None = None
            for item in owed:
                if refusal is None:
                    try:
                        # Into its tenant's day first (once per request key, however often it is counted): a run
                        # whose count Redis refused mid-response left it owed here, and its day fell short of it.
                        for spend in item.spends:
                            quotas.count_spend(plane, item.task, spend.request_key, spend.cost_micros)
                        recorded = plane.store.runs.record_late_spend(item.task, item.spends, refused=item.refused)
                    except Exception as exc:  # Redis is still away (or refuses): the next beat tries again
                        refusal = exc
                    else:
                        settled.add(id(item))
                        log.info("subq: recorded the spend of %s, which Redis had refused", item)
                        if budgets.stop_late(plane, recorded.exhausted):
                            self._budget_stopped(item.task)
                        continue
                if last or time.monotonic() - item.since >= LATE_SPEND_KEEP_S:
                    settled.add(id(item))
                    log.error("subq: lost the spend of %s: Redis refused it: %s", item, refusal)
                elif not item.warned:
                    item.warned = True
                    log.warning(
                        "subq: could not record the spend of %s yet, tried again at each beat: %s", item, refusal
                    )
            with self._lock:
                self._owed = [item for item in self._owed if id(item) not in settled]


class Leased(Protocol):
    """A run as the heartbeat sees it: its task, its lease token, and its fence."""

    token: str
    fenced: bool

    @property
    def task_id(self) -> str: ...


class Heartbeat:
    """The runs one process holds, their lease renewal, and the shutdown deadline."""

    def __init__(
        self, plane: Plane, worker_id: str, budget_stopped: Callable[[TaskRecord], None] | None = None
    ) -> None:
        self.plane = plane
        self.worker_id = worker_id
        # By lease token, not task id: a task's newer run (published again while an older run of it
        # stalled past its lapse) may be held here beside the older one, and each is fenced on its own.
        self._runs: dict[str, Leased] = {}
        # The tokens of runs inside their end step: the end script checks the lease itself (and deletes
        # it), so a renewal that finds it gone meanwhile says nothing of a lost lease.
        self._ending: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drain_deadline: float | None = None
        self.latencies = LatencyTally()  # its runs' model requests, added to the fleet's histogram at each beat
        self.late_spends = LateSpends(budget_stopped)  # its runs' spend that Redis refused, recorded at each beat

    def hold(self, run: Leased) -> None:
        """Renew this run's lease from now on (the thread starts with the first run)."""
        with self._lock:
            self._runs[run.token] = run
            self._start_beating()

    def owe(self, task: TaskRecord, spends: Sequence[Spend], *, refused: bool) -> None:
        """Spend of a run that Redis refused: recorded at the next beats (the thread beats while any is owed, runs
        or none). `refused`: spend a step refused for a stop (LateSpends)."""
        self.late_spends.owe(task, spends, refused=refused)
        with self._lock:
            self._start_beating()

    def _start_beating(self) -> None:
        if self._thread is None:  # (under the lock)
            self._thread = threading.Thread(target=self._beat, name="subq-heartbeat", daemon=True)
            self._thread.start()

    def forget(self, run: Leased) -> None:
        with self._lock:
            if self._runs.get(run.token) is run:
                del self._runs[run.token]
            self._ending.discard(run.token)

    @contextmanager
    def ending(self, run: Leased) -> Iterator[None]:
        """`run`'s end step: from here a renewal that finds its lease gone neither fences nor warns.

        The end script checks the lease itself and deletes it, so a renewal racing it (its
        list read before, its script run after) must not read the deleted lease as lost. It
        holds until `forget`; an end step that raised leaves the run renewed as before.
        """
        with self._lock:
            self._ending.add(run.token)
        try:
            yield
        except BaseException:
            with self._lock:
                self._ending.discard(run.token)
            raise

    def renew(self) -> None:
        """Renew the leases of this process's runs (and its heartbeat); a lost one fences its run."""
        with self._lock:
            held = [(run.task_id, token) for token, run in self._runs.items()]
        for task_id, token in self.plane.store.convergence.renew_leases(
            held, self.plane.settings.heartbeat_lapse_s, self.worker_id
        ):
            with self._lock:
                run = None if token in self._ending else self._runs.get(token)
            if run is not None and not run.fenced:
                run.fenced = True
                log.warning("subq: the lease of %s lapsed; its run stops and writes nothing more", task_id)

    def add_latencies(self) -> None:
        """Add the latencies measured since the last beat to the fleet's histogram; kept for the next on failure."""
        latencies_ms = self.latencies.take()
        if not latencies_ms:
            return
        try:
            self.plane.store.metrics.add_latencies(latencies_ms)
        except Exception as exc:  # Redis is down: the next beat adds them
            self.latencies.put_back(latencies_ms)
            log.warning("subq: could not add %d model latencies to the fleet's histogram: %s", len(latencies_ms), exc)

    def drain(self, grace_s: float) -> None:
        """The worker is shutting down: every run hands itself back within `grace_s`."""
        self._drain_deadline = time.monotonic() + grace_s
        log.warning("subq: shutting down; %d run(s) hand back within %.0f s", len(self._runs), grace_s)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def out_of_grace(self) -> bool:
        """A draining run must abandon its model request now, or it would not be handed back in time."""
        deadline = self._drain_deadline
        return deadline is not None and time.monotonic() >= deadline - HAND_BACK_MARGIN_S

    def _beat(self) -> None:
        """Renew until no run is held and no spend is owed; `hold` (or `owe`) starts the thread again."""
        every_s = self.plane.settings.heartbeat_lapse_s / 3
        while True:
            time.sleep(every_s)
            with self._lock:
                idle = not self._runs
                last = idle and not self.late_spends
                if last:
                    self._thread = None
            if not idle:
                try:
                    self.renew()
                except Exception as exc:  # Redis is down: the leases lapse, and the runs are fenced
                    log.warning("subq: heartbeat failed: %s", exc)
            # After the leases (a slow add must not hold a renewal up), and after the decision to end, so a latency
            # or a late spend from before it is added now: a later one is a run's that `hold` (or `owe`) gave a
            # thread of its own.
            self.late_spends.record(self.plane)
            self.add_latencies()
            if last:
                return

"""What a sync tool's thread holds past its call: the fleet-wide tool slot the call took.

A sync function tool runs on a thread of the process's pool (`agent_loop.SYNC_CALL_THREADS`). When its
call ends without it (its timeout, or its run stopped), the run goes on, but Python cannot stop the
thread: it runs on. Freeing the call's slot then would let another call of the same tool start beside
it, past the profile's `tool_limits`. So a call's slot is a `SlotHold`: the call lets it go as it ends,
and the slot is freed once the call and every thread it started have ended (at the latest, the slot's
lease lapses: the call's timeout plus a margin, as for a worker that died).

The pool (`HoldingExecutor`) counts each thread against the hold of the call that submitted it, which it
reads from a context variable the call sets (pydantic-ai submits a sync tool to the pool from inside the
call's own task).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["HoldingExecutor", "SlotHold", "holding"]

log = logging.getLogger(__name__)


class SlotHold:
    """A slot, freed (`free`, once) when its call has let it go and none of the call's threads runs."""

    def __init__(self, free: Callable[[], None]) -> None:
        self._free = free
        self._lock = threading.Lock()
        self._threads = 0
        self._let_go = False

    def thread_started(self) -> None:
        with self._lock:
            self._threads += 1

    def thread_ended(self) -> None:
        with self._lock:
            self._threads -= 1
            now = self._let_go and self._threads == 0
        if now:
            # Called back by the pool, which would only print what this raised: say what it means.
            try:
                self._free()
            except Exception as exc:
                log.warning("a tool slot stays held until its lease lapses: its free failed (%s)", exc)

    def let_go(self) -> None:
        """The call has ended: free the slot now, or when its last thread ends."""
        with self._lock:
            self._let_go = True
            now = self._threads == 0
        if now:
            self._free()


_held: contextvars.ContextVar[SlotHold | None] = contextvars.ContextVar("subq_slot_hold", default=None)


@contextmanager
def holding(hold: SlotHold) -> Iterator[None]:
    """Within the call: the threads it starts hold `hold`; let go as the call ends."""
    token = _held.set(hold)
    try:
        yield
    finally:
        _held.reset(token)
        hold.let_go()


class HoldingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The pool of sync tool threads: a thread submitted within a call that holds a slot holds it until it
    returns, even after the call has ended without it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        hold = _held.get()
        if hold is None:
            return super().submit(fn, *args, **kwargs)
        hold.thread_started()
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            hold.thread_ended()
            raise
        future.add_done_callback(lambda _done: hold.thread_ended())
        return future

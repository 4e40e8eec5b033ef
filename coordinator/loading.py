"""`loading()`: the cyclic collector off while a process loads its modules (a worker, `subq api`, a CLI command);
`freeze_loaded()`: what a long-lived process loaded, out of every later collection."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["freeze_loaded", "loading"]


@contextmanager
def loading() -> Iterator[None]:
    """The cyclic collector off while a process loads the service, its settings, the API or the worker.

    Those imports make about a million objects that live as long as the process, and the full
    collections their growth sets off collect nothing: about a tenth of the CPU of a start on 2
    cores (issue 43, point 5). Never around a process's own work: it collects as usual after.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def freeze_loaded() -> None:
    """Move every object a long-lived server has made so far (`subq api`, once it has loaded) out of the
    collector's reach (`gc.freeze`), as a worker does at its start (workers/runtime/agent_loop.py, `tune_gc`).

    A wide delegation makes thousands of objects that outlive the call (its records), and their number sets off
    a full collection of the whole heap every other call: about 70 ms at width 1000 in a process of 120 K
    objects, on the delegation's path before its first child is published; 1-2 ms with the loaded heap frozen
    (docs/benchmarks.md). Never in a process subq does not own (a service using `Coordinator`).
    """
    gc.freeze()

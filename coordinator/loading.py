"""`loading()`: the cyclic collector off while a process loads its modules (a worker, `subq api`, a CLI command)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["loading"]


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

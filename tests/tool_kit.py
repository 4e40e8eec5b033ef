"""Tools the tests' profiles name by import path, as a deployment's profile names its own.

Worker processes import them at start (`tests.tool_kit:<name>`), so each is a
plain module attribute; `MARKS` is a folder the side-effecting tool writes into,
so a test counts the effects from outside the run.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic_ai import ModelRetry, RunContext, ToolReturn
from pydantic_ai.toolsets import FunctionToolset

from workers.runtime.profile_tools import idempotency_key

NOT_A_TOOL = 42


def add_numbers(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


def leave_mark(ctx: RunContext[object], label: str) -> str:
    """Leave a mark file named `label` (a side effect a test counts from outside)."""
    folder = Path(os.environ["TOOL_KIT_MARKS"])
    mark = folder / f"{label}.{ctx.tool_call_id}"
    mark.write_text("1", encoding="utf-8")
    return f"marked {label}"


def update_todo_list(todos: str) -> str:
    """A tool that takes the name of one of subq's own."""
    return todos


kit: FunctionToolset[object] = FunctionToolset()


@kit.tool_plain
def shout(text: str) -> str:
    """Say it louder."""
    return text.upper()


async def slow_mark(ctx: RunContext[object], label: str, seconds: float) -> str:
    """Wait, then leave a mark: a side effect that takes a while (and is not safe to repeat)."""
    await asyncio.sleep(seconds)
    (Path(os.environ["TOOL_KIT_MARKS"]) / f"{label}.{ctx.tool_call_id}.{time.monotonic_ns()}").write_text("1")
    return f"marked {label} slowly"


async def settle(ctx: RunContext[object], label: str, seconds: float) -> str:
    """Wait, then leave a mark: declared idempotent (its effect may be made twice)."""
    await asyncio.sleep(seconds)
    (Path(os.environ["TOOL_KIT_MARKS"]) / f"{label}.{ctx.tool_call_id}.{time.monotonic_ns()}").write_text("1")
    return f"settled {label}"


async def refresh(ctx: RunContext[object], label: str, seconds: float) -> str:
    """Wait, then leave a mark: a plain function that a profile declares idempotent (`idempotent_tools`)."""
    await asyncio.sleep(seconds)
    (Path(os.environ["TOOL_KIT_MARKS"]) / f"{label}.{ctx.tool_call_id}.{time.monotonic_ns()}").write_text("1")
    return f"refreshed {label}"


async def linger(ctx: RunContext[object], label: str, seconds: float) -> str:
    """Leave a mark as it starts, then wait: declared idempotent (a test stops its run while it waits)."""
    (Path(os.environ["TOOL_KIT_MARKS"]) / f"{label}.started").write_text("1")
    await asyncio.sleep(seconds)
    return f"lingered {label}"


# A tool kit whose `settle` and `linger` are declared idempotent, as a deployment declares one (pydantic-ai's tool metadata).
journal_kit: FunctionToolset[object] = FunctionToolset()
journal_kit.add_function(slow_mark)
journal_kit.add_function(settle, metadata={"idempotent": True})
journal_kit.add_function(linger, metadata={"idempotent": True})


def explode(reason: str) -> str:
    """Fail, as a tool whose backend is down does."""
    raise ValueError(reason)


@contextmanager
def _one_of_the_crowd() -> Iterator[None]:
    """Be one of the calls running now, and note how many ran at once (across processes)."""
    folder = Path(os.environ["TOOL_KIT_MARKS"]) / "crowd"
    folder.mkdir(exist_ok=True)
    me = folder / f"{os.getpid()}-{time.monotonic_ns()}"
    me.write_text("1")
    try:
        with (folder.parent / "crowd.log").open("a") as log:
            log.write(f"{len(list(folder.iterdir()))}\n")
        yield
    finally:
        me.unlink()


async def crowd(seconds: float) -> str:
    """Be one of the calls running now for `seconds`, and note how many ran at once (across processes)."""
    with _one_of_the_crowd():
        await asyncio.sleep(seconds)
    return "done"


def crowd_in_a_thread(seconds: float) -> str:
    """`crowd` as a plain function: it runs on a thread of the worker's pool, which no timeout stops."""
    with _one_of_the_crowd():
        time.sleep(seconds)
    return "done"


def paid_search(query: str) -> ToolReturn:
    """A search that costs money per call, and says what this call cost (its task's own spend)."""
    return ToolReturn(f"results for {query}", metadata={"cost_usd": "0.0125"})


def confused_bill(query: str) -> ToolReturn:
    """A tool whose reported cost is not a number of dollars: the call's result stands, nothing is charged."""
    return ToolReturn(f"billed {query}", metadata={"cost_usd": "-3"})


def charge_card(ctx: RunContext[object], amount: int) -> str:
    """Call a payment API with the call's idempotency key, as a tool with an external effect should."""
    return f"charged {amount} with key {idempotency_key(ctx)}"


def even_only(n: int) -> str:
    """Take an even number; an odd one asks the model to call again (pydantic-ai's ModelRetry)."""
    if n % 2:
        raise ModelRetry(f"{n} is odd: call even_only with an even number")
    return f"{n} is even"

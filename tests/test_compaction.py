"""A context that never overflows (issue 34, point 2): compaction before a request, after a provider's refusal,
durable across a worker's death, priced as the task's own spend; tool results capped; bad settings refused.

The end-to-end tests run real `celery worker` processes against `tests/model_server.py` on loopback, a server
with a 6,000-token window that refuses a longer prompt as OpenAI does (400 `context_length_exceeded`), and
count what reached it from the outside: the requests it recorded, each with the tokens it counted and billed.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.local.fleet import WorkerFleet
from coordinator.settings import Price, Profile
from tests.compaction_kit import CHUNK_BYTES
from tests.conftest import dedicated_fleet
from tests.model_server import ModelServer, Seen, Turn, call

# Issue 34's figures: six results of 8 KB, on a model whose server refuses prompts over 6,000 tokens.
WINDOW = 6_000
CHUNKS = 6
PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
# What the model says beside each call: an agent's notes, which compaction must fold (not only elide).
NOTES = "Noted the figures of this chunk; they go into the report's table. " * 20


def turns(chunks: int = CHUNKS) -> list[Turn]:
    return [Turn(text=f"{NOTES}(chunk {n})", calls=[call("read_chunk", n=n)]) for n in range(chunks)] + [
        Turn(calls=[call("attempt_completion", result=f"read {chunks} chunks")])
    ]


def micros(seen: list[Seen], price: Price = PRICE) -> int:
    """The cost of every answered request at `price`, from what the server billed."""
    total = sum(s.usage[0] * price.input_per_mtok + s.usage[1] * price.output_per_mtok for s in seen if s.status == 200)
    return int(Decimal(total).quantize(Decimal(1)))


def windowed(server: ModelServer, **fields: Any) -> Profile:
    return Profile.model_validate({
        "model": "openai:test-model", "base_url": server.base_url, "api_key": server.key, "price": PRICE,
        "tools": ["tests.compaction_kit:read_chunk"], "context_window": WINDOW, **fields,
    })  # fmt: skip


class Fleet(NamedTuple):
    coord: Coordinator
    server: ModelServer


@pytest.fixture(scope="module")
def fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    server = ModelServer(turns(), max_prompt_tokens=WINDOW, by_call_ids=True).start()
    profiles = {
        "windowed": windowed(server),
        # The offline model with a small window: a long script compacts (docs/offline-model.md).
        "offline-small": Profile(tools=["tests.compaction_kit:read_chunk"], context_window=4_000),
    }
    own = settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})
    try:
        with dedicated_fleet(own, tmp_path_factory.mktemp("compaction"), 1, queue="subq-compaction") as (coord, _):
            yield Fleet(coord, server)
    finally:
        server.stop()


def _compacted(coord: Coordinator, task_id: str) -> list[str]:
    return [m["text"] for m in coord.messages(task_id) if m.get("say") == "context_compacted"]


def _records(coord: Coordinator, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(r) for r in coord.store.compaction.records(task_id)]


def test_a_child_whose_tool_results_pass_the_window_completes_within_it_and_pays_for_its_summaries(
    fleet: Fleet,
) -> None:
    coord, server = fleet
    server.seen.clear()
    parent = coord.create_task("Read the report", todos="[ ] read every chunk")
    (item,) = coord.get_todos(parent.id)
    message = f"Read the report's {CHUNKS} chunks with read_chunk, one at a time, and say how many you read."
    batch = coord.delegate(parent.id, [{"description": "read", "message": message, "profile": "windowed"}])
    (child_id,) = batch.child_ids

    child = coord.wait(child_id, 120)

    assert child.status == TaskStatus.COMPLETED, (child.error, coord.messages(child_id))
    assert child.summary == f"read {CHUNKS} chunks"
    seen = list(server.seen)
    over = [s for s in seen if s.prompt_tokens > WINDOW]
    assert len(over) <= 1, f"requests over the window: {[s.prompt_tokens for s in over]}"
    # Every chunk was read, whole, by the tool; what the model read of the older ones was compacted.
    agent_requests = [s for s in seen if s.status == 200 and not s.summarising]
    assert len(agent_requests) == CHUNKS + 1
    summaries = [s for s in seen if s.status == 200 and s.summarising]
    assert summaries, "older turns were folded into a summary the model wrote"
    lines = _compacted(coord, child_id)
    assert lines and all("context compacted: ~" in line and " -> ~" in line for line in lines)
    records = _records(coord, child_id)
    assert len(records) == len(lines) and [r["number"] for r in records] == list(range(1, len(records) + 1))
    assert all(r["tokens_after"] < r["tokens_before"] for r in records)
    # The journal is the whole transcript: every 8 KB result, as the tool returned it.
    journal = coord.messages(child_id, kind="api")
    results = [p for m in journal for p in m.get("parts", []) if p.get("part_kind") == "tool-return"]
    assert [len(p["content"]) for p in results if p["tool_name"] == "read_chunk"] == [CHUNK_BYTES] * CHUNKS
    # The cost: every answered request, summaries included, at the profile's price, on the parent's plan item.
    record = coord.get_task(child_id)
    assert record.requests == len(agent_requests) + len(summaries)
    assert record.cost_micros == micros(seen) > 0
    assert record.tokens_in == sum(s.usage[0] for s in seen if s.status == 200)
    (item,) = coord.get_todos(parent.id)
    assert item.cost_micros == record.total_cost_micros == record.cost_micros
    assert record.times is not None and len(record.times.compactions_ms) == len(records)
    assert record.times.runs == 1, "a compaction is a point of its run, not a new one"


# -- a worker killed right after a compaction -------------------------------------------------------------

LAPSE_S = 3
FAULT_SETTINGS = {
    "heartbeat_lapse_s": LAPSE_S, "reconcile_interval_s": 0.5, "reconcile_grace_s": 3, "task_time_limit_s": 60,
    "visibility_timeout_s": 300,  # far beyond the test: the reconciler, not the broker, gives the run to the rescuer
}  # fmt: skip
PLAN = "[-] read the chunks\n[ ] write the table"


def test_a_worker_killed_right_after_a_compaction_leaves_a_run_that_goes_on_from_the_compacted_context(
    settings: Settings, tmp_path: Path
) -> None:
    assert settings.redis_url
    plan_turn = Turn(calls=[call("update_todo_list", todos=PLAN)])
    read = [Turn(text=f"{NOTES}(chunk {n})", calls=[call("read_chunk", n=n)]) for n in range(CHUNKS)]
    done = Turn(calls=[call("attempt_completion", result="table written")])
    with ModelServer([plan_turn, *read, done], max_prompt_tokens=WINDOW, by_call_ids=True) as server:
        own = settings.model_copy(update={
            **FAULT_SETTINGS, "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/3", "queue": "subq-cfault",
            "profiles": {**settings.profiles, "windowed": windowed(server)},
        })  # fmt: skip
        with dedicated_fleet(own, tmp_path / "rescuer", 1, queue="subq-crescue") as (_rescue, _):
            crashing = WorkerFleet(
                own.model_copy(update={"fault_crash_at": "after-compaction"}), 1, tmp_path, name="crash"
            )
            coord = Coordinator(own)
            try:
                crashing.wait_ready()
                task = coord.create_task("Read the report's chunks and write the table.", profile="windowed", run=True)
                crashing.procs[0].wait(timeout=60)
                assert crashing.procs[0].returncode == -signal.SIGKILL, crashing.logs[0].read_text(errors="replace")[
                    -2000:
                ]
                (first,) = _records(coord, task.id)  # kept, with its line, before the worker died
                died_at = time.monotonic()
                asked_before = len(server.seen)
                finished = coord.wait(task.id, 90)
            finally:
                crashing.stop()
            assert finished.status == TaskStatus.COMPLETED and finished.summary == "table written", finished.error
            records = _records(coord, task.id)
            assert records[0] == first
            numbers = [r["number"] for r in records]
            assert numbers == list(range(1, len(records) + 1)), "one record a compaction, none written twice"
            assert all(
                later["elided_upto"] > earlier["elided_upto"] or later["folded_upto"] > earlier["folded_upto"]
                for earlier, later in itertools.pairwise(records)
            ), "each compaction folds or elides turns no earlier one had"
            # The rescuer's first request is the compacted view the dead worker kept: the results before its
            # boundary elided, and no request over the window ever reached the server.
            after = [s for s in server.seen[asked_before:] if not s.summarising]
            assert after and after[0].at_s >= died_at
            sent = json.dumps(after[0].body["messages"])
            assert "[result elided to keep the conversation within the model's context window" in sent
            assert all(s.prompt_tokens <= WINDOW for s in server.seen)
            # The plan is kept: in the journal as the model wrote it, on the task, and in every folded view sent.
            assert [i.content for i in coord.get_todos(task.id)] == ["read the chunks", "write the table"]
            folded = [s for s in server.seen if "[Context compacted:" in json.dumps(s.body["messages"])]
            assert folded and all("read the chunks" in json.dumps(s.body["messages"]) for s in folded)
            assert any(r["plan"] == PLAN for r in records if r["folded_upto"] > 1), "a summary carries the plan"
            assert len(_compacted(coord, task.id)) == len(records)
            assert finished.cost_micros == micros(server.seen)
            coord.close()

"""A context that never overflows (issue 34, point 2): compaction before a request, after a provider's refusal,
durable across a worker's death, priced as the task's own spend; tool results capped; bad settings refused.

The end-to-end tests run real `celery worker` processes against `tests/model_server.py` on loopback, a server
with a 6,000-token window that refuses a longer prompt as OpenAI does (400 `context_length_exceeded`), and
count what reached it from the outside: the requests it recorded, each with the tokens it counted and billed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections.abc import Iterator, Sequence
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, NamedTuple

import pydantic
import pytest
from pydantic_ai import BinaryContent, ImageUrl, ToolReturn
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters

from coordinator import Coordinator, Settings, TaskStatus, endpoints
from coordinator.celery_app import make_app
from coordinator.local.fleet import WorkerFleet
from coordinator.settings import Price, Profile
from coordinator.timeline import Timeline, times_of
from tests import agents, helpers
from tests.compaction_kit import CHUNK_BYTES, read_chunk
from tests.conftest import dedicated_fleet
from tests.model_server import ModelServer, Seen, Turn, call, prompt_tokens_of
from workers.runtime.compaction import (
    CHARS_PER_TOKEN_ESTIMATE,
    COMBINED_RESULT_SHARE,
    MEDIA_TOKENS,
    CompactionRecord,
    Compactor,
    ContextTooSmall,
    combined_result_chars,
    compacted_view,
    estimate_tokens,
    fingerprint_of,
    fits,
    folded_responses,
    is_context_overflow,
    load_records,
    message_adapter,
    summary_request,
)
from workers.runtime.context import build_runtime
from workers.runtime.offline import OfflineModel
from workers.runtime.profile_tools import capped
from workers.runtime.providers import Route
from workers.runtime.runner import chain_window, run_child
from workers.runtime.script import script_message

# Issue 34's figures: six results of 8 KB, on a model whose server refuses prompts over 6,000 tokens.
WINDOW = 6_000
CHUNKS = 6
PLAN = "[-] read the chunks\n[ ] write the table"
PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
# The offline profile's window: two 8 KB results and the script's message pass its threshold.
OFFLINE_WINDOW = 8_000
MESSAGES: pydantic.TypeAdapter[list[ModelMessage]] = pydantic.TypeAdapter(list[ModelMessage])
# What the model says beside each call: an agent's notes, which compaction must fold (not only elide).
NOTES = "Noted the figures of this chunk; they go into the report's table. " * 20


def turns(chunks: int = CHUNKS) -> list[Turn]:
    return [Turn(text=f"{NOTES}(chunk {n})", calls=[call("read_chunk", n=n)]) for n in range(chunks)] + [
        Turn(calls=[call("attempt_completion", result=f"read {chunks} chunks")])
    ]


def micros(seen: list[Seen], price: Price = PRICE) -> int:
    """The cost of every answered request at `price`, from what the server billed (each priced to the micro-USD,
    rounding half up, as it is recorded)."""
    each = [s.usage[0] * price.input_per_mtok + s.usage[1] * price.output_per_mtok for s in seen if s.status == 200]
    return sum(int(Decimal(m).quantize(Decimal(1), rounding=ROUND_HALF_UP)) for m in each)  # to the micro each


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
        "offline-small": Profile(tools=["tests.compaction_kit:read_chunk"], context_window=OFFLINE_WINDOW),
        # The offline model reading at most 200 characters of a tool's result (not of its children's).
        "offline-capped": Profile(max_tool_output_chars=200),
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


# The offline model's long script: its plan, a chunk read per step, its completion (docs/offline-model.md).
LONG_SCRIPT = [
    {"tool_calls": [{"name": "update_todo_list", "args": {"todos": PLAN}}]},
    *({"tool_calls": [{"name": "read_chunk", "args": {"n": n}}]} for n in range(CHUNKS)),
    {"tool_calls": [{"name": "attempt_completion", "args": {"result": "all chunks read"}}]},
]


def test_the_offline_model_compacts_a_long_script_and_plays_every_step_in_order(fleet: Fleet) -> None:
    coord = fleet.coord
    steps = LONG_SCRIPT
    task = coord.create_task(script_message("Read the chunks.", steps), profile="offline-small", run=True)

    done = coord.wait(task.id, 120)

    assert done.status == TaskStatus.COMPLETED and done.summary == "all chunks read", done.error
    records = _records(coord, task.id)
    assert records and len(_compacted(coord, task.id)) == len(records)
    assert all(r["tokens_after"] < r["tokens_before"] for r in records)
    calls = [m["text"] for m in coord.messages(task.id) if m.get("say") == "tool"]
    assert [c for c in calls if c.startswith("read_chunk")] == [f'read_chunk({{"n": {n}}})' for n in range(CHUNKS)]
    # Its usage is estimated from what it was sent: the requests after a compaction were smaller.
    assert done.requests == len(steps) + sum(1 for r in records if r["folded_upto"] > 1)


def test_the_offline_model_counts_folded_responses_among_its_steps_and_writes_notes_for_a_summariser() -> None:
    steps = [{"tool_calls": [{"name": "read_chunk", "args": {"n": n}}]} for n in range(4)] + [{"reply": "done"}]
    history = _conversation(0)
    history[0] = ModelRequest(parts=[UserPromptPart(script_message("Read.", steps))])
    for _ in range(4):
        history += _conversation(1)[1:]
    record = CompactionRecord(
        number=1, at=0.0, reason="window", folded_upto=5, elided_upto=5, folded_responses=2, summary="notes",
        tokens_before=10, tokens_after=5, fingerprint="",
    )  # fmt: skip
    view = compacted_view(history, record.model_copy(update={"fingerprint": fingerprint_of(history[4])}))
    assert len(view) < len(history) and folded_responses(view) == 2
    answer = asyncio.run(OfflineModel().request(view, None, ModelRequestParameters()))
    assert answer.parts == [TextPart("done")], "step 4 (two responses folded, two sent) is played: the reply"

    transcript = 'Transcript:\n[agent calls] read_chunk({"n": 0})\n[read_chunk returned] chunk 0: ...'
    notes = asyncio.run(OfflineModel().request([summary_request(transcript)], None, ModelRequestParameters()))
    (part,) = notes.parts
    assert isinstance(part, TextPart) and 'read_chunk({"n": 0})' in part.content and notes.usage.input_tokens > 0


# -- a worker killed right after a compaction -------------------------------------------------------------

LAPSE_S = 3
FAULT_SETTINGS = {
    "heartbeat_lapse_s": LAPSE_S, "reconcile_interval_s": 0.5, "reconcile_grace_s": 3, "task_time_limit_s": 60,
    "visibility_timeout_s": 300,  # far beyond the test: the reconciler, not the broker, gives the run to the rescuer
}  # fmt: skip


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
            # The rescuer's first request is built on the compaction the dead worker kept: the first chunk's
            # result, which that compaction elided, is not sent whole again; no request over the window was sent.
            after = [s for s in server.seen[asked_before:] if not s.summarising]
            assert after and after[0].at_s >= died_at
            sent = json.dumps(after[0].body["messages"])
            assert '"content": "chunk 0: ' not in sent, "what the kept compaction took out is not sent again"
            assert all(s.prompt_tokens <= WINDOW for s in server.seen)
            # The plan is kept: in the journal as the model wrote it, on the task, and in every folded view sent.
            assert [i.content for i in coord.get_todos(task.id)] == ["read the chunks", "write the table"]
            folded = [s for s in server.seen if "[Context compacted:" in json.dumps(s.body["messages"])]
            assert folded and all("read the chunks" in json.dumps(s.body["messages"]) for s in folded)
            assert any(r["plan"] == PLAN for r in records if r["folded_upto"] > 1), "a summary carries the plan"
            assert len(_compacted(coord, task.id)) == len(records)
            assert finished.cost_micros == micros(server.seen)
            coord.close()


# -- the provider refuses a request as too long -----------------------------------------------------------


def _in_process(settings: Settings, profile: Profile, prefix: str) -> tuple[Coordinator, Settings]:
    """A coordinator of runs made in this process: a queue no worker reads, keys no session reconciler serves."""
    local = settings.model_copy(
        update={
            "queue": "subq-nobody",
            "key_prefix": f"subqcomp{prefix}",
            "profiles": {**settings.profiles, "w": profile},
        }
    )
    return Coordinator(local), local


def test_a_request_the_provider_refuses_as_too_long_is_compacted_and_sent_once_more(settings: Settings) -> None:
    """No window known to subq (none set, none the libraries know of `test-model`): the provider's refusal is
    the only sign, and each refused request is compacted and sent again, once; the task completes."""
    with ModelServer(turns(), max_prompt_tokens=WINDOW, by_call_ids=True) as server:
        coord, local = _in_process(settings, windowed(server, context_window=None), "refused")
        task = coord.create_task("Read the report's chunks.", profile="w", run=True)

        result = run_child(build_runtime(local, make_app(local)), task.id)

        assert result.status == "completed", result.error
        statuses = [s.status for s in server.seen if not s.summarising]
        refused = [i for i, status in enumerate(statuses) if status == 400]
        assert refused, "the server's window was passed"
        assert all(statuses[i + 1] == 200 for i in refused), "each refused request was answered once compacted"
        records = _records(coord, task.id)
        assert records and {r["reason"] for r in records} == {"provider"} and len(records) == len(refused)
        assert all("the provider refused the request as too long" in line for line in _compacted(coord, task.id))
        assert coord.get_task(task.id).cost_micros == micros(server.seen), "refused requests cost nothing"
        coord.close()


def test_a_compaction_made_after_a_provider_wait_is_kept_by_the_next_run_and_not_paid_for_again(
    settings: Settings,
) -> None:
    """A run that parks on a provider wait leaves its unanswered request last in the journal; the next run sends
    it again as a new copy (a new timestamp and run id). A compaction made on that copy named it by a hash of the
    copy, which matched no journal: the run after it set the record aside and paid for a summary of the same
    turns again."""
    endpoint_model = "openai:test-model"
    with ModelServer(turns(), max_prompt_tokens=WINDOW, by_call_ids=True) as server:
        coord, local = _in_process(settings, windowed(server, model_wait_out_s=120), "afterwait")
        coord.client.delete("subq-nobody")
        runtime = build_runtime(local, make_app(local))
        endpoint = f"127.0.0.1:{server.port}"

        def park_after_two_answers() -> None:
            server.fail(200, times=2)
            server.fail(503, times=1, headers={"Retry-After": "30"})

        park_after_two_answers()
        task = coord.create_task("Read the report's chunks.", profile="w", run=True)
        assert run_child(runtime, task.id).status == "queued", "the first run parks on its third request"
        park_after_two_answers()
        endpoints.recovered(coord.plane, endpoint, endpoint_model)
        endpoints.wake(coord.plane, task.id)
        assert run_child(runtime, task.id).status == "queued", "the second sends it again, compacts, and parks"
        kept = load_records(coord.store.compaction.records(task.id))
        journal = [message_adapter().validate_json(entry) for entry in coord.store.records.conversation(task.id)]
        assert [r for r in kept if r.folded_upto > 1], "the second run folded turns"
        endpoints.recovered(coord.plane, endpoint, endpoint_model)
        endpoints.wake(coord.plane, task.id)
        asked_before = len(server.seen)

        assert run_child(runtime, task.id).status == "completed"

        assert [fits(journal, record) for record in kept] == [True] * len(kept), "each record fits the journal"
        assert not server.seen[asked_before].summarising, "the third run went on from the records as kept"
        assert coord.get_task(task.id).cost_micros == micros(server.seen)
        coord.client.delete("subq-nobody")
        coord.close()


def test_a_request_still_too_long_once_compacted_fails_the_task_with_the_providers_error(settings: Settings) -> None:
    """Exactly one retry: a server whose window cannot hold the last turn refuses the compacted request too."""
    with ModelServer(turns(), max_prompt_tokens=3_500, by_call_ids=True) as server:
        coord, local = _in_process(settings, windowed(server, context_window=None), "twice")
        task = coord.create_task("Read the report's chunks.", profile="w", run=True)

        result = run_child(build_runtime(local, make_app(local)), task.id)

        assert result.status == "failed" and "maximum context length is 3500 tokens" in (result.error or "")
        statuses = [s.status for s in server.seen if not s.summarising]
        assert statuses[-2:] == [400, 400] and statuses.count(400) == 2, statuses
        record = coord.get_task(task.id)
        assert record.error_class == "ModelContextWindowExceededError"
        assert len(_records(coord, task.id)) == 1
        coord.close()


def test_the_summaries_of_a_compaction_profile_go_to_its_model_and_are_priced_there(settings: Settings) -> None:
    cheap = Price(input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal(2))
    with (
        ModelServer(turns(), max_prompt_tokens=WINDOW, by_call_ids=True) as server,
        ModelServer(summary="Notes from the cheap model.", max_prompt_tokens=WINDOW) as summariser,
    ):
        coord, local = _in_process(settings, windowed(server, compaction_profile="notes"), "other")
        local = local.model_copy(update={"profiles": {
            **local.profiles,
            "notes": Profile(model="openai:notes-model", base_url=summariser.base_url, api_key=summariser.key,
                             price=cheap),
        }})  # fmt: skip
        coord = Coordinator(local)
        task = coord.create_task("Read the report's chunks.", profile="w", run=True)

        result = run_child(build_runtime(local, make_app(local)), task.id)

        assert result.status == "completed", result.error
        assert not any(s.summarising for s in server.seen), "the task's own model wrote no summary"
        assert summariser.answered() and all(s.summarising for s in summariser.seen)
        assert any("Notes from the cheap model." in json.dumps(s.body["messages"]) for s in server.seen)
        records = _records(coord, task.id)
        assert any(r["summariser"] == "notes" for r in records)
        record = coord.get_task(task.id)
        assert record.cost_micros == micros(server.seen) + micros(summariser.seen, cheap)
        assert record.requests == len(server.answered()) + len(summariser.answered())
        coord.close()


def test_a_tool_result_past_max_tool_output_chars_reaches_the_model_and_the_journal_cut(settings: Settings) -> None:
    with ModelServer(turns(1), by_call_ids=True) as server:
        coord, local = _in_process(settings, windowed(server, context_window=None, max_tool_output_chars=1_000), "cap")
        task = coord.create_task("Read one chunk.", profile="w", run=True)

        assert run_child(build_runtime(local, make_app(local)), task.id).status == "completed"

        results = [m for s in server.seen for m in s.body["messages"] if m.get("role") == "tool"]
        # The first 1,000 characters of the result, and a line saying how much was cut.
        assert results and all(len(m["content"]) < 1_000 + 150 for m in results)
        cut = results[-1]["content"]
        assert (
            cut.startswith("chunk 0: ") and "characters of read_chunk's result (max_tool_output_chars is 1,000)" in cut
        )
        journal = [p for m in coord.messages(task.id, kind="api") for p in m.get("parts", [])]
        assert [
            p["content"] for p in journal if p.get("part_kind") == "tool-return" and p["tool_name"] == "read_chunk"
        ] == [cut]
        coord.close()


# -- the view, the choice, the estimate (pure) ------------------------------------------------------------


def _conversation(chunks: int) -> list[ModelMessage]:
    """A run's history: the instruction, then a turn per chunk (notes and a call, then its 8 KB result)."""
    messages: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("You are a subagent."), UserPromptPart("Read the chunks.")])
    ]
    for n in range(chunks):
        messages.append(ModelResponse(parts=[TextPart(NOTES), ToolCallPart("read_chunk", {"n": n}, f"c{n}")]))
        messages.append(ModelRequest(parts=[ToolReturnPart("read_chunk", read_chunk(n), f"c{n}")]))
    return messages


class Kept:
    """A compaction's port in memory: the plan it reads, the records and lines it keeps."""

    def __init__(self) -> None:
        self.records: list[CompactionRecord] = []
        self.lines: list[str] = []

    def plan(self) -> str:
        return PLAN

    def keep(self, record: CompactionRecord, ui_text: str) -> None:
        self.records.append(record)
        self.lines.append(ui_text)


def _compactor(
    kept: Kept, asked: list[str], records: Sequence[CompactionRecord] = (), window: int = WINDOW
) -> Compactor:
    async def summarise(transcript: str, max_tokens: int) -> str:
        asked.append(transcript)
        return "The agent read the chunks and noted their figures."

    return Compactor(kept, summarise, window=window, share=0.8, summariser_name="w", summariser_window=None,
                     records=records, window_of="profile 'w'")  # fmt: skip


def _pairs_whole(view: Sequence[ModelMessage]) -> bool:
    """Every tool call sent has its result in the next message, and every result its call just before."""
    for i, message in enumerate(view):
        if isinstance(message, ModelResponse):
            calls = {p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)}
            after = view[i + 1] if i + 1 < len(view) else None
            answered = {p.tool_call_id for p in after.parts if isinstance(p, ToolReturnPart)} if after else set()
            if calls and after is not None and calls != answered:
                return False
        elif isinstance(message, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in message.parts):
            answers_a_response = i > 0 and isinstance(view[i - 1], ModelResponse)
            if not answers_a_response:
                return False
    return True


def test_a_compaction_elides_old_results_first_then_folds_older_turns_and_keeps_the_instruction_and_last_turn() -> None:
    kept, asked = Kept(), []
    compactor = _compactor(kept, asked)
    history = _conversation(2)
    view = asyncio.run(compactor.view(history, ModelRequestParameters()))
    assert kept.records[0].folded_upto == 0 and kept.records[0].elided_upto == 3 and not asked, "elided, no summary"
    assert view[0] is history[0] and view[-1] is history[-1] and _pairs_whole(view)
    assert "[result elided" in json.dumps(MESSAGES.dump_python(view, mode="json"))
    assert history[2].parts[0].content == read_chunk(0), "the history itself is never changed"  # type: ignore[union-attr]

    longer = _conversation(5)
    view = asyncio.run(compactor.view(longer, ModelRequestParameters()))
    latest = kept.records[-1]
    assert latest.number == 2 and latest.folded_upto > 1 and asked, "the notes pass too: older turns are folded"
    assert latest.plan == PLAN and latest.summariser == "w" and _pairs_whole(view)
    first = view[0]
    assert isinstance(first, ModelRequest) and first.parts[:2] == longer[0].parts, "the instruction is kept"
    assert PLAN in str(first.parts[-1].content) and folded_responses(view) == latest.folded_responses
    assert view[-1] is longer[-1], "the last turn is kept whole"
    assert compactor.threshold is not None and estimate_tokens(view) <= compactor.threshold
    assert f"{latest.folded_upto - 1} older messages summarised by profile 'w'" in kept.lines[-1]

    # The same history again: the latest record's view is sent, nothing compacted twice.
    again = asyncio.run(_compactor(kept, asked, kept.records).view(longer, ModelRequestParameters()))
    assert len(kept.records) == 2 and _contents(again) == _contents(view)


def _contents(view: Sequence[ModelMessage]) -> list[list[object]]:
    return [[getattr(p, "content", None) for p in m.parts] for m in view]


def test_a_record_whose_messages_the_journal_no_longer_holds_is_not_applied() -> None:
    kept, asked = Kept(), []
    history = _conversation(5)
    asyncio.run(_compactor(kept, asked).view(history, ModelRequestParameters()))
    (record,) = kept.records
    assert compacted_view(history, record) != history
    cut_back = _conversation(1)  # a retry cut the conversation back below what the record covers
    assert compacted_view(cut_back, record) == cut_back
    regrown = [*history[:3], *_conversation(5)[3:]]
    regrown[record.covers - 1] = ModelRequest(parts=[ToolReturnPart("read_chunk", "another result", "cx")])
    assert compacted_view(regrown, record) == regrown, "a journal that grew again differently does not take it"


def test_the_estimate_counts_more_tokens_than_the_servers_count_of_the_same_request() -> None:
    history = _conversation(3)
    body = {"messages": [{"role": "user", "content": _part_text_all(m)} for m in history]}
    assert estimate_tokens(history) > prompt_tokens_of(body)


def _part_text_all(message: ModelMessage) -> str:
    return "".join(str(getattr(p, "content", "")) + str(getattr(p, "args", "")) for p in message.parts)


def test_a_long_tool_result_is_cut_to_its_beginning_and_end_with_what_was_cut_said() -> None:
    text = "A" * 15_000 + "B" * 15_000
    cut = capped(text, 20_000, "git_log")
    assert len(cut) < 20_200 and cut.startswith("A" * 13_000) and cut.endswith("B" * 6_000)
    assert "10,000 of 30,000 characters of git_log's result (max_tool_output_chars is 20,000) cut here" in cut
    assert capped("short", 20_000, "t") == "short" and capped(7, 200, "t") == 7
    own_cut = "exit 0\n" + "z" * 20_000 + "\n[... 81 characters cut ...]\n"  # run_command cut it to the same cap
    assert capped(own_cut, 20_000, "run_command") == own_cut, "not cut twice"
    data = {"rows": ["x" * 100] * 50}
    assert isinstance(capped(data, 1_000, "t"), str) and capped(data, 100_000, "t") is data
    returned = ToolReturn(return_value="y" * 5_000, metadata={"cost_usd": "0.01"})
    assert len(capped(returned, 1_000, "t").return_value) < 1_200 and capped(returned, 10_000, "t") is returned


def test_a_compacted_mark_is_a_point_of_its_run_not_a_state() -> None:
    timeline = Timeline(m=[(0, "queued"), (10, "running"), (50, "compacted"), (50, "running"), (90, "completed")])
    times = times_of(timeline)
    assert times.compactions_ms == [50] and times.runs == 1 and times.run_ms == 80
    assert [i.state for i in times.intervals] == ["queued", "running"]


# -- bad settings, and the record's step ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profiles", "error"),
    [
        ({"main": {"context_window": 10}}, "SUBQ_PROFILES (main.context_window): Input should be greater than or equal to 1000"),
        ({"main": {"context_window": "big"}}, "SUBQ_PROFILES (main.context_window): Input should be a valid integer"),
        ({"main": {"compact_at_share": 1.5}}, "SUBQ_PROFILES (main.compact_at_share): Input should be less than or equal to 0.95"),
        ({"main": {"compact_at_share": 0}}, "SUBQ_PROFILES (main.compact_at_share): Input should be greater than 0"),
        ({"main": {"max_tool_output_chars": 5}}, "SUBQ_PROFILES (main.max_tool_output_chars): Input should be greater than or equal to 200"),
        ({"main": {"compaction_profile": "nope"}}, "SUBQ_PROFILES: profile 'main': compaction_profile names 'nope', which is not a profile (known: main, offline)"),
        ({"main": {"compaction_profile": ""}}, "SUBQ_PROFILES (main.compaction_profile): String should have at least 1 character"),
    ],
    ids=["window-small", "window-text", "share-high", "share-zero", "output-small", "unknown-profile", "empty-profile"],
)  # fmt: skip
def test_a_bad_compaction_setting_is_one_line_naming_the_profile_and_field(
    profiles: dict[str, object], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert error in helpers.profiles_refused(profiles, monkeypatch)


def test_a_compaction_is_kept_only_while_the_run_holds_the_lease_and_once_a_number(
    idle_coordinator: Coordinator,
) -> None:
    coord = idle_coordinator
    task = coord.create_task("Read the chunks.")
    store, keys = coord.store.compaction, coord.store.keys
    coord.client.set(keys.lease(task.root_id, task.id), "run-token", ex=60)  # a lease, as a run takes it
    line = json.dumps({"ts": 1.0, "type": "say", "say": "context_compacted", "text": "context compacted: ~9 -> ~3"})
    messages_before = coord.messages(task.id)

    assert store.keep(task, "another-run", 1, '{"number": 1}', line) == "fenced"
    assert store.records(task.id) == [] and coord.messages(task.id) == messages_before, "nothing written"
    assert store.keep(task, "run-token", 1, '{"number": 1}', line) == "kept"
    assert store.keep(task, "run-token", 1, '{"number": 1, "again": true}', line) == "kept_before"
    assert store.records(task.id) == ['{"number": 1}']
    assert [m["say"] for m in coord.messages(task.id)][-1:] == ["context_compacted"]
    record = coord.get_task(task.id)
    assert record.timeline is not None and record.timeline.m[-2][1] == "compacted" and record.times is not None
    assert len(record.times.compactions_ms) == 1


# -- images and files, a window too small, a record past the journal (review of issue 34) -----------------


def test_an_image_counts_a_fixed_cost_in_a_prompt_and_in_a_tool_result_not_its_bytes() -> None:
    image = BinaryContent(data=bytes(range(256)) * 1_200, media_type="image/png")  # 300 KB
    url = ImageUrl(url="https://example.com/" + "p" * 280 + ".png")
    in_prompt = estimate_tokens([ModelRequest(parts=[UserPromptPart(["Look:", image])])])
    in_result = estimate_tokens([ModelRequest(parts=[ToolReturnPart("screenshot", [image], "c1")])])
    by_url = estimate_tokens([ModelRequest(parts=[UserPromptPart(["Look:", url])])])
    assert MEDIA_TOKENS <= in_prompt < MEDIA_TOKENS + 50 and MEDIA_TOKENS <= in_result < MEDIA_TOKENS + 50
    assert by_url >= MEDIA_TOKENS + len(url.url) // 3, "a URL counts its characters too"

    # Six turns each with a 100 KB screenshot fit a 128k window easily: no compaction, no summary paid.
    kept, asked = Kept(), []
    compactor = _compactor(kept, asked, window=128_000)
    history: list[ModelMessage] = [ModelRequest(parts=[SystemPromptPart("You are a subagent."), UserPromptPart("Go.")])]
    for n in range(6):
        history.append(ModelResponse(parts=[TextPart(NOTES), ToolCallPart("screenshot", {}, f"c{n}")]))
        shot = BinaryContent(data=bytes(range(256)) * 400, media_type="image/png")
        history.append(ModelRequest(parts=[ToolReturnPart("screenshot", "see the image", f"c{n}"),
                                           UserPromptPart(["image:", shot])]))  # fmt: skip
        assert asyncio.run(compactor.view(history, ModelRequestParameters())) == history
    assert kept.records == [] and asked == []

    # Folded, a turn's image reaches the summariser as what it is, not as its bytes.
    kept, asked = Kept(), []
    small = _compactor(kept, asked, window=4 * MEDIA_TOKENS)
    asyncio.run(small.view(history, ModelRequestParameters()))
    assert asked and all("[binary]" in t and "\\x00" not in t and len(t) < 20_000 for t in asked)


def test_a_window_the_instruction_nearly_fills_keeps_no_record_and_fails_past_the_window() -> None:
    kept, asked = Kept(), []
    compactor = _compactor(kept, asked, window=1_000)
    instruction = ModelRequest(parts=[SystemPromptPart("S" * 2_000), UserPromptPart("do it " * 100)])
    history: list[ModelMessage] = [instruction]
    for n in range(10):
        history.append(ModelResponse(parts=[TextPart(f"step {n}"), ToolCallPart("t", {"i": n}, f"c{n}")]))
        history.append(ModelRequest(parts=[ToolReturnPart("t", "r" * 300, f"c{n}")]))
        try:
            view = asyncio.run(compactor.view(history, ModelRequestParameters()))
        except ContextTooSmall as exc:
            error = str(exc)
            break
        # Over the threshold, no compaction under it: sent as it is while it fits the window.
        assert view == history and estimate_tokens(view) <= 1_000
    else:
        raise AssertionError("a request past the window was sent")
    assert n == 1 and kept.records == [] and kept.lines == [] and asked == [], "no record, no summary paid"
    assert error.startswith("the task's instruction, tools and last turn are ~1,0"), error
    assert "tokens (estimated), over context_window 1,000 of profile 'w'" in error


def test_a_task_whose_instruction_passes_its_window_fails_naming_the_figures(settings: Settings) -> None:
    profile = Profile(context_window=1_000)  # the offline model: its first request is the instruction alone
    coord, local = _in_process(settings, profile, "small")
    task = coord.create_task("Read this. " * 400, profile="w", run=True)

    result = run_child(build_runtime(local, make_app(local)), task.id)

    assert result.status == "failed" and result.error_class == "ContextTooSmall"
    assert "instruction, tools and last turn are ~" in (result.error or "")
    assert "over context_window 1,000 of profile 'w'" in (result.error or "")
    assert coord.get_task(task.id).requests == 0 and _records(coord, task.id) == []
    coord.close()


def test_a_record_that_folds_past_the_end_of_the_journal_does_not_fit() -> None:
    history = _conversation(1)
    record = CompactionRecord(
        number=1, at=0.0, reason="window", folded_upto=len(history), elided_upto=len(history), folded_responses=1,
        tokens_before=1, tokens_after=1, fingerprint=fingerprint_of(history[-1]),
    )  # fmt: skip
    assert not fits(history, record) and compacted_view(history, record) == history


def test_a_fallback_chains_window_is_the_smallest_of_its_hops_set_or_known(settings: Settings) -> None:
    profiles = {
        "big": Profile(model="openai:gpt-4o", api_key="k", context_window=500_000, fallback_profiles=["known"]),
        "known": Profile(model="openai:gpt-4o", api_key="k"),  # no setting: its model's window, 128,000
        "unknown": Profile(model="openai:no-such-model", api_key="k", base_url="http://127.0.0.1:9/v1"),
    }
    local = settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})
    # A route is only built here (nothing is sent): no run is asked for anything.
    assert chain_window(Route(local, None, "big", task_id="t")) == (128_000, "profile 'known'")  # type: ignore[arg-type]
    assert chain_window(Route(local, None, "known", task_id="t")) == (128_000, "profile 'known'")  # type: ignore[arg-type]
    assert chain_window(Route(local, None, "unknown", task_id="t")) == (None, "")  # type: ignore[arg-type]


def test_a_summariser_on_another_provider_is_held_to_its_own_providers_rate_limit(settings: Settings) -> None:
    """The task's model is on `openai`, its summariser the offline model: each request is counted against its own
    provider's fleet-wide limit (Redis keeps the requests of the last minute of each)."""
    with ModelServer(turns(), max_prompt_tokens=WINDOW, by_call_ids=True) as server:
        coord, local = _in_process(settings, windowed(server, compaction_profile="notes"), "rate")
        local = local.model_copy(update={
            "profiles": {**local.profiles, "notes": Profile()}, "provider_rpm": {"offline": 1_000, "openai": 1_000},
        })  # fmt: skip
        coord = Coordinator(local)
        task = coord.create_task("Read the report's chunks.", profile="w", run=True)

        result = run_child(build_runtime(local, make_app(local)), task.id)

        assert result.status == "completed", result.error
        records = _records(coord, task.id)
        # A record is cumulative: each that folds further than the one before was a summary.
        before = [0, *(r["folded_upto"] for r in records)][:-1]
        summaries = [r for r, folded in zip(records, before, strict=True) if r["folded_upto"] > folded]
        assert summaries and all(r["summariser"] == "notes" for r in summaries)
        assert not any(s.summarising for s in server.seen), "the task's own model wrote no summary"
        counted = {p: coord.client.zcard(coord.store.keys.rate(p)) for p in ("offline", "openai")}
        assert counted == {"offline": len(summaries), "openai": len(server.seen)}, counted
        coord.close()


def test_a_delegations_combined_result_is_read_whole_where_no_window_asks_for_a_cut(fleet: Fleet) -> None:
    """A parent's children's results are what it delegated for: a 200-character tool cap does not cut them
    (`combined_result_chars`); with no window known, the combined result's own bound is the only one."""
    coord = fleet.coord
    long = "figure " * 200
    steps = [
        agents.call(
            "run_subagents",
            tasks=[agents.subtask("A", agents.reply("A: " + long)), agents.subtask("B", agents.reply("B: " + long))],
        ),
        agents.call("attempt_completion", result="both read"),
    ]
    task = coord.create_task(script_message("Read both.", steps), profile="offline-capped", run=True)

    done = coord.wait(task.id, 120)

    assert done.status == TaskStatus.COMPLETED, done.error
    journal = [p for m in coord.messages(task.id, kind="api") for p in m.get("parts", [])]
    (answer,) = [
        p["content"] for p in journal if p.get("part_kind") == "tool-return" and p["tool_name"] == "run_subagents"
    ]
    assert "cut here" not in answer
    assert ("A: " + long).strip() in answer and ("B: " + long).strip() in answer


def test_a_combined_result_is_cut_at_half_its_parents_window_never_below_the_tool_cap() -> None:
    assert combined_result_chars(None, 200) is None
    assert combined_result_chars(10_000, 200) == int(10_000 * CHARS_PER_TOKEN_ESTIMATE * COMBINED_RESULT_SHARE)
    assert combined_result_chars(100, 20_000) == 20_000
    limit = combined_result_chars(4_000, 200)
    assert limit is not None
    text = "x" * (limit * 2)
    cut = capped(text, limit, "run_subagents")
    assert isinstance(cut, str) and len(cut) < limit + 200 and "cut here" in cut


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"code": "context_length_exceeded", "message": "This model's maximum context length is 4096 tokens."}},
        {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 5000 > 4096"}},
        {"error": {"code": 400, "type": "exceed_context_size_error",
                   "message": "request (4476 tokens) exceeds the available context size (4096 tokens)"}},
        {"object": "error", "message": "This model's maximum context length is 4096 tokens.", "code": 400},
    ],
    ids=["openai", "anthropic", "llama.cpp", "vllm"],
)  # fmt: skip
def test_each_providers_refusal_of_a_prompt_past_the_window_is_read_as_an_overflow(body: dict[str, Any]) -> None:
    """llama.cpp's server words it its own way, and its refusal was a bad request: the task failed uncompacted."""
    assert is_context_overflow(ModelHTTPError(400, "some-model", body))
    assert not is_context_overflow(ModelHTTPError(400, "some-model", {"error": {"message": "unknown parameter"}}))

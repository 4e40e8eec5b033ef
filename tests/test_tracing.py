"""Traces (docs/tracing.md): one root tree is one connected trace across real worker processes; off costs nothing.

The worker processes export to an in-memory exporter whose spans they write to
files (tests/trace_dump.py); this process, which submits the root, exports to
one in memory. Every span of the tree, from both sides, must share one trace id
and hang from the submit span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator import ConfigError, Coordinator, Settings, TaskStatus, load_settings, tracing
from coordinator.local.fleet import WorkerFleet
from tests import trace_dump
from tests.agents import agent, call, reply, subtask
from tests.helpers import eventually
from tests.wheel_env import Venv

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 90
SECRET = "the-prompt-text-7d1e"  # in every message of the tree: it must reach no span
TREE = agent(
    call("run_subagents", tasks=[subtask(f"A {SECRET}", reply("A done")), subtask(f"B {SECRET}", reply("B done"))]),
    call("new_task", **subtask(f"C {SECRET}", reply("C done"))),
    call("attempt_completion", result="all done"),
    text=f"Fan out two, then one more. {SECRET}",
)
# The spans of that tree, by name. The root delegates twice (A and B in parallel, then C as a
# one-step chain) and so runs three times, one model request each; each child makes one.
# Write-backs: A's and B's ends; C's end (end_run.lua, then its chain's write-back, which
# closes the batch and resumes the root), once: a chain step has no write-back task of its own.
EXPECTED = {
    "subq.submit": 1,
    "subq.delegate": 2,
    "subq.publish": 2,
    "subq.write_back": 4,
    "subq.resume": 2,
    "subq.end_run": 1,
    "apply_async/subq.run_task": 6,
    "run/subq.run_task": 6,
    "chat offline": 6,
}


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_tracing_is_off_by_default_and_instruments_nothing(settings: Settings, redis_url: str) -> None:
    """A worker's imports and a submit, untraced: no instrumentation, no signal receiver, no header on the message.

    (redis-py imports OpenTelemetry's SDK itself where it is installed, for its own opt-in
    metrics; subq's tracing module and the instrumentations stay unloaded.)
    """
    queue = f"subq-untraced-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBQ_", "OTEL_"))}
    env |= {"SUBQ_REDIS_URL": redis_url, "SUBQ_KEY_PREFIX": "subquntraced", "SUBQ_QUEUE": queue}
    code = (
        "import json, sys\n"
        "import workers.app, workers.tasks\n"
        "from celery import signals\n"
        "from pydantic_ai import Agent\n"
        "from coordinator import Coordinator, tracing\n"
        "coord = Coordinator()\n"
        "task = coord.create_task('hello', run=True)\n"
        "message = json.loads(coord.client.lpop(coord.settings.queue))\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules if m.startswith(('coordinator.otel', "
        "'opentelemetry.instrumentation', 'opentelemetry.exporter'))), 'receivers': [len(s.receivers or []) for s in "
        "(signals.before_task_publish, signals.after_task_publish, signals.task_prerun)], 'agents': "
        "Agent._instrument_default, 'enabled': tracing.enabled(), 'headers': sorted(message['headers'])}))\n"
    )
    done = _python(code, env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["loaded"] == [] and seen["enabled"] is False and seen["agents"] is False
    assert seen["receivers"] == [0, 0, 0]
    assert "id" in seen["headers"] and "traceparent" not in seen["headers"]


def test_a_misconfigured_exporter_is_one_clear_line(redis_url: str) -> None:
    assert not tracing.enabled()  # an installed exporter would make setup() a no-op
    with pytest.raises(ConfigError, match=r"SUBQ_TRACES_EXPORTER: 'zipkin' is not none, otlp, console or package"):
        load_settings(redis_url=redis_url, traces_exporter="zipkin")
    with pytest.raises(ConfigError, match=r"SUBQ_TRACES_EXPORTER: cannot load 'tests.nowhere:exporter'"):
        tracing.setup(Settings(redis_url=redis_url, traces_exporter="tests.nowhere:exporter"))
    # A factory that is not an exporter's and raises when called (a processor named instead): a traceback, and
    # one that raised ValueError was blamed on SUBQ_REDIS_URL by the CLI.
    with pytest.raises(ConfigError, match=r"SUBQ_TRACES_EXPORTER: cannot load 'json:loads': TypeError: "):
        tracing.setup(Settings(redis_url=redis_url, traces_exporter="json:loads"))
    assert not tracing.enabled()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env |= {"SUBQ_REDIS_URL": redis_url, "SUBQ_TRACES_EXPORTER": "jaeger"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and time.monotonic() - started < 60
    assert "subq worker: Invalid setting SUBQ_TRACES_EXPORTER: 'jaeger' is not none, otlp, console" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tracing_without_the_extra_names_the_extra_to_install(venv: Venv, redis_url: str) -> None:
    """The built wheel without extras: a worker asked for traces stops with the install command."""
    proc = subprocess.run(
        [str(venv.bin / "celery"), "-A", "workers.app", "worker"],
        cwd=venv.workdir, env=venv.env(redis_url=redis_url, traces_exporter="otlp"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "subq worker: Invalid setting SUBQ_TRACES_EXPORTER: 'otlp' needs OpenTelemetry" in proc.stderr
    assert "pip install 'subagent-queue[otel]'" in proc.stderr
    assert "Traceback" not in proc.stderr


# The traced tree last: its module-scoped fixture keeps this process traced until the module ends.
@pytest.fixture(scope="module")
def traced_tree(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A tree run on two traced worker processes: its spans from every process, its root, the workers' logs."""
    tmp_path = tmp_path_factory.mktemp("traces")
    spans_dir = tmp_path / "spans"
    spans_dir.mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(trace_dump.SPANS_DIR, str(spans_dir))
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: the workers' spans reach their files at once
        yield from _run_tree(settings, tmp_path, spans_dir)


def _run_tree(settings: Settings, tmp_path: Path, spans_dir: Path) -> Iterator[dict[str, Any]]:
    own = settings.model_copy(
        update={
            "queue": "subq-traces",
            "key_prefix": "subqtraces",
            "traces_exporter": "tests.trace_dump:to_file",
            "log_format": "json",
        }
    )
    trace_dump.MEMORY.clear()
    with WorkerFleet(own, 2, tmp_path / "logs", name="traced") as fleet:
        fleet.wait_ready()
        coord = Coordinator(own.model_copy(update={"traces_exporter": "tests.trace_dump:memory"}))
        try:
            assert tracing.enabled()
            root = coord.create_task(TREE, run=True)
            done = coord.wait(root.id, WAIT_S)
            assert done.status == TaskStatus.COMPLETED, done.error
            tracing.flush()
            here = [trace_dump.record(s) for s in trace_dump.MEMORY.get_finished_spans()]

            def all_in() -> list[dict[str, Any]] | None:
                # The resumed root's last spans end just after its end was written: wait for them in the files.
                found = here + trace_dump.read_dir(spans_dir)
                names = Counter(s["name"] for s in found)
                return found if all(names[name] >= count for name, count in EXPECTED.items()) else None

            spans = eventually(all_in, f"the spans {EXPECTED}", timeout_s=30)
            yield {"spans": spans, "root": done, "logs": fleet.logs}
        finally:
            coord.close()
            tracing.shutdown()


def test_one_tree_gives_one_connected_trace(traced_tree: dict[str, Any]) -> None:
    spans, root = traced_tree["spans"], traced_tree["root"]
    names = Counter(s["name"] for s in spans)
    assert {name: names[name] for name in EXPECTED} == EXPECTED, names

    assert len({s["trace_id"] for s in spans}) == 1
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans)
    roots = [s for s in spans if s["parent_id"] is None]
    assert [s["name"] for s in roots] == ["subq.submit"]
    orphans = [s["name"] for s in spans if s["parent_id"] is not None and s["parent_id"] not in by_id]
    assert orphans == []

    def lineage(span: dict[str, Any]) -> list[dict[str, Any]]:
        chain = []
        while span["parent_id"] is not None:
            span = by_id[span["parent_id"]]
            chain.append(span)
        return chain

    def ancestors(span: dict[str, Any]) -> list[str]:
        return [s["name"] for s in lineage(span)]

    runs = {s["attributes"]["messaging.message.id"]: s for s in spans if s["name"] == "run/subq.run_task"}
    a, b, c = root.child_ids
    first, resumed, last = (runs[root.id], runs[f"{root.id}-r1"], runs[f"{root.id}-r2"])
    assert set(runs) == {root.id, a, b, c, f"{root.id}-r1", f"{root.id}-r2"}
    # Each child runs under its parent's publish, in the parent's run that delegated it.
    for child, parent in ((a, first), (b, first), (c, resumed)):
        assert ancestors(runs[child])[:3] == ["apply_async/subq.run_task", "subq.publish", "run/subq.run_task"]
        assert lineage(runs[child])[2] is parent
    # The root resumes under the resume published by a child's write-back: after A and B, one
    # of them; after the chain, C's run (its chain step is published from C's run too).
    assert ancestors(resumed)[:3] == ["apply_async/subq.run_task", "subq.resume", "run/subq.run_task"]
    assert lineage(resumed)[2] in (runs[a], runs[b])
    assert runs[c] in lineage(last) and "subq.write_back" in ancestors(last)
    assert ancestors(last)[-1] == "subq.submit"
    # Every model request is inside a run, and no prompt or reply text is in any span.
    assert all("run/subq.run_task" in ancestors(s) for s in spans if s["name"] == "chat offline")
    assert SECRET not in json.dumps(spans)


def test_a_runs_log_lines_carry_its_trace_id(traced_tree: dict[str, Any]) -> None:
    (trace_id,) = {s["trace_id"] for s in traced_tree["spans"]}
    lines = [line for log in traced_tree["logs"] for line in log.read_text().splitlines() if line.startswith("{")]
    runs = [json.loads(line) for line in lines if '"task_id"' in line]
    assert len(runs) >= 6, lines
    assert {line.get("trace_id") for line in runs} == {trace_id}

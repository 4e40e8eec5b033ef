"""SUBQ_LOG_FORMAT=json: a real worker's lines are JSON, and each line of a run carries the run's ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from coordinator import ConfigError, Settings, load_settings
from tests.conftest import dedicated_fleet
from tests.helpers import eventually, script, start_worker_with, usage_step
from workers.observe import RunContextFilter, run_context

ROOT = Path(__file__).resolve().parent.parent


def json_lines(log: Path) -> list[dict[str, Any]]:
    """The worker's log lines from its first JSON line on (before it: Celery's banner, on stdout).

    Only whole lines: the worker may be writing its last one as the file is read (its output is
    flushed a buffer at a time), which on a loaded host left half a JSON object to parse."""
    text = log.read_text()
    lines = text.splitlines()[: None if text.endswith("\n") else -1]
    first = next(n for n, line in enumerate(lines) if line.startswith("{"))
    return [json.loads(line) for line in lines[first:] if line.strip()]


def test_a_runs_lines_are_json_with_its_ids(settings: Settings, tmp_path: Path) -> None:
    updates = {"queue": "subq-logs", "key_prefix": "subqlogs", "log_format": "json"}
    with dedicated_fleet(settings, tmp_path, 1, **updates) as (coord, fleet):
        parent = coord.create_task("Q3 report", todos="[ ] Collect figures")
        batch = coord.delegate(parent.id, [{"description": "Collect figures", "message": script(usage_step())}])
        root = coord.create_task(script(usage_step(), text="Plan"), run=True)
        (child,) = batch.child_ids
        coord.wait(parent.id, 60)
        coord.wait(root.id, 60)

        def ended(task_id: str) -> list[dict[str, Any]] | None:
            mine = [line for line in json_lines(fleet.logs[0]) if line.get("task_id") == task_id]
            return mine if any(line["message"].endswith(": completed") for line in mine) else None

        for task_id, root_id, batch_id in ((child, parent.id, batch.id), (root.id, root.id, None)):
            for line in eventually(lambda t=task_id: ended(t), f"the log lines of {task_id}"):  # type: ignore[misc]
                assert line["root_id"] == root_id
                assert line["batch_id"] == batch_id
                assert line["worker"] == fleet.nodes[0]
                assert line["delivery"] == 1
                assert {"timestamp", "level", "logger", "message"} <= line.keys()
        # Every line is JSON (json_lines parsed them), and a line outside a run carries no run.
        ready = [line for line in json_lines(fleet.logs[0]) if line["message"].endswith("ready.")]
        assert ready and "task_id" not in ready[0]


def test_the_filter_adds_the_run_only_inside_it() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert RunContextFilter().filter(record) and not hasattr(record, "task_id")
    with run_context("0123456789abcdef", worker="w0@host"):
        inside = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        RunContextFilter().filter(inside)
    assert (inside.task_id, inside.worker, inside.root_id) == ("0123456789abcdef", "w0@host", None)  # type: ignore[attr-defined]


def test_a_bad_log_format_stops_the_worker_with_one_line(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBQ_LOG_FORMAT", "yaml")
    with pytest.raises(ConfigError, match=r"^Invalid setting SUBQ_LOG_FORMAT: Input should be 'text' or 'json'$"):
        load_settings()
    proc = start_worker_with(settings, SUBQ_LOG_FORMAT="yaml")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "subq worker: Invalid setting SUBQ_LOG_FORMAT: Input should be 'text' or 'json'"
    )
    assert "Traceback" not in proc.stderr

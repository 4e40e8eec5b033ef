"""SUBQ_LOG_FORMAT=json: a real worker's lines are JSON, and each line of a run carries the run's ids."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator import ConfigError, Settings, TaskStatus, load_settings
from coordinator.settings import Profile
from tests.conftest import dedicated_fleet
from tests.helpers import eventually, script, start_worker_with, usage_step
from tests.test_openai_compatible import PRICE, FailingHandler, FailingServer, serving
from workers.observe import RunContextFilter, VisibleLineFilter, run_context

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


# A provider's error as a hostile endpoint (or a model's text quoted in it) may write it: a terminal
# sequence that writes the operator's clipboard (OSC 52), a line break that forges a log line of its own,
# a carriage return that overwrites the line, and a bidi override.
HOSTILE = "\x1b]52;c;cm0gLXJmIH4=\x07bad\nERROR forged line\rover \u202eevil"


@pytest.fixture
def hostile_provider() -> Iterator[FailingServer]:
    server = FailingServer(("127.0.0.1", 0), FailingHandler)
    server.attempts, server.status = 0, 400
    server.error = {"message": HOSTILE, "type": "invalid_request_error"}
    with serving(server):
        yield server


def test_a_providers_text_in_a_text_line_is_one_line_of_visible_text(
    settings: Settings, tmp_path: Path, hostile_provider: FailingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "key-from-the-environment")  # the key FailingHandler asks for
    host, port = hostile_provider.server_address[:2]
    profile = Profile(model="openai:local-model", base_url=f"http://{host!s}:{port}/v1", price=PRICE)
    updates = {"queue": "subq-logs-text", "key_prefix": "subqlogstext", "profiles": {"local": profile}}
    with dedicated_fleet(settings, tmp_path, 1, **updates) as (coord, fleet):
        task = coord.create_task("Read the data and report.", profile="local", run=True)
        assert coord.wait(task.id, 60).status == TaskStatus.FAILED
        failed = f"task {task.id} failed:"
        lines = eventually(
            lambda: [line for line in fleet.logs[0].read_text().splitlines() if failed in line] or None,
            "the worker's line for the failed run",
        )
    text = fleet.logs[0].read_text()
    assert hostile_provider.attempts == 1
    # The error is made one line before it is logged (its breaks as spaces); its escapes are the log's.
    assert len(lines) == 1 and "\\x1b]52;c;cm0gLXJmIH4=\\x07bad ERROR forged line over \\u202eevil (" in lines[0]
    assert not any(ch in text for ch in "\x1b\x07\r\u202e"), "a raw control or bidi character reached the log"
    assert not any(line.startswith("ERROR forged line") for line in text.splitlines())


def test_the_visible_line_filter_escapes_a_message_and_a_traceback() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(VisibleLineFilter())
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("tests.visible_line")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("said %s and %d%%", "a\nb\x1b[2J", 5)
        logger.warning("plain %s", "text")
        try:
            raise ValueError("bad\x1b]0;title\x07")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["WARNING said a\\nb\\x1b[2J and 5%", "WARNING plain text", "ERROR failed"]
    assert lines[3] == "Traceback (most recent call last):", "a traceback keeps its line breaks"
    assert lines[-1] == "ValueError: bad\\x1b]0;title\\x07"
    assert "\x1b" not in out.getvalue()
    assert sys.exc_info() == (None, None, None)
    # A call whose arguments do not fit its format is the handler's to report, never the caller's exception.
    reported: list[str] = []
    handler.handleError = lambda record: reported.append(record.msg)  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning("bad %d", "not a number")
    finally:
        logger.removeHandler(handler)
    assert reported == ["bad %d"]

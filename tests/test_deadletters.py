"""The dead-letter list without workers: the entry, the store, the Coordinator, the CLI, the API and the client.

Dead letters are written here as the worker's consumer writes them
(`Coordinator.record_dead_letter`); tests/test_poison.py puts them there with
real poison messages and real workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from coordinator import Coordinator, CorruptError, Settings, ValidationError
from coordinator.api import create_app
from coordinator.client import SubqClient
from coordinator.deadletters import MAX_DEAD_LETTERS, MAX_MESSAGE_CHARS, DeadLetter, dead_letter, message_digest
from tests.helpers import REQUEST_TIMEOUT_S, TOKEN, ApiServer, Transport, api_settings
from tests.test_cli import cli

PREFIX = "subqdlq"
QUEUE = "subq-dlq-idle"


@pytest.fixture(scope="module")
def coord(settings: Settings) -> Iterator[Coordinator]:
    coord = Coordinator(api_settings(settings, key_prefix=PREFIX, queue=QUEUE))
    yield coord
    coord.purge_dead_letters()
    coord.close()


@pytest.fixture
def dlq(coord: Coordinator) -> Coordinator:
    """The module's Coordinator, with an empty dead-letter list."""
    coord.purge_dead_letters()
    return coord


def _bury(coord: Coordinator, n: int, reason: str = "header 'id' is missing") -> list[DeadLetter]:
    entries = [dead_letter(QUEUE, f"{reason} #{i}", f'{{"n": {i}}}', task="subq.run_task", task_id=f"id-{i}") for i in range(n)]  # fmt: skip
    for entry in entries:
        coord.record_dead_letter(entry)
    return entries


def _env(coord: Coordinator, transport: Transport) -> dict[str, str]:
    return transport.env(coord.settings)


# -- the entry -----------------------------------------------------------------------------


def test_an_entry_keeps_what_is_known_and_cuts_what_is_long() -> None:
    huge = "x" * (MAX_MESSAGE_CHARS + 10)
    entry = dead_letter("q", "why", huge, task=["not", "a", "name"], task_id=7)
    assert (entry.queue, entry.reason, entry.task, entry.id) == ("q", "why", None, None)
    assert len(entry.message) == MAX_MESSAGE_CHARS and entry.truncated
    raw = dead_letter("q", "why", b"\xff\xfe{", task="t", task_id="i")
    assert (raw.message, raw.truncated, raw.task, raw.id) == ("\\xff\\xfe{", False, "t", "i")


# -- the store and the Coordinator ----------------------------------------------------------


def test_the_list_is_newest_first_counted_and_purged(dlq: Coordinator) -> None:
    entries = _bury(dlq, 3)
    assert dlq.dead_letters(50) == entries[::-1]
    assert dlq.dead_letters(2) == entries[:0:-1]
    assert dlq.count_dead_letters() == 3
    assert dlq.purge_dead_letters() == 3
    assert (dlq.dead_letters(50), dlq.count_dead_letters(), dlq.purge_dead_letters()) == ([], 0, 0)


def test_the_list_keeps_only_the_newest(dlq: Coordinator) -> None:
    key = dlq.store.keys.dead_letters()
    filler = dead_letter(QUEUE, "old", "{}").model_dump_json()
    dlq.client.lpush(key, *[filler] * MAX_DEAD_LETTERS)  # the list at its cap, written in one step
    newest = _bury(dlq, 2)
    assert dlq.count_dead_letters() == MAX_DEAD_LETTERS
    assert dlq.dead_letters(3)[:2] == newest[::-1]
    assert dlq.client.lindex(key, -1) == filler


def test_the_marks_are_trimmed_with_the_list_in_the_order_kept(dlq: Coordinator) -> None:
    """Each message on the list has a mark; the newest MAX_DEAD_LETTERS of both are kept, by the order they were
    kept (not a clock, which may step back): a message trimmed off the list is kept again when it comes back."""
    key, marks = dlq.store.keys.dead_letters(), dlq.store.keys.dead_letter_marks()
    filler = dead_letter(QUEUE, "old", "{}").model_dump_json()
    dlq.client.lpush(key, *[filler] * MAX_DEAD_LETTERS)
    dlq.client.zadd(marks, {f"old-{n}": n for n in range(1, MAX_DEAD_LETTERS + 1)})
    (entry,) = _bury(dlq, 1)
    assert dlq.client.zcard(marks) == dlq.count_dead_letters() == MAX_DEAD_LETTERS
    assert dlq.client.zscore(marks, "old-1") is None, "the oldest mark went with the oldest entry"
    newest = dlq.client.zrevrange(marks, 0, 0, withscores=True)
    assert newest == [(message_digest(entry.message), MAX_DEAD_LETTERS + 1)]
    assert not dlq.record_dead_letter(entry), "on the list already"
    assert dlq.purge_dead_letters() == MAX_DEAD_LETTERS
    assert not dlq.client.exists(marks), "a purge empties both"
    assert dlq.record_dead_letter(entry), "kept again once purged"


@pytest.mark.parametrize("limit", [0, 501, -1, True, "5"])
def test_a_bad_limit_is_refused_naming_it(dlq: Coordinator, limit: object) -> None:
    with pytest.raises(ValidationError) as caught:
        dlq.dead_letters(limit)  # type: ignore[arg-type]
    assert caught.value.field == "limit"


def test_a_corrupt_entry_is_reported_not_skipped(dlq: Coordinator) -> None:
    _bury(dlq, 1)
    dlq.client.lpush(dlq.store.keys.dead_letters(), "not json")
    with pytest.raises(CorruptError, match="Dead letter 0"):
        dlq.dead_letters(10)


# -- the CLI -------------------------------------------------------------------------------


def test_the_cli_lists_newest_first_one_line_each(dlq: Coordinator, transport: Transport) -> None:
    entries = _bury(dlq, 3)
    shown = cli("dead-letters", "--limit", "2", env=_env(dlq, transport))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 2
    assert "header 'id' is missing #2  (queue subq-dlq-idle, task subq.run_task, id id-2)" in lines[0]
    assert lines[0][:4].isdigit() and lines[0][19] == "Z"
    assert "1 older: subq dead-letters --limit 3" in shown.stderr
    full = cli("dead-letters", "--json", env=_env(dlq, transport))
    assert [DeadLetter.model_validate(e) for e in json.loads(full.stdout)] == entries[::-1]


def test_a_messages_own_headers_never_make_a_line_of_their_own() -> None:
    """A dead letter's task name and id are the broken message's headers: anyone who can queue a message wrote
    them, and a line break there printed a forged entry under the real one in `subq dead-letters`."""
    from coordinator.cli.views import dead_letter_lines

    forged = "subq.run_task, id x)\n2026-01-01 00:00:00Z  all clear  (queue subq"
    entry = dead_letter("subq", "no body", "{}", task=forged, task_id="i\r\n\x1b]52;c;AAAA\x07")
    (line,) = dead_letter_lines([entry])
    assert "\n" not in line and "\r" not in line
    assert line.endswith("(queue subq, task subq.run_task, id x) 2026-01-01 00:00:00Z all clear (queue subq, "
                         "id i \x1b]52;c;AAAA\x07)")  # fmt: skip


def test_the_cli_purges(dlq: Coordinator, transport: Transport) -> None:
    _bury(dlq, 2)
    done = cli("dead-letters", "--purge", env=_env(dlq, transport))
    assert (done.returncode, done.stdout.strip()) == (0, "Purged 2 dead letters.")
    assert json.loads(cli("dead-letters", "--purge", "--json", env=_env(dlq, transport)).stdout) == {"purged": 0}
    assert cli("dead-letters", env=_env(dlq, transport)).stdout.strip() == "No dead letters."


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--limit", "0"], 1, "subq: limit must be an integer between 1 and 500"),
        (["--limit", "many"], 2, "subq dead-letters: Invalid value for '--limit': Input should be a valid integer"),
        (["--purge", "--limit", "5"], 1, "subq: --purge deletes every dead letter; it takes no --limit"),
        (["--purge", "yes"], 2, "subq dead-letters: Got unexpected extra argument(s) (yes)"),
    ],
)
def test_bad_cli_arguments_get_one_clear_line_and_change_nothing(
    dlq: Coordinator, transport: Transport, args: list[str], code: int, message: str
) -> None:
    _bury(dlq, 2)
    before = dlq.store.metrics.snapshot()
    done = cli("dead-letters", *args, env=_env(dlq, transport))
    assert (done.returncode, done.stdout) == (code, "")
    assert done.stderr.startswith(message) and len(done.stderr.splitlines()) == 1, done.stderr
    assert dlq.store.metrics.snapshot() == before


# -- the API and the client ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(coord: Coordinator) -> Iterator[ApiServer]:
    with ApiServer(create_app(coordinator=coord)) as running:
        yield running


def test_the_api_lists_and_purges(dlq: Coordinator, server: ApiServer) -> None:
    entries = _bury(dlq, 3)
    with server.client() as http:
        page = http.get("/v1/dead-letters", params={"limit": 2})
        assert page.status_code == 200, page.text
        assert page.json()["count"] == 3
        assert [DeadLetter.model_validate(e) for e in page.json()["dead_letters"]] == entries[:0:-1]
        assert len(http.get("/v1/dead-letters").json()["dead_letters"]) == 3
        purged = http.delete("/v1/dead-letters")
        assert (purged.status_code, purged.json()) == (200, {"purged": 3})
        assert http.get("/v1/dead-letters").json() == {"count": 0, "dead_letters": []}


@pytest.mark.parametrize(
    ("method", "params", "status", "code", "field"),
    [
        ("GET", {"limit": "0"}, 422, "invalid_input", "limit"),
        ("GET", {"limit": "501"}, 422, "invalid_input", "limit"),
        ("GET", {"limit": "ten"}, 422, "invalid_input", "limit"),
        ("GET", {"limt": "5"}, 422, "invalid_input", "limt"),
        ("DELETE", {"limit": "5"}, 422, "invalid_input", "limit"),
    ],
)
def test_bad_api_queries_are_refused_in_the_usual_shape_and_change_nothing(
    dlq: Coordinator, server: ApiServer, method: str, params: dict[str, str], status: int, code: str, field: str
) -> None:
    _bury(dlq, 2)
    before = dlq.store.metrics.snapshot()
    with server.client() as http:
        response = http.request(method, "/v1/dead-letters", params=params)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"code", "message", "field"}
    assert (response.json()["code"], response.json()["field"]) == (code, field)
    assert dlq.store.metrics.snapshot() == before


def test_the_api_needs_the_token(dlq: Coordinator, server: ApiServer) -> None:
    _bury(dlq, 1)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=server.url) as anonymous:
        assert anonymous.get("/v1/dead-letters").status_code == 401
        assert anonymous.delete("/v1/dead-letters").status_code == 401
    assert dlq.count_dead_letters() == 1


def test_the_client_reads_and_purges(dlq: Coordinator, server: ApiServer) -> None:
    entries = _bury(dlq, 2)
    with SubqClient(server.url, token=TOKEN) as subq:
        assert subq.dead_letters(limit=1) == entries[1:]
        assert subq.purge_dead_letters() == 2
        assert subq.dead_letters() == []

"""A configuration file taken up without a restart (coordinator/config_file.py): read as TOML or JSON,
read again when it changes, and what a broken one stands for (the keys file's and the tenants file's
own behaviour is tested in tests/test_security.py and tests/test_tenants.py; here, theirs for an edit
nested too deep, once a crash of every request)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from coordinator.access import KeyRing, token_sha256
from coordinator.config_file import MISSING, ReloadingFile, read_table, stamp_of
from coordinator.tenants import TenantBook, Tenants

LOGGER = "tests.config_file"
# More levels than Python's recursion limit: the JSON and TOML parsers recurse once a level.
TOO_DEEP = "[" * 100_000


def _touch(path: Path, text: str | bytes) -> None:
    """Write `text` with a modification time of its own: a rewrite within the clock's tick still reads as an edit."""
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))


def _parse(path: Path) -> dict[str, int]:
    data = read_table(path, f"TEST_FILE: {path}", wrapper="items")
    if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
        raise ValueError(f"TEST_FILE: {path}: a table of integers")
    return data


def _file(path: Path, broken: dict[str, int] | None) -> ReloadingFile[dict[str, int]]:
    return ReloadingFile(
        path, _parse, initial={"start": 0}, broken=broken, logger=logging.getLogger(LOGGER), broken_means="as said"
    )


def test_a_table_reads_from_toml_or_json_and_unwraps_its_one_named_table(tmp_path: Path) -> None:
    toml, json_file = tmp_path / "t.toml", tmp_path / "t.json"
    toml.write_text("[items]\na = 1\n")
    json_file.write_text('{"a": 1, "items": {"b": 2}}')
    assert read_table(toml, "W", wrapper="items") == {"a": 1}
    assert read_table(json_file, "W", wrapper="items") == {"a": 1, "items": {"b": 2}}, "not its only entry"


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("t.toml", "a = [", "W: not valid TOML: "),
        ("t.json", "{a", "W: not valid JSON: "),
        ("gone.json", None, "W: cannot read it: "),
        ("t.json", TOO_DEEP, "W: not valid JSON: nested too deep"),
        ("t.toml", f"a = {TOO_DEEP}", "W: not valid TOML: nested too deep"),
        ("t.toml", b'a = "\xff"', "W: not UTF-8 text (byte 0xff at offset 5)"),
    ],
)
def test_a_file_that_does_not_read_is_one_line_starting_with_where(
    tmp_path: Path, name: str, text: str | bytes | None, says: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as refused:
        read_table(path, "W", wrapper="items")
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_an_edit_is_taken_up_at_the_next_look(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("a = 1\n")
    file = _file(path, broken=None)
    assert file.current() == {"a": 1}
    _touch(path, "a = 2\n")
    assert file.current() == {"a": 2}
    swapped = tmp_path / "new.toml"
    swapped.write_text("bb = 3\n")
    os.replace(swapped, path)  # swapped in by a rename, as editors and ConfigMaps do
    assert file.current() == {"bb": 3}


@pytest.mark.parametrize(("broken", "stands_for"), [(None, {"a": 1}), ({}, {})])
def test_a_broken_file_stands_for_the_last_table_or_the_broken_value_and_is_logged_once_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: dict[str, int] | None, stands_for: dict[str, int]
) -> None:
    path = tmp_path / "t.toml"
    path.write_text("a = 1\n")
    file = _file(path, broken)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        _touch(path, "a = 'many'\n")
        assert file.current() == file.current() == stands_for
        _touch(path, "a = [\n")
        assert file.current() == stands_for
        path.unlink()
        assert stamp_of(path) == MISSING
        assert file.current() == file.current() == stands_for
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(said) == 3, said
    assert said[0] == f"TEST_FILE: {path}: a table of integers; as said"
    assert "not valid TOML" in said[1] and "cannot read it" in said[2]
    _touch(path, "a = 4\n")
    assert file.current() == {"a": 4}


@pytest.mark.parametrize(("broken", "stands_for"), [(None, {"a": 1}), ({}, {})])
def test_an_edit_too_deep_or_not_utf8_is_a_broken_file_like_any_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: dict[str, int] | None, stands_for: dict[str, int]
) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"a": 1}')
    file = _file(path, broken)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        _touch(path, TOO_DEEP)
        assert file.current() == stands_for
        _touch(path, b'{"a": "\xff"}')
        assert file.current() == stands_for
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert said == [
        f"TEST_FILE: {path}: not valid JSON: nested too deep; as said",
        f"TEST_FILE: {path}: not UTF-8 text (byte 0xff at offset 7); as said",
    ]
    _touch(path, '{"a": 4}')
    assert file.current() == {"a": 4}


def test_a_tenants_file_edited_too_deep_keeps_the_last_table_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.json"
    path.write_text('{"acme": {"submits_per_minute": 7}}')
    book = TenantBook(Tenants(), path)
    with caplog.at_level(logging.ERROR, logger="coordinator.tenants"):
        for edit in (TOO_DEEP.encode(), b'{"acme": {"submits_per_minute": 8}, "\xff": {}}'):
            _touch(path, edit)
            assert book.current().policy("acme").submits_per_minute == 7, "the last table that parsed"
    kept = "the tenants table read before stays in force until it is fixed"
    assert [r.getMessage() for r in caplog.records if r.name == "coordinator.tenants"] == [
        f"SUBQ_TENANTS_FILE: {path}: not valid JSON: nested too deep; {kept}",
        f"SUBQ_TENANTS_FILE: {path}: not UTF-8 text (byte 0xff at offset 37); {kept}",
    ]


def test_a_keys_file_edited_too_deep_refuses_its_keys_and_logs_it_without_failing_the_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"ci": {"token_sha256": token_sha256("t" * 20), "scopes": ["read"]}}))
    ring = KeyRing({}, path, legacy_token="admin-token")
    assert set(ring.keys()) == {"admin", "ci"}
    with caplog.at_level(logging.ERROR, logger="coordinator.access"):
        _touch(path, TOO_DEEP)
        assert set(ring.keys()) == {"admin"}, "fails closed, as on any edit that does not parse"
    refused = "every key of that file is refused until it is fixed"
    assert [r.getMessage() for r in caplog.records if r.name == "coordinator.access"] == [
        f"SUBQ_API_KEYS_FILE: {path}: not valid JSON: nested too deep; {refused}"
    ]


def test_a_file_broken_from_the_start_stands_for_the_initial_value_or_the_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{")
    assert _file(path, broken=None).current() == {"start": 0}
    assert _file(path, broken={}).current() == {}


def test_looks_from_many_threads_parse_a_change_once(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("a = 1\n")
    parsed: list[Path] = []

    def counting(at: Path) -> dict[str, int]:
        parsed.append(at)
        time.sleep(0.01)  # a slow parse: the other threads come to the lock while it runs
        return _parse(at)

    file = ReloadingFile(path, counting, initial={}, broken=None, logger=logging.getLogger(LOGGER), broken_means="")
    _touch(path, "a = 2\n")
    seen: list[dict[str, int]] = []
    threads = [threading.Thread(target=lambda: seen.append(file.current())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [{"a": 2}] * 8 and len(parsed) == 2, "one parse as it was made, one for the edit"

"""Refusals that come first and stay small: the caller before its body, the scope before the body's checks, a number
too long to read, a quote of what was refused, a refusal while Redis is away.

Each was found by a review against a real server: a token-less request with a body that is no JSON was answered
422 (unaudited, uncounted, past a lock-out too); a key without the scope was told what was wrong with its body
(422) rather than refused (403); a `Last-Event-ID` or page cursor of 5,000 digits was a 500; a quoted todo_id or
profile name of 900,000 characters made a 900 KB answer; and with Redis away a token-less request was answered 503
with Redis' address in it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.local.ports import free_port
from tests.helpers import AUTH, REQUEST_TIMEOUT_S, ApiServer, api_coordinator, api_server, api_settings
from tests.test_security import bearer, keys_setting, park_approval

PREFIX = "subqrefusals"
FIVE_THOUSAND_DIGITS = "9" * 5000


@pytest.fixture(scope="module")
def coord(settings: Settings) -> Iterator[Coordinator]:
    with api_coordinator(settings, PREFIX, "subq-refusals-idle") as coord:
        yield coord


_server = api_server


def _keys(coord: Coordinator) -> set[str]:
    return set(coord.client.scan_iter(f"{PREFIX}:*"))


def _refusals(coord: Coordinator) -> list[tuple[str, str]]:
    """(target, reason) of each refusal on the audit log, newest first."""
    entries, _ = coord.audit(limit=500)
    return [(e.target, e.reason or "") for e in entries if e.action == "refused"]


def test_a_body_that_is_no_json_is_refused_401_without_a_token_and_429_once_locked_out(coord: Coordinator) -> None:
    with (
        _server(coord, api_auth_attempts_per_min=3) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        before = len(_refusals(coord))
        broken = {"content": b"{" + b" " * 1000, "headers": {"Content-Type": "application/json"}}
        for _ in range(3):
            refused = http.post("/v1/tasks", **broken)  # type: ignore[arg-type]
            assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized"), refused.text
        assert len(_refusals(coord)) == before + 3, "each is on the audit log"
        locked = http.post("/v1/tasks", **broken)  # type: ignore[arg-type]
        assert (locked.status_code, locked.json()["code"]) == (429, "rate_limited")
        wrong = http.post(
            "/v1/tasks", content=b"{bad", headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"}
        )
        assert wrong.status_code == 429, "locked out: a wrong token and a broken body alike"


def test_a_key_without_the_scope_is_refused_403_before_its_body_is_checked(coord: Coordinator) -> None:
    root = coord.create_task("Alice's", todos="[ ] a", owner="alice").id
    approval = park_approval(coord, root)
    with (
        _server(coord, api_keys=keys_setting()) as api,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url) as http,
    ):
        before = _keys(coord)
        cases = [
            ("viewer", "POST", "/v1/tasks", {"x": 1}, "'submit'"),
            ("viewer", "POST", f"/v1/tasks/{root}/subtasks", {"subtasks": "no"}, "'submit'"),
            ("viewer", "PUT", f"/v1/tasks/{root}/todos", {"todos": 3}, "'submit'"),
            ("viewer", "POST", f"/v1/tasks/{root}/cancel", {"reason": ["no"]}, "'submit' or 'operate'"),
            ("viewer", "POST", f"/v1/tasks/{root}/retry", {"failed": "maybe"}, "'submit' or 'operate'"),
            ("alice", "POST", f"/v1/approvals/{approval.id}", {"decision": "maybe"}, "'decide'"),
        ]
        for name, method, path, body, scopes in cases:
            refused = http.request(method, path, json=body, headers=bearer(name))
            assert (refused.status_code, refused.json()["code"], refused.json()["field"]) == (
                403,
                "forbidden",
                "scope",
            ), (
                path,
                refused.text,
            )
            assert f"needs scope {scopes}" in refused.json()["message"]
        reasons = [reason for _target, reason in _refusals(coord)[: len(cases)]]
        assert reasons == ["missing_scope"] * len(cases), "each on the audit log"
        assert _keys(coord) - before <= {k for k in _keys(coord) if ":audit" in k}, "nothing but the log changed"
        # A key with the scope still gets its body checked, word for word as before.
        bad = http.post("/v1/tasks", json={"x": 1}, headers=bearer("alice"))
        assert (bad.status_code, bad.json()["message"]) == (422, "prompt: Field required")


def test_numbers_too_long_to_read_are_422s_naming_the_field(coord: Coordinator) -> None:
    root = coord.create_task("A root").id
    with _server(coord) as api, api.client() as http:
        for path in (f"/v1/tasks/{root}/events", f"/ui/tasks/{root}/events"):
            if path.startswith("/ui"):
                assert http.post(
                    "/ui/login", data={"token": AUTH["Authorization"].split()[1], "next": "/ui/"}
                ).status_code in (200, 303)
            refused = http.get(path, headers={**AUTH, "Last-Event-ID": f"{FIVE_THOUSAND_DIGITS}-0"})
            assert (refused.status_code, refused.json()["field"]) == (422, "last-event-id"), (path, refused.text)
            past = http.get(path, headers={**AUTH, "Last-Event-ID": "99999999999999999999999-0"})
            assert past.status_code == 422, (
                "past what Redis reads: refused before the stream starts, not a retried error"
            )
        for name in ("cursor", "limit"):
            page = http.get("/ui/", params={name: FIVE_THOUSAND_DIGITS})  # an HTML page, signed in above
            assert page.status_code == 422 and f"{name} must be a whole number from" in page.text, page.text[:500]
        before = _keys(coord)
        priority = http.post("/v1/tasks", json={"prompt": "x", "priority": FIVE_THOUSAND_DIGITS})
        assert priority.status_code == 422 and priority.json()["message"].startswith(
            "priority must be an integer from 1 to 5"
        ), priority.text
        assert "4300" not in priority.json()["message"] and len(priority.text) < 400
        schema = {"allOf": [{"type": "string"}], "$ref": f"#/allOf/{FIVE_THOUSAND_DIGITS}"}
        refused = http.post("/v1/tasks", json={"prompt": "x", "output_schema": schema})
        assert refused.status_code == 422 and "4300" not in refused.text and "int_max_str_digits" not in refused.text
        assert _keys(coord) == before, "nothing written"


def test_a_quote_of_what_was_refused_is_cut_to_a_line(coord: Coordinator) -> None:
    root = coord.create_task("A root", todos="[ ] one").id
    huge = "x" * 900_000
    with _server(coord, api_max_body_bytes=4_000_000) as api, api.client() as http:
        before = _keys(coord)
        answers = [
            http.post(
                f"/v1/tasks/{root}/subtasks", json={"subtasks": [{"description": "d", "message": "m", "todo_id": huge}]}
            ),
            http.post("/v1/tasks", json={"prompt": "x", "profile": huge}),
            http.put(f"/v1/tasks/{root}/todos", json={"todos": "1. [ ] " + huge}),
        ]
        for answer in answers:
            assert answer.status_code == 422, answer.text[:300]
            assert len(answer.content) < 2000, (len(answer.content), answer.text[:300])
            assert "xxxxxxxxxx..." in answer.json()["message"], "the quote says it was cut"
        assert _keys(coord) == before, "nothing written"


def test_a_refusal_stays_a_401_while_redis_is_away(settings: Settings) -> None:
    down = Coordinator(api_settings(settings, redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        with ApiServer(create_app(coordinator=down)) as api, api.client(headers={}) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                refused = http.get("/v1/tasks/0123456789abcdef", headers=headers)
                assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized"), refused.text
                assert "127.0.0.1" not in refused.text
            assert http.get("/v1/tasks/0123456789abcdef", headers=AUTH).status_code == 503, (
                "a caller with the token learns it"
            )
    finally:
        down.close()

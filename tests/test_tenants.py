"""Tenants and their quotas (issue 42, points 1, 4 and 6), on a real Redis.

The tenant of a tree (the key's `tenant` in the keys file, else the key's name, else the `tenant` of
`subq.submit`, else SUBQ_DEFAULT_TENANT) and its priority are on every task of it; a tenant's
quotas (submits per minute, running roots, spend per rolling day) refuse a new root with
QuotaExceeded (HTTP 429 and Retry-After), writing nothing; a bad setting, key or priority is one
clear error naming the field, and changes nothing. The acceptance test on real `celery worker`
processes is in tests/test_tenants_fleet.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator import Coordinator, Settings, TaskStatus, quotas
from coordinator.access import read_keys_file, token_sha256
from coordinator.api import create_app
from coordinator.celery_app import make_app
from coordinator.errors import ConfigError, QuotaExceeded, StoreError, ValidationError
from coordinator.models import Usage
from coordinator.runs import Ended, Run
from coordinator.settings import load_settings
from coordinator.store.quotas import HOUR_MS
from coordinator.tenants import DEFAULT_TENANT, TenantBook, Tenants, read_tenants_file
from tests.agents import agent, reply
from tests.helpers import REQUEST_TIMEOUT_S, ApiServer
from workers.runtime.context import Runtime, build_runtime
from workers.submit import submit

PREFIX = "subqtenants"
TOKEN_A1, TOKEN_A2, TOKEN_B, TOKEN_OPS = "tok-a1-" + "x" * 20, "tok-a2-" + "x" * 20, "tok-b-" + "x" * 20, "t-ops" * 5


def _clean(coord: Coordinator) -> None:
    for key in coord.client.scan_iter(f"{PREFIX}:*"):
        coord.client.delete(key)


def _keys_file(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "a1": {"token_sha256": token_sha256(TOKEN_A1), "scopes": ["submit", "read"], "tenant": "acme"},
                "a2": {"token_sha256": token_sha256(TOKEN_A2), "scopes": ["submit", "read"], "tenant": "acme"},
                "b": {"token_sha256": token_sha256(TOKEN_B), "scopes": ["submit", "read"]},
                "ops": {"token_sha256": token_sha256(TOKEN_OPS), "scopes": ["operate", "read_all"]},
            }
        )
    )
    return path


@pytest.fixture
def coord(settings: Settings, tmp_path: Path) -> Iterator[Coordinator]:
    """A Coordinator of its own prefix whose queue no worker reads: acme may submit 2 a minute."""
    own = settings.model_copy(
        update={
            "key_prefix": PREFIX,
            "queue": "subq-tenants-idle",
            "tenants": {"acme": {"submits_per_minute": 2, "max_priority": 4}},
            "api_keys_file": _keys_file(tmp_path / "keys.json"),
        }
    )
    coordinator = Coordinator(own)
    _clean(coordinator)
    yield coordinator
    _clean(coordinator)
    coordinator.close()


def _snapshot(coord: Coordinator) -> dict[str, object]:
    """Every key of the prefix with its value's type and size: what a refusal must leave as it was."""
    out: dict[str, object] = {}
    for key in sorted(coord.client.scan_iter(f"{PREFIX}:*")):
        kind = coord.client.type(key)
        size = {
            "hash": coord.client.hlen, "zset": coord.client.zcard, "list": coord.client.llen, "set": coord.client.scard,
            "stream": coord.client.xlen,
        }.get(kind, coord.client.strlen)(key)  # fmt: skip
        out[key] = (kind, size)
    return out


# -- who a tree runs for -------------------------------------------------------------------------


def test_a_tree_runs_for_the_tenant_given_and_every_child_carries_it_with_the_priority(coord: Coordinator) -> None:
    root = coord.create_task("Plan.", tenant="acme", priority=2)
    (child,) = coord.delegate(root.id, [{"description": "c", "message": "m"}]).child_ids
    assert (root.tenant, root.priority) == ("acme", 2)
    assert (coord.get_task(child).tenant, coord.get_task(child).priority) == ("acme", 2)
    plain = coord.create_task("No tenant.")
    assert (plain.tenant, plain.priority) == (DEFAULT_TENANT, 3)
    capped = coord.create_task("Urgent.", tenant="acme", priority=5)
    assert capped.priority == 4, "acme's max_priority cuts it"
    # The history filters by tenant.
    items, _ = coord.list_tasks(tenant="acme")
    assert {item.id for item in items} == {root.id, child, capped.id}
    assert all(item.tenant == "acme" for item in items)


@pytest.mark.parametrize("priority", [0, 6, "high", True, 2.5])
def test_a_bad_priority_is_refused_naming_it_and_writes_nothing(coord: Coordinator, priority: object) -> None:
    before = _snapshot(coord)
    with pytest.raises(ValidationError) as caught:
        coord.create_task("x", priority=priority)  # type: ignore[arg-type]
    assert caught.value.field == "priority" and "from 1 to 5" in caught.value.message
    assert _snapshot(coord) == before


def test_subq_submit_takes_a_tenant_and_a_priority_and_refuses_bad_ones(coord: Coordinator) -> None:
    done = submit(coord, (), {"prompt": "From Celery.", "run": False, "tenant": "acme", "priority": 1}, "m-1")
    assert "error" not in done
    record = coord.get_task(done["task_id"])
    assert (record.tenant, record.priority) == ("acme", 1)
    before = _snapshot(coord)
    for bad, field in (({"tenant": "a b"}, "tenant"), ({"priority": 9}, "priority")):
        got = submit(coord, (), {"prompt": "Bad.", "run": False, **bad}, f"m-{field}")
        assert got["error"]["field"] == field and got["error"]["code"] == "invalid_input"
    assert _snapshot(coord) == before


# -- settings, the tenants file and the keys file ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"acme": {"weight": 0}}', "tenant 'acme': weight"),
        ('{"acme": {"submits": 3}}', "tenant 'acme': submits: Extra inputs are not permitted"),
        ('{"ac me": {}}', "tenant 'ac me': a tenant is 1 to 64"),
        ('{"acme": {"max_cost_usd_per_day": "lots"}}', "max_cost_usd_per_day must be a number"),
        ('{"acme": {"max_cost_usd_per_day": 0.0000001}}', "finer than one micro-dollar"),
        ('{"acme": {"max_priority": 6}}', "tenant 'acme': max_priority"),
        ('{"acme": {"max_running_roots": true}}', "tenant 'acme': max_running_roots: give a whole number, not true"),
        ('{"acme": {"weight": false}}', "tenant 'acme': weight: give a whole number, not false"),
        ("[1, 2]", "must be a table of tenants"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_malformed_subq_tenants_is_one_line_naming_the_tenant_and_the_field(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tenants=value)
    assert caught.value.field == "SUBQ_TENANTS" and says in str(caught.value), str(caught.value)


def test_max_cost_usd_per_day_is_kept_exactly_in_micro_usd() -> None:
    settings = load_settings(tenants='{"acme": {"max_cost_usd_per_day": 0.05}, "*": {"max_cost_usd_per_day": "12.5"}}')
    assert settings.tenants["acme"].max_cost_micros_per_day == 50_000
    assert settings.tenants_inline().policy("anyone").max_cost_micros_per_day == 12_500_000


def test_a_bad_default_tenant_or_tenants_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(default_tenant="no spaces")
    assert caught.value.field == "SUBQ_DEFAULT_TENANT"
    bad = tmp_path / "tenants.toml"
    bad.write_text("[acme]\nweight = -1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(tenants_file=bad)
    assert caught.value.field == "SUBQ_TENANTS_FILE" and "tenant 'acme': weight" in str(caught.value)


def test_the_tenants_file_is_read_again_when_it_changes_and_a_broken_edit_keeps_the_last_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[acme]\nsubmits_per_minute = 5\n\n["*"]\nweight = 2\n')
    book = TenantBook(Tenants(), path)
    assert book.current().policy("acme").submits_per_minute == 5
    assert book.current().policy("other").weight == 2 and book.current().fair_shares
    path.write_text("[acme]\nsubmits_per_minute = 7\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert book.current().policy("acme").submits_per_minute == 7
    path.write_text("[acme]\nsubmits_per_minute = 'many'\n")  # a botched edit: the last good table stays
    assert book.current().policy("acme").submits_per_minute == 7
    with pytest.raises(ValueError, match=r"SUBQ_TENANTS_FILE: .*tenant 'acme': submits_per_minute"):
        read_tenants_file(path)


def test_a_tenants_file_broken_before_its_first_use_keeps_the_table_the_start_read(
    settings: Settings, tmp_path: Path
) -> None:
    """The table is read at start (a bad one stops it) and again on first use, which can be hours later: a file
    botched in between made that process use SUBQ_TENANTS alone, every quota of the file lifted."""
    path = tmp_path / "tenants.toml"
    path.write_text("[acme]\nmax_running_roots = 1\nmax_cost_usd_per_day = 5\n")
    started = settings.model_copy(update={"key_prefix": PREFIX, "queue": "subq-tenants-idle"})
    started = load_settings(
        **{**started.model_dump(exclude={"openai_api_key", "anthropic_api_key"}), "tenants_file": path}
    )
    path.write_text("[acme\nmax_running_roots = 1\n")  # broken after the start read it
    coordinator = Coordinator(started)
    try:
        _clean(coordinator)
        policy = coordinator.plane.tenants.policy("acme")
        assert (policy.max_running_roots, policy.max_cost_micros_per_day) == (1, 5_000_000)
        coordinator.create_task("the first root", tenant="acme")
        with pytest.raises(QuotaExceeded, match="acme"):
            coordinator.create_task("a second root, over the quota", tenant="acme")
    finally:
        _clean(coordinator)
        coordinator.close()


def test_a_keys_file_may_give_several_keys_one_tenant_and_refuses_a_bad_one(tmp_path: Path) -> None:
    keys = read_keys_file(_keys_file(tmp_path / "keys.json"))
    assert keys["a1"].principal().tenant == keys["a2"].principal().tenant == "acme"
    assert keys["b"].principal().tenant == "b", "a key that names none is its own tenant"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k": {"token_sha256": token_sha256("t" * 20), "scopes": ["submit"], "tenant": "x y"}}))
    with pytest.raises(ValueError, match=r"key 'k': tenant: 1 to 64 letters"):
        read_keys_file(bad)


# -- quotas -------------------------------------------------------------------------------------


def test_submits_per_minute_refuse_the_next_root_naming_the_tenant_and_writing_nothing(coord: Coordinator) -> None:
    coord.create_task("one", tenant="acme")
    coord.create_task("two", tenant="acme")
    before = _snapshot(coord)
    with pytest.raises(QuotaExceeded) as caught:
        coord.create_task("three", tenant="acme")
    error = caught.value
    assert (error.tenant, error.quota, error.field) == ("acme", "submits_per_minute", "submits_per_minute")
    assert "Quota exceeded: tenant 'acme' created 2 roots in the last minute" in error.message
    assert 1 <= error.retry_after_s <= 60 and "it resets in" in error.message
    assert _snapshot(coord) == before, "a refused submit changes nothing"
    assert coord.create_task("another tenant's", tenant="globex").tenant == "globex"


def test_a_retried_submit_of_the_same_root_counts_once(coord: Coordinator) -> None:
    first = coord.create_task("once", tenant="acme", idempotency_key="k-1")
    again = coord.create_task("once", tenant="acme", idempotency_key="k-1")
    assert again.id == first.id
    assert coord.store.quotas.usage("acme").submits_last_minute == 1


def test_a_tenant_without_a_running_roots_quota_keeps_no_root_past_the_retention(coord: Coordinator) -> None:
    """Nothing pruned the running roots without max_running_roots: a busy tenant's set kept every root it made."""
    quotas, now_ms = coord.store.quotas, int(time.time() * 1000)
    retention_ms = coord.settings.result_retention_s * 1000
    free = {"submits_per_minute": 0, "max_running_roots": 0, "max_cost_micros_per_day": 0}
    assert quotas.count_root("busy", "old-root", now_ms=now_ms - retention_ms - 1, **free).accepted
    assert quotas.count_root("busy", "kept-root", now_ms=now_ms - retention_ms + 60_000, **free).accepted
    assert quotas.count_root("busy", "new-root", now_ms=now_ms, **free).accepted
    assert coord.client.zrange(coord.store.keys.tenant_roots("busy"), 0, -1) == ["kept-root", "new-root"]


def test_a_refused_submit_with_an_idempotency_key_leaves_no_key_and_its_retry_is_counted_later(
    coord: Coordinator,
) -> None:
    coord.create_task("one", tenant="acme")
    coord.create_task("two", tenant="acme")
    before = _snapshot(coord)
    with pytest.raises(QuotaExceeded):
        coord.create_task("three", tenant="acme", idempotency_key="job-3")
    assert _snapshot(coord) == before, "the refused submit's idempotency key is not kept"
    coord.client.delete(coord.store.keys.tenant_submits("acme"))  # the minute has passed
    third = coord.create_task("three", tenant="acme", idempotency_key="job-3")
    assert coord.create_task("three", tenant="acme", idempotency_key="job-3").id == third.id


def test_two_submits_at_once_cannot_both_take_the_last_running_root(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root is counted before its record is written: a second submit in between used to read the first root as
    ended (no status), take it out of the running set, and take the place too."""
    own = settings.model_copy(
        update={"key_prefix": PREFIX, "queue": "subq-tenants-idle", "tenants": {"acme": {"max_running_roots": 1}}}
    )
    coord = Coordinator(own)
    _clean(coord)
    create_root = coord.store.records.create_root
    counted, go_on = threading.Event(), threading.Event()

    def first_is_slow(*args: Any, **kwargs: Any) -> bool:
        if threading.current_thread().name == "first":
            counted.set()  # counted against the quota; its record not written yet
            go_on.wait(30)
        return create_root(*args, **kwargs)

    monkeypatch.setattr(coord.store.records, "create_root", first_is_slow)
    first = threading.Thread(target=coord.create_task, args=("first",), kwargs={"tenant": "acme"}, name="first")
    first.start()
    try:
        assert counted.wait(30)
        with pytest.raises(QuotaExceeded) as caught:
            coord.create_task("second", tenant="acme")
        assert caught.value.quota == "max_running_roots"
    finally:
        go_on.set()
        first.join(30)
    try:
        assert coord.store.quotas.usage("acme").roots_running == 1
        # A root counted whose submit died before writing it frees its place once it is a minute old.
        coord.client.zadd(coord.store.keys.tenant_roots("acme"), {"f" * 16: time.time() * 1000 - 61_000})
        assert coord.store.quotas.usage("acme").roots_running == 1
    finally:
        _clean(coord)
        coord.close()


def test_running_roots_and_the_day_spend_refuse_until_they_free(settings: Settings) -> None:
    own = settings.model_copy(
        update={
            "key_prefix": PREFIX,
            "queue": "subq-tenants-idle",
            "tenants": {"acme": {"max_running_roots": 1, "max_cost_usd_per_day": 0.05}},
        }
    )
    coord = Coordinator(own)
    _clean(coord)
    try:
        first = coord.create_task("running", tenant="acme")
        with pytest.raises(QuotaExceeded) as caught:
            coord.create_task("second", tenant="acme")
        assert caught.value.quota == "max_running_roots" and "when one of them ends" in caught.value.message
        coord.cancel(first.id, "make room")
        second = coord.create_task("second", tenant="acme")
        # The day's spend: counted once per request, however often its step is repeated.
        assert coord.store.quotas.count_spend("acme", f"{second.id}:1:1", 30_000) == 30_000
        assert coord.store.quotas.count_spend("acme", f"{second.id}:1:1", 30_000) == 30_000
        assert coord.store.quotas.count_spend("acme", f"{second.id}:1:2", 30_000) == 60_000
        coord.cancel(second.id, "make room")
        coord.store.quotas.usage("acme")  # takes the ended roots out, as every check does first
        before = _snapshot(coord)
        with pytest.raises(QuotaExceeded) as caught:
            coord.create_task("third", tenant="acme")
        error = caught.value
        assert error.quota == "max_cost_usd_per_day" and error.tenant == "acme"
        assert "spent $0.060000 in the last 24 h; its max_cost_usd_per_day is $0.050000" in error.message
        assert 3600 * 23 < error.retry_after_s <= 24 * 3600, "the spend leaves the day 24 h after its hour"
        assert _snapshot(coord) == before
        assert coord.create_task("B's", tenant="globex").tenant == "globex"
        # Spend older than the day no longer counts.
        old_ms = int(time.time() * 1000) - 25 * 3600 * 1000
        coord.client.delete(coord.store.keys.tenant_spend("globex"))
        coord.store.quotas.count_spend("globex", "old:1", 99_000, now_ms=old_ms)
        assert coord.store.quotas.usage("globex").spent_micros_day == 0
    finally:
        _clean(coord)
        coord.close()


# -- the faces ----------------------------------------------------------------------------------


def test_the_api_names_each_keys_tenant_refuses_over_quota_with_429_and_shows_tenants(coord: Coordinator) -> None:
    with ApiServer(create_app(coord.settings, coordinator=coord)) as api:
        a1, a2, b, ops = (
            httpx.Client(timeout=REQUEST_TIMEOUT_S, base_url=api.url, headers={"Authorization": f"Bearer {token}"})
            for token in (TOKEN_A1, TOKEN_A2, TOKEN_B, TOKEN_OPS)
        )
        made = a1.post("/v1/tasks", json={"prompt": "A1's", "priority": 5})
        assert made.status_code == 201, made.text
        record = a1.get(f"/v1/tasks/{made.json()['id']}").json()
        assert (record["tenant"], record["priority"]) == ("acme", 4)
        assert a2.post("/v1/tasks", json={"prompt": "A2's"}).status_code == 201
        refused = a2.post("/v1/tasks", json={"prompt": "A2's second"})
        assert refused.status_code == 429
        body = refused.json()
        assert body["code"] == "quota_exceeded" and body["field"] == "submits_per_minute"
        assert "tenant 'acme'" in body["message"] and "it resets in" in body["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert b.post("/v1/tasks", json={"prompt": "B's"}).json()["tenant"] == "b"
        bad = b.post("/v1/tasks", json={"prompt": "B's", "priority": 0})
        assert bad.status_code == 422 and bad.json()["field"] == "priority"
        # The history filter, and the operator's view.
        listed = ops.get("/v1/tasks", params={"tenant": "acme"}).json()["items"]
        assert len(listed) == 2 and {item["tenant"] for item in listed} == {"acme"}
        assert b.get("/v1/tenants").status_code == 403
        tenants = {t["tenant"]: t for t in ops.get("/v1/tenants").json()["tenants"]}
        assert tenants["acme"]["listed"] and tenants["acme"]["submits_last_minute"] == 2
        assert tenants["acme"]["roots_running"] == 2 and tenants["acme"]["policy"]["submits_per_minute"] == 2
        assert tenants["b"]["roots_running"] == 1 and not tenants["b"]["listed"]
        # Metrics per tenant, with bounded labels: only a listed tenant has its own; the rest are `other`.
        metrics = httpx.get(f"{api.url}/metrics", timeout=REQUEST_TIMEOUT_S).text
        assert 'subq_tenant_roots_running{tenant="acme"} 2.0' in metrics
        assert 'subq_tenant_submits_last_minute{tenant="other"} 1.0' in metrics
        assert 'tenant="b"' not in metrics


def test_the_cli_shows_tenants_takes_a_priority_and_exits_75_over_a_quota(coord: Coordinator) -> None:
    from tests.test_cli import cli

    env = {
        "SUBQ_REDIS_URL": str(coord.settings.redis_url),
        "SUBQ_KEY_PREFIX": PREFIX,
        "SUBQ_QUEUE": "subq-tenants-idle",
        "SUBQ_TENANTS": json.dumps({"acme": {"submits_per_minute": 2, "max_cost_usd_per_day": 0.05}}),
        "SUBQ_DEFAULT_TENANT": "acme",
    }
    made = cli("run", "First.", "--priority", "5", env=env)
    assert made.returncode == 0, made.stderr
    assert (coord.get_task(made.stdout.strip()).tenant, coord.get_task(made.stdout.strip()).priority) == ("acme", 5)
    bad = cli("run", "Bad.", "--priority", "9", env=env)
    assert bad.returncode == 1 and "priority must be an integer from 1 to 5" in bad.stderr
    assert cli("run", "Second.", env=env).returncode == 0
    refused = cli("run", "Third.", env=env)
    assert refused.returncode == 75
    assert refused.stderr.startswith("subq: Quota exceeded: tenant 'acme' created 2 roots in the last minute")
    shown = cli("tenants", env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["tenant", "running", "waiting", "roots", "submits/min", "spend", "today"]
    assert lines[1].split() == ["acme", "0", "0", "2", "2/2", "$0.000000", "/", "$0.050000"]
    listed = json.loads(cli("tenants", "--json", env=env).stdout)
    assert listed[0]["tenant"] == "acme" and listed[0]["policy"]["max_cost_micros_per_day"] == 50_000
    history = json.loads(cli("history", "--tenant", "acme", "--json", env=env).stdout)
    assert len(history["items"]) == 2 and {i["tenant"] for i in history["items"]} == {"acme"}


@contextmanager
def _day_quota(settings: Settings) -> Iterator[tuple[Coordinator, Runtime, str]]:
    """acme with a day quota of $1, on a queue no worker reads: a coordinator, a worker's runtime to start its runs
    in this process, and the key of acme's day of spend."""
    own = settings.model_copy(
        update={"key_prefix": PREFIX, "queue": "subq-tenants-idle", "tenants": {"acme": {"max_cost_usd_per_day": 1}}}
    )
    coord = Coordinator(own)
    _clean(coord)
    runtime = build_runtime(own, make_app(own))
    try:
        yield coord, runtime, coord.store.keys.tenant_spend("acme")
    finally:
        runtime.coordinator.close()
        _clean(coord)
        coord.close()


def test_a_run_stops_its_tree_on_its_tenants_day_only_while_the_day_is_still_over(settings: Settings) -> None:
    """A response takes the tenant's day to its quota; the run stops its tree at its next check, which may come
    minutes later, after its tool calls. Had the day's oldest hour left it meanwhile, the stop fell through to
    a budget the tree had not spent (`budget of $0.000000 exhausted`, which `subq retry` then refuses)."""
    with _day_quota(settings) as (coord, runtime, spend_key):
        oldest_hour = int(time.time() * 1000) // HOUR_MS - 23  # the next to leave the rolling day
        for still_over in (False, True):
            task = coord.create_task(agent(reply("x")), run=True, tenant="acme")
            run = runtime.lifecycle.start(task.id)
            assert isinstance(run, Run)
            coord.store.quotas.count_spend("acme", f"old:{still_over}", 900_000, now_ms=oldest_hour * HOUR_MS + 1)
            run.record_response(
                1, Usage(tokens_in=10, tokens_out=10), 200_000, "provider", latency_ms=1.0, tool=None, text=""
            )
            assert run.tenant_over_day, "the response took the day to $1.10"
            if not still_over:
                coord.client.hdel(spend_key, str(oldest_hour))  # its oldest hour left the day

            check = run.check_stop()

            if still_over:
                assert check.stopped and check.budget_holder == task.id
                run.stopped(check.budget_holder)
                stopped = coord.get_task(task.id)
                assert (stopped.status, stopped.error_class) == (TaskStatus.FAILED, "TenantQuotaExceeded"), (
                    stopped.error
                )
            else:
                assert not check.stopped, "the day is under its quota again: the run goes on"
                run.end(Ended("completed", summary="done"))
                assert coord.get_task(task.id).status == TaskStatus.COMPLETED
            runtime.lifecycle.heartbeat.forget(run)
            coord.client.delete(spend_key)


def test_a_response_whose_count_into_the_day_redis_refused_is_counted_when_its_spend_is_recorded(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis refused a response's count into its tenant's day: the run failed outside the agent, and its held
    spend went to the heartbeat, which recorded it on the task and its tree, never on the day (the quota could be
    passed by that much). The heartbeat counts it into the day too, once."""
    with _day_quota(settings) as (coord, runtime, spend_key):
        task = coord.create_task(agent(reply("x")), run=True, tenant="acme")
        run = runtime.lifecycle.start(task.id)
        assert isinstance(run, Run)
        count = coord.store.quotas.count_spend
        refused: list[str] = []

        def refused_once(tenant: str, request: str, cost_micros: int, now_ms: int | None = None) -> int:
            if not refused:
                refused.append(request)
                raise StoreError("Redis is unavailable: Connection refused")
            return count(tenant, request, cost_micros, now_ms)

        monkeypatch.setattr(runtime.lifecycle.plane.store.quotas, "count_spend", refused_once)
        with pytest.raises(StoreError):
            run.record_response(
                1, Usage(tokens_in=10, tokens_out=10), 200_000, "provider", latency_ms=1.0, tool=None, text=""
            )
        run.abandon()  # as run_child does on a StoreError
        runtime.lifecycle.heartbeat.late_spends.record(runtime.lifecycle.plane)
        runtime.lifecycle.heartbeat.late_spends.record(runtime.lifecycle.plane)  # a second beat counts nothing more
        assert coord.get_task(task.id).cost_micros == 200_000, "on the task"
        assert coord.store.quotas.day_spend("acme") == 200_000, "and on its tenant's day, once"
        runtime.lifecycle.heartbeat.forget(run)


def test_a_retry_or_a_run_that_starts_over_the_tenants_day_makes_no_request(settings: Settings) -> None:
    """The day stopped a tree: its retry is refused as a new root is, and nothing changes. A run that starts while the
    day is over (a task retried inside a tree, a caller's delegation: no submit's check sees them) stops its tree
    before its first request; before, that request went ahead at every retry. A run that starts under it goes on."""
    with _day_quota(settings) as (coord, runtime, spend_key):
        stopped = coord.create_task("stopped by the day", tenant="acme", run=True)
        coord.store.runs.finish_task(stopped.id, "failed", error="the day", error_class="TenantQuotaExceeded")
        coord.store.quotas.count_spend("acme", "spent", 1_200_000)
        before = _snapshot(coord)
        with pytest.raises(QuotaExceeded) as caught:
            coord.retry(stopped.id)
        assert caught.value.quota == "max_cost_usd_per_day"
        assert "spent $1.200000 in the last 24 h" in caught.value.message
        assert _snapshot(coord) == before and coord.get_task(stopped.id).status == TaskStatus.FAILED

        for over in (True, False):
            coord.client.delete(spend_key)
            task = coord.create_task(agent(reply("x")), run=True, tenant="acme")  # a submit under the day
            if over:
                coord.store.quotas.count_spend("acme", "taken", 1_200_000)  # another tree took the day meanwhile
            run = runtime.lifecycle.start(task.id)
            assert isinstance(run, Run)
            check = run.check_stop()  # what the run asks before its first request
            if over:
                assert check.stopped and check.budget_holder == task.id
                run.stopped(check.budget_holder)
                ended = coord.get_task(task.id)
                assert (ended.status, ended.error_class, ended.requests) == (
                    TaskStatus.FAILED, "TenantQuotaExceeded", 0
                ), ended.error  # fmt: skip
            else:
                assert not check.stopped and not run.tenant_over_day, "under the day: the run goes on"
                run.end(Ended("completed", summary="done"))
                assert coord.get_task(task.id).status == TaskStatus.COMPLETED
            runtime.lifecycle.heartbeat.forget(run)


def test_a_retried_root_counts_against_max_running_roots_again(settings: Settings) -> None:
    """A retry runs an ended root again: it takes a running place, so a tenant at its limit cannot run one more
    root by retrying one; a refused retry changes nothing."""
    own = settings.model_copy(
        update={"key_prefix": PREFIX, "queue": "subq-tenants-idle", "tenants": {"acme": {"max_running_roots": 1}}}
    )
    coord = Coordinator(own)
    _clean(coord)
    try:
        first = coord.create_task("fails", tenant="acme", run=True)  # on a queue no worker reads
        coord.store.runs.finish_task(first.id, "failed", error="boom", error_class="RuntimeError")
        second = coord.create_task("runs", tenant="acme")  # the failed root has left the running roots
        before = _snapshot(coord)
        with pytest.raises(QuotaExceeded) as caught:
            coord.retry(first.id)
        assert caught.value.quota == "max_running_roots" and "has 1 roots running" in caught.value.message
        assert _snapshot(coord) == before and coord.get_task(first.id).status == TaskStatus.FAILED
        coord.cancel(second.id, "make room")
        assert coord.retry(first.id).task.status != TaskStatus.FAILED
        assert coord.store.quotas.running_roots("acme") == [first.id]
        with pytest.raises(QuotaExceeded):
            coord.create_task("third", tenant="acme")
    finally:
        _clean(coord)
        coord.close()


def test_a_retrys_count_holds_until_its_step_and_a_dead_one_lets_go(settings: Settings) -> None:
    """A retry counts its ended root before its step (the tenant's keys are not the tree's): a count of the
    running roots in between (another submit, `subq tenants`) keeps it, where it would take it for ended and
    let the tenant run one over; a count a minute later, the retry having died, lets it go."""
    own = settings.model_copy(
        update={"key_prefix": PREFIX, "queue": "subq-tenants-idle", "tenants": {"acme": {"max_running_roots": 1}}}
    )
    coord = Coordinator(own)
    _clean(coord)
    try:
        root = coord.create_task("fails", tenant="acme", run=True)
        task_key = coord.store.keys.task(root.id, root.id)
        coord.store.runs.finish_task(root.id, "failed", error="boom")
        coord.client.hset(task_key, "finished_at", str(time.time() - 120))  # it ended two minutes ago,
        coord.client.zadd(coord.store.keys.tenant_roots("acme"), {root.id: time.time() * 1000 - 180_000})  # made 3
        assert coord.store.quotas.usage("acme").roots_running == 0
        quotas.check_retried_root(coord.plane, coord.get_task(root.id))  # the retry's count, its step to come
        key = coord.store.keys.tenant_roots("acme")
        counted_ms = coord.client.zscore(key, root.id)
        assert coord.store.quotas.usage("acme").roots_running == 1, "held while the retry's step is to come"
        assert coord.client.zscore(key, root.id) == counted_ms, "not counted anew: held a minute from its count"
        with pytest.raises(QuotaExceeded):
            coord.create_task("one more", tenant="acme")
        coord.client.zadd(coord.store.keys.tenant_roots("acme"), {root.id: time.time() * 1000 - 61_000})
        assert coord.store.quotas.usage("acme").roots_running == 0, "a retry that died a minute ago lets it go"
    finally:
        _clean(coord)
        coord.close()


def test_a_root_running_longer_than_a_retention_stays_counted(coord: Coordinator) -> None:
    """A submit drops the roots counted longer ago than a retention; a count of the running roots (every check,
    `subq tenants`, a scrape) counts a root still running as of now, so a long one is not dropped."""
    quotas, key = coord.store.quotas, coord.store.keys.tenant_roots("slow")
    root = coord.create_task("long", tenant="slow")
    retention_ms = coord.settings.result_retention_s * 1000
    coord.client.zadd(key, {root.id: time.time() * 1000 - retention_ms + 5_000})  # counted almost a retention ago
    assert quotas.usage("slow").roots_running == 1
    later_ms = int(time.time() * 1000) + 10_000  # a submit after the first count's retention
    free = {"submits_per_minute": 0, "max_running_roots": 0, "max_cost_micros_per_day": 0}
    assert quotas.count_root("slow", "next-root", now_ms=later_ms, **free).accepted
    assert sorted(coord.client.zrange(key, 0, -1)) == sorted([root.id, "next-root"])

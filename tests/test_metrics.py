"""Each worker's own /metrics, summed across the fleet, equals a tree's own figures; bad ports fail clearly.

One tree (a root that plans offline and delegates its items in parallel, one of
them nesting steps of its own) runs on two real `celery worker` processes, each
serving its counters on a port of its own (SUBQ_WORKER_METRICS_PORT). Their
scrapes, added up as Prometheus's `sum()` would, give the tree's tokens and
micro-USD exactly, one ended task per task of the tree, and one model request
per request the coordinator recorded. The API's /metrics shows the fleet's
state (nothing in flight once the tree has ended).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from coordinator import ConfigError, Coordinator, Settings, load_settings
from coordinator.api import create_app
from coordinator.api.ops import SubqCollector
from coordinator.errors import FleetError
from coordinator.local.fleet import WorkerFleet, settings_env
from coordinator.local.ports import free_port
from coordinator.store import LATENCY_BUCKETS_MS
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, USAGE, agent, call, reply, subtask
from tests.helpers import REQUEST_TIMEOUT_S, ApiServer, api_settings, eventually
from workers import observe as metrics

PLAN = """\
[ ] Collect the sales figures for Q3
[ ] Summarise customer feedback
[ ] Check the figures against the ledger: reconcile the orders; reconcile the refunds
"""
TREE_TIMEOUT_S = 120
Samples = list[tuple[str, dict[str, str], float]]
# (series name, its labels sorted) -> value, summed over the processes scraped.
Counts = Counter[tuple[str, tuple[tuple[str, str], ...]]]


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def fleet_sum(ports: list[int]) -> Counts:
    """Every worker's series added up, as Prometheus's sum() over the fleet would."""
    counts = Counts()
    for port in ports:
        for name, labels, value in scrape(f"http://127.0.0.1:{port}/metrics"):
            if not name.endswith("_created"):
                counts[(name, tuple(sorted(labels.items())))] += value
    return counts


def total(samples: Samples | Counts, name: str, **labels: str) -> float:
    rows = [(n, dict(got), v) for (n, got), v in samples.items()] if isinstance(samples, Counter) else samples
    return sum(value for n, got, value in rows if n == name and labels.items() <= got.items())


def nodes(tree: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield tree
    for child in tree["children"]:
        yield from nodes(child)


@pytest.fixture(scope="module")
def metered(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, list[int]]]:
    """Two worker processes of a queue and prefix of their own, each serving /metrics on its own port."""
    first = free_port(2)
    own = api_settings(
        settings, queue="subq-metrics-tree", key_prefix="subqmtree", worker_metrics_port=first,
        worker_metrics_host="127.0.0.1",
    )  # fmt: skip
    with WorkerFleet(own, 2, tmp_path_factory.mktemp("metered"), name="m") as fleet:
        fleet.wait_ready()
        ports = [first, first + 1]  # a local fleet's process i serves the port + i
        for port in ports:  # each answers, with the families it defines (no series until it counts one)
            assert (
                "# TYPE subq_tokens_total counter"
                in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=REQUEST_TIMEOUT_S).text
            )
        coord = Coordinator(own)
        yield coord, ports
        coord.close()


def run_tree(
    coord: Coordinator, ports: list[int], prompt: str, **create: Any
) -> tuple[dict[str, Any], Counts, Samples]:
    """(the tree as GET /v1/tasks/{id}/tree shows it, what the workers counted while it ran, the API's /metrics)."""
    before = fleet_sum(ports)
    root = coord.create_task(prompt, run=True, **create)
    coord.wait(root.id, TREE_TIMEOUT_S)
    with ApiServer(create_app(coordinator=coord)) as server, server.client() as http:
        tree = http.get(f"/v1/tasks/{root.id}/tree").json()
        fleet = scrape(f"{server.url}/metrics")
    tasks = list(nodes(tree))

    def counted() -> Counts | None:
        # A run counts its end as run.end returns: a moment after the tree shows it ended.
        delta = fleet_sum(ports)
        delta.subtract(before)
        return delta if total(delta, "subq_tasks_ended_total") >= len(tasks) else None

    return tree, eventually(counted, "every task of the tree counted as ended"), fleet


def ended_by_status(counts: Counts) -> dict[tuple[str, str], int]:
    ended = Counter[tuple[str, str]]()
    for (name, labels), value in counts.items():
        if name == "subq_tasks_ended_total" and value:
            ended[(dict(labels)["profile"], dict(labels)["status"])] += int(value)
    return dict(ended)


def test_one_tree_counts_what_the_tree_spent(metered: tuple[Coordinator, list[int]]) -> None:
    coord, ports = metered
    tree, counts, fleet = run_tree(coord, ports, "Prepare the Q3 report", todos=PLAN)
    tasks = list(nodes(tree))
    assert len(tasks) >= 6 and {t["status"] for t in tasks} == {"completed"}
    requests = sum(coord.get_task(t["id"]).requests for t in tasks)
    assert tree["total_tokens"] > 0 and tree["total_cost_micros"] > 0
    # Prometheus's sum() over the fleet's workers: the tree's own figures, exactly.
    assert total(counts, "subq_tokens_total") == tree["total_tokens"]
    assert total(counts, "subq_tokens_total", direction="in") + total(
        counts, "subq_tokens_total", direction="out"
    ) == sum(coord.get_task(t["id"]).tokens for t in tasks)
    assert total(counts, "subq_cost_micro_usd_total") == tree["total_cost_micros"]
    assert total(counts, "subq_cost_micro_usd_total", model="offline", profile="offline") == tree["total_cost_micros"]
    assert ended_by_status(counts) == {("offline", "completed"): len(tasks)}
    assert total(counts, "subq_tasks_started_total") == len(tasks)
    assert total(counts, "subq_runs_started_total") > len(tasks), "each parent ran again once its children ended"
    assert total(counts, "subq_run_redeliveries_total") == 0
    assert total(counts, "subq_model_requests_total", provider="offline", model="offline", outcome="ok") == requests
    assert total(counts, "subq_model_requests_total") == requests, "no request failed or was retried"
    assert total(counts, "subq_worker_model_request_latency_seconds_count") == requests
    assert total(counts, "subq_budget_stops_total") == 0
    # The API's figures are the fleet's state: nothing waits or runs once the tree has ended.
    queue = coord.settings.queue
    assert total(fleet, "subq_runs_in_flight", queue=queue) == 0
    assert total(fleet, "subq_queue_depth", queue=queue) == 0
    assert total(fleet, "subq_approvals_waiting") == 0
    assert not [s for s in fleet if s[0].startswith("subq_tokens")], "token counters are the workers' own"


def test_failures_and_retries_are_counted_by_status_and_outcome(metered: tuple[Coordinator, list[int]]) -> None:
    """A fan-out where one child's provider rate-limits it once and another's refuses it."""
    coord, ports = metered
    retried = {"reply": "A done", "usage": USAGE, "transient": {"kind": "rate_limit", "times": 1}}
    root = agent(
        call(
            "run_subagents", tasks=[subtask("A", retried), subtask("B", {"fail": "refused"}), subtask("C", reply("C"))]
        ),
        call("attempt_completion", result="Report with one part missing"),
        text="Prepare the report.",
    )
    tree, counts, _ = run_tree(coord, ports, root)
    tasks = list(nodes(tree))
    assert sorted(t["status"] for t in tasks) == ["completed", "completed", "completed", "failed"]
    requests = sum(coord.get_task(t["id"]).requests for t in tasks)
    assert ended_by_status(counts) == {("offline", "completed"): 3, ("offline", "failed"): 1}
    outcomes = {o: total(counts, "subq_model_requests_total", outcome=o) for o in ("ok", "transient_error", "error")}
    assert outcomes == {"ok": requests, "transient_error": 1, "error": 1}
    assert total(counts, "subq_tokens_total") == tree["total_tokens"] == requests * STEP_TOKENS
    assert total(counts, "subq_cost_micro_usd_total") == tree["total_cost_micros"] == requests * STEP_COST_MICROS
    cache = {k: total(counts, "subq_cache_tokens_total", kind=k) for k in ("read", "write")}
    assert cache == {"read": requests * USAGE["cache_read"], "write": requests * USAGE["cache_write"]}


def test_the_api_counts_runs_in_flight_and_approvals_waiting(settings: Settings) -> None:
    coord = Coordinator(api_settings(settings, key_prefix="subqminflight", queue="subq-minflight-nobody"))
    try:
        for prompt in ("one", "two"):
            coord.create_task(prompt, run=True)  # published, on a queue no worker reads: in flight
        with ApiServer(create_app(coordinator=coord)) as server:
            fleet = scrape(f"{server.url}/metrics")
        assert total(fleet, "subq_runs_in_flight", queue="subq-minflight-nobody") == 2
        assert total(fleet, "subq_queue_depth", queue="subq-minflight-nobody") == 2
        assert total(fleet, "subq_approvals_waiting") == 0
    finally:
        for key in coord.client.scan_iter("subqminflight:*"):
            coord.client.delete(key)
        coord.client.delete("subq-minflight-nobody")
        coord.close()


# -- bad settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["nine", "0", "70000", "9477.5"])
def test_a_port_that_is_not_a_port_is_refused_naming_the_setting(port: str) -> None:
    with pytest.raises(ConfigError, match=r"^Invalid setting SUBQ_WORKER_METRICS_PORT: ") as caught:
        load_settings(worker_metrics_port=port)
    assert caught.value.field == "SUBQ_WORKER_METRICS_PORT"


def test_an_empty_port_is_unset_and_prefork_is_refused() -> None:
    assert load_settings(worker_metrics_port="").worker_metrics_port is None
    with pytest.raises(ConfigError, match="SUBQ_WORKER_METRICS_PORT: not served with SUBQ_WORKER_POOL=prefork"):
        load_settings(worker_metrics_port=9477, worker_pool="prefork")


def test_a_worker_with_a_bad_port_exits_at_start_with_one_line(settings: Settings, tmp_path: Path) -> None:
    env = {**settings_env(settings), "SUBQ_WORKER_METRICS_PORT": "nine"}
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-n", "badport@%h"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert "subq worker: Invalid setting SUBQ_WORKER_METRICS_PORT: " in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_worker_whose_port_is_taken_stops_saying_so(settings: Settings, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        own = settings.model_copy(
            update={"queue": "subq-metrics-taken", "worker_metrics_port": port, "worker_metrics_host": "127.0.0.1"}
        )
        with WorkerFleet(own, 1, tmp_path, name="taken") as fleet, pytest.raises(FleetError) as caught:
            fleet.wait_ready(timeout_s=60)
    assert f"SUBQ_WORKER_METRICS_PORT: cannot serve metrics on 127.0.0.1:{port}: the port is in use" in str(
        caught.value
    )


def test_a_workers_latency_buckets_are_the_fleet_wide_histograms() -> None:
    assert tuple(ms / 1000 for ms in LATENCY_BUCKETS_MS) == metrics.LATENCY_BUCKETS_S


# -- the Grafana dashboard -------------------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "subq-dashboard.json"
# subq's series names in a PromQL expression (PromQL's functions and label names never start so).
METRIC_NAME = re.compile(r"\bsubq_[a-z0-9_]+\b")


def _sample_names(families: Iterable[Metric]) -> set[str]:
    """Every series name a family exposes (a labelled family with no child yet still counts)."""
    names = set()
    for family in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + suffix for suffix in suffixes}
    return names


def test_the_dashboard_uses_only_metrics_subq_exports(settings: Settings) -> None:
    coord = Coordinator(settings.model_copy(update={"key_prefix": "subqmdash", "queue": "subq-mdash"}))
    try:
        exported = _sample_names(metrics.REGISTRY.collect()) | _sample_names(SubqCollector(coord).collect())
    finally:
        coord.close()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 15
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert all(METRIC_NAME.search(expr) for expr in exprs), "every query reads a subq metric"
    assert used <= exported, f"the dashboard reads metrics nobody exports: {sorted(used - exported)}"
    # The figures a platform team asked for are on it: spend, requests, latency, the fleet's state.
    wanted = {
        "subq_tokens_total", "subq_cost_micro_usd_total", "subq_model_requests_total", "subq_tasks_ended_total",
        "subq_worker_model_request_latency_seconds_bucket", "subq_runs_in_flight", "subq_queue_depth",
        "subq_approvals_waiting", "subq_budget_stops_total", "subq_run_redeliveries_total", "subq_repairs_total",
    }  # fmt: skip
    assert wanted <= used, sorted(wanted - used)
    datasources = {json.dumps(p["datasource"]) for p in dashboard["panels"] if "datasource" in p}
    assert datasources == {json.dumps({"type": "prometheus", "uid": "${datasource}"})}, "chosen at import"

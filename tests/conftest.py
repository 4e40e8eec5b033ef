"""Fixtures: a real redis-server and real `celery worker` processes, started by the tests.

Nothing here relies on a server already running on the machine: the session
starts an embedded redis-server on a free port, and the worker processes
on top of it, and stops them at the end.
"""

from __future__ import annotations

import compileall
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from coordinator import OFFLINE_PROFILE, Coordinator, Profile, RunCommand, Settings
from coordinator.api import create_app
from coordinator.heartbeat import Heartbeat, Leased
from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import WorkerFleet
from tests.helpers import ApiServer, Transport, api_settings

# The built wheel in a fresh venv, once per run (tests/test_wheel.py, tests/test_compose.py).
pytest_plugins = ["tests.wheel_env"]

# The files that take longest run first, longest first: the suite runs on pytest-xdist workers a
# file at a time, and a long file started last would leave the others idle while it finishes.
# The order is each file's wall time (the sum of its tests' setup, call and teardown) in a full run
# with --durations=0 (issue 43: a fresh clone on a quiet 2-core host, 2026-12-01; the order counts, not
# the seconds): the 60 longest, 213 s (test_bench.py) down to 14 s; files not named here
# follow in collection order. A file that grows past its neighbours should move up.
LONGEST_FIRST = (
    "test_bench.py", "test_wheel.py", "test_provider_outages.py", "test_worker_probe.py", "test_mcp.py",
    "test_redis_tls.py", "test_webhooks.py", "test_mcp_http.py", "test_faults.py", "test_retry.py",
    "test_typed_results.py", "test_api_fuzz.py", "test_cost_properties.py", "test_sandbox_network.py",
    "test_sentinel_fleet.py", "test_web_security.py", "test_provider_health.py", "test_kill_resumed_parent.py",
    "test_sentinel.py", "test_tool_journal.py", "test_profile_tools.py", "test_fair_share_fleet.py",
    "test_mcp_server.py", "test_up.py", "test_compaction.py", "test_cli.py", "test_api.py", "test_security.py",
    "test_batched_calls.py", "test_shutdown.py", "test_compose.py", "test_restart.py", "test_fair_share_faults.py",
    "test_web_browser.py", "test_docs_examples.py", "test_light_imports.py", "test_flower.py", "test_todo_links.py",
    "test_compose_sentinel.py", "test_metrics.py", "test_first_run.py", "test_redis_password.py",
    "test_client_install.py", "test_typed_results_web.py", "test_provider_tls.py", "test_sandbox.py", "test_flood.py",
    "test_timeline_browser.py", "test_control.py", "test_compaction_web.py", "test_webhooks_browser.py",
    "test_kubernetes.py", "test_tracing.py", "test_output_schema_limits.py", "test_pipeline.py", "test_retry_web.py",
    "test_redis_restart.py", "test_mcp_server_delegate.py", "test_demo_tool.py", "test_cli_control.py",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a pytest-xdist run caches the bytecode of the checkout once, before its workers start.

    On a fresh clone each worker otherwise compiles the project's modules and rewrites every test
    module's asserts itself, all three at once (none finds another's cache yet): 14.1-14.8 s of CPU
    a worker's collection, 6.3-8.4 s once cached here at a cost of 5-9 s (issue 43: 2 cores).
    """
    if sys.dont_write_bytecode or hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    for package in CACHED_PACKAGES:
        compileall.compile_dir(ROOT / package, quiet=2, rx=REWRITTEN)  # rewritten ones below, cached apart
    _rewrite_test_modules(config)


# The checkout's packages a worker process, a CLI command or a collection imports.
CACHED_PACKAGES = ("coordinator", "workers", "tests")
ROOT = Path(__file__).resolve().parent.parent
REWRITTEN = re.compile(r"/(test_[^/]*|conftest|wheel_env)\.py$")


def _rewrite_test_modules(config: pytest.Config) -> None:
    """Each test module's assert-rewritten code, cached where pytest's import hook reads it.

    pytest has no public call for this: these are the steps of its hook's exec_module (pytest 9).
    A module whose cached code is current is left alone; a module that fails is left to its hook, and the
    others are cached all the same; if the steps are not there (another pytest), a warning says so.
    """
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        steps = (rewrite.PYC_TAIL, rewrite._read_pyc, rewrite._rewrite_test, rewrite._write_pyc)
    except (AttributeError, ImportError, KeyError):
        warnings.warn(
            "pytest's rewrite steps have changed: each xdist worker rewrites the test modules itself", stacklevel=2
        )
        return
    tail, read_pyc, rewrite_test, write_pyc = steps
    for source in sorted((ROOT / "tests").glob("*.py")):
        if not REWRITTEN.search(str(source)):
            continue  # pytest rewrites test modules, conftest and plugins only (helpers import plainly)
        try:
            pyc = source.parent / "__pycache__" / (source.stem + tail)
            if read_pyc(source, pyc, state.trace) is not None:
                continue
            pyc.parent.mkdir(exist_ok=True)
            source_hash, code = rewrite_test(source, config)
            write_pyc(state, code, source_hash, pyc)
        except Exception:  # a file that will not compile or read (mid-edit, a bad byte): left to its own collection
            continue


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order kept


# CPU by test file, printed after the durations: the suite is CPU-bound on 2 cores (a full run's
# vmstat shows the cores idle under 5% of its time once the tests start), so a file's CPU, not its
# wall, is what it costs the run. Each phase's delta of this process's CPU and its reaped children's
# (os.times: a worker fleet counts once stopped) travels to the controller on its report's
# user_properties. The session's Redis and worker fleet are reaped in the teardown of each pytest-xdist
# worker's last test: what they cost over the whole run is counted on a line of their own, not that
# file's (a run's test_web.py had shown 41.9 s of CPU in 5.3 s of wall: issue 43).
CPU_FILES_SHOWN = 25
SESSION_SERVERS = "(the session's Redis and worker fleets)"
_cpu_mark_s = 0.0
_session_reaped_s = 0.0  # reaped from the session's servers since the last report
_cpu_by_file: dict[str, list[float]] = {}


def _cpu_now_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def pytest_collection_finish(session: pytest.Session) -> None:
    global _cpu_mark_s
    _cpu_mark_s = _cpu_now_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    global _cpu_mark_s
    global _session_reaped_s
    outcome = yield
    now_s = _cpu_now_s()
    properties = outcome.get_result().user_properties  # the report's own copy
    properties.append(("cpu_s", now_s - _cpu_mark_s - _session_reaped_s))
    if _session_reaped_s:
        properties.append(("session_cpu_s", _session_reaped_s))
    _cpu_mark_s, _session_reaped_s = now_s, 0.0


@contextmanager
def _reaped_apart() -> Iterator[None]:
    """The CPU reaped in the block (a session server's stop: its whole life's) is counted apart."""
    global _session_reaped_s
    start_s = _cpu_now_s()
    try:
        yield
    finally:
        _session_reaped_s += _cpu_now_s() - start_s


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    cpu_s = properties.get("cpu_s")
    if isinstance(cpu_s, float):  # one entry a phase: a phase's report reaches here once
        totals = _cpu_by_file.setdefault(report.nodeid.split("::", 1)[0], [0.0, 0.0])
        totals[0] += cpu_s
        totals[1] += report.duration
    session_cpu_s = properties.get("session_cpu_s")
    if isinstance(session_cpu_s, float):
        _cpu_by_file.setdefault(SESSION_SERVERS, [0.0, 0.0])[0] += session_cpu_s


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _cpu_by_file:
        return
    terminalreporter.section(f"CPU by file, the {CPU_FILES_SHOWN} most (s: CPU, wall)")
    ranked = sorted(_cpu_by_file.items(), key=lambda item: -item[1][0])
    for path, (cpu_s, wall_s) in ranked[:CPU_FILES_SHOWN]:
        terminalreporter.write_line(f"{cpu_s:8.1f} {wall_s:8.1f}  {path}")
    total_cpu_s = sum(cpu_s for cpu_s, _ in _cpu_by_file.values())
    files = len(_cpu_by_file) - (SESSION_SERVERS in _cpu_by_file)
    terminalreporter.write_line(f"{total_cpu_s:8.1f} in all, {files} files")


# How a test file marks a test `alone` (pyproject.toml's marker): `@pytest.mark.alone` or `pytestmark`.
ALONE_MARK = re.compile(r"\bmark\.alone\b")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The second pass (`-m alone`, scripts/test) imports only the files that mark a test `alone`.

    Importing every test file costs a process about 30 s of CPU (issue 43: measured on 2 cores),
    all of it before its first test, only to deselect all but a handful; a file whose text never
    marks a test `alone` can hold none.
    """
    if config.option.markexpr != "alone" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return ALONE_MARK.search(collection_path.read_text()) is None


# The session's fleet: two processes of 16 threads show every cross-process behaviour, and
# each pytest-xdist worker starts one (four each cost a quarter of the suite's CPU). The
# fan-out of fifty children runs on a fleet of FAN_OUT_PROCESSES of its own (test_pipeline).
WORKER_PROCESSES = 2
FAN_OUT_PROCESSES = 4
WORKER_THREADS = 16
# How long a fleet may take to be ready: a worker checks each MCP server of its profiles at its start,
# and beside two busy loops on 2 cores one with two HTTP servers took 50 s and a stdio mcp-server-git
# 3 to 12 s each (issue 43), past the 90 s WorkerFleet waits by default.
FLEET_START_S = 300
# A key of one tree, whatever the key prefix: its root id as the hash tag (coordinator/store/keys.py).
TREE_KEY = re.compile(r":\{[0-9a-f]{16}\}:")


@pytest.fixture(scope="session", autouse=True)
def _clean_environment() -> Iterator[None]:
    """Tests build Settings explicitly; SUBQ_* and the providers' keys from the caller's shell must not leak in."""
    leaking = ("SUBQ_", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(leaking)}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    server = local_redis()
    url = server.__enter__()
    try:
        yield url
        # Read once the session's fleets have stopped (their fixtures end first): every key any test's tree was
        # left with expires (docs/architecture.md, "Redis layout": the step that makes a key gives it its retention).
        left = keys_without_retention(url)
    finally:
        with _reaped_apart():
            server.__exit__(None, None, None)
    assert not left, f"{len(left)} tree keys were left with no expiry, such as: {left[:10]}"


def keys_without_retention(url: str) -> list[str]:
    """The keys of a tree (`<prefix>:{<root>}:...`, any prefix) that hold no expiry: each would stay for good."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return sorted(
            key for key in client.scan_iter("*:{*}:*", count=1000) if TREE_KEY.search(key) and client.ttl(key) == -1
        )
    finally:
        client.close()


# How long the tests' offline profile waits out its scripted transient errors before the run fails.
OFFLINE_WAIT_OUT_S = 2.0


@pytest.fixture(scope="session")
def settings(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix="subqtest",
        queue="subq-test",
        worker_concurrency=WORKER_THREADS,
        task_time_limit_s=60,
        visibility_timeout_s=120,
        # Transient model errors are retried in tests without real waits.
        model_backoff_base_s=0.05,
        # The offline profile runs the commands its scripts approve, in a directory of the session's, and
        # waits out a scripted run of transient errors for 2 s (not the default ten minutes) before failing.
        profiles={
            OFFLINE_PROFILE: Profile(
                run_command=RunCommand(cwd=tmp_path_factory.mktemp("commands")), model_wait_out_s=OFFLINE_WAIT_OUT_S
            )
        },
    )


@pytest.fixture(scope="session")
def workers(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerFleet]:
    fleet = WorkerFleet(settings, WORKER_PROCESSES, tmp_path_factory.mktemp("workers"))
    try:
        fleet.wait_ready(FLEET_START_S)
        yield fleet
    finally:
        with _reaped_apart():
            fleet.stop()


@contextmanager
def dedicated_fleet(
    settings: Settings, log_dir: Path, processes: int, **updates: object
) -> Iterator[tuple[Coordinator, WorkerFleet]]:
    """Worker processes with settings of their own (a queue of their own, limits, timeouts)."""
    own = settings.model_copy(update=updates)
    with WorkerFleet(own, processes, log_dir) as fleet:
        fleet.wait_ready(FLEET_START_S)
        coord = Coordinator(own)
        try:
            yield coord, fleet
        finally:
            coord.close()


@pytest.fixture
def coordinator(settings: Settings, workers: WorkerFleet) -> Iterator[Coordinator]:
    """A Coordinator whose work the session's worker processes run."""
    coord = Coordinator(settings)
    yield coord
    coord.close()


@pytest.fixture(autouse=True)
def runs_left_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A run a test starts in its own process and leaves held (one it lets die, or never ends) is renewed no more
    once the test is over: its heartbeat thread otherwise beat for the rest of the session (27 of them after
    tests/test_convergence.py alone), and warned "heartbeat failed" at each beat once the session's Redis stopped."""
    held: list[tuple[Heartbeat, Leased]] = []
    hold = Heartbeat.hold

    def recorded(heartbeat: Heartbeat, run: Leased) -> None:
        held.append((heartbeat, run))
        hold(heartbeat, run)

    monkeypatch.setattr(Heartbeat, "hold", recorded)
    yield
    for heartbeat, run in held:
        heartbeat.forget(run)  # its thread ends at its next beat, with no run left to renew


@pytest.fixture
def idle_coordinator(settings: Settings) -> Iterator[Coordinator]:
    """A Coordinator publishing to a queue no worker consumes, so messages can be counted.

    Its keys have a prefix of their own, so the session fleet's reconciler never
    publishes its tasks again onto the fleet's queue.
    """
    coord = Coordinator(settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqidle"}))
    coord.client.delete("subq-nobody")
    yield coord
    coord.client.delete("subq-nobody")
    coord.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def live(settings: Settings, workers: WorkerFleet) -> Iterator[Coordinator]:
    coord = Coordinator(api_settings(settings))
    yield coord
    coord.close()


@pytest.fixture(scope="module")
def live_api(live: Coordinator) -> Iterator[ApiServer]:
    with ApiServer(create_app(coordinator=live)) as server:
        yield server


@pytest.fixture(scope="module")
def live_http(live_api: ApiServer) -> Iterator[httpx.Client]:
    with live_api.client() as http:
        yield http


@pytest.fixture(scope="module", params=["redis", "api"])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    """Each CLI test runs twice: on Redis, and through a real API server (one per module and settings)."""
    with Transport(request.param) as chosen:
        yield chosen

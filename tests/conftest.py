"""Fixtures: a real redis-server and real `celery worker` processes, started by the tests.

Nothing here relies on a server already running on the machine: the session
starts an embedded redis-server on a free port, and the worker processes
on top of it, and stops them at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coordinator import Coordinator, Settings
from coordinator.local_redis import local_redis

ROOT = Path(__file__).resolve().parent.parent
# Four processes as in the acceptance test of 50 children finishing at once.
WORKER_PROCESSES = 4
WORKER_THREADS = 16
WORKER_START_TIMEOUT_S = 60


@pytest.fixture(scope="session", autouse=True)
def _clean_environment() -> Iterator[None]:
    """Tests build Settings explicitly; SUBQ_* from the caller's shell must not leak in."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SUBQ_")}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with local_redis() as url:
        yield url


@pytest.fixture(scope="session")
def settings(redis_url: str) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix="subqtest",
        queue="subq-test",
        worker_concurrency=WORKER_THREADS,
        task_time_limit_s=60,
        visibility_timeout_s=120,
    )


def settings_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    for name, value in settings.model_dump(exclude_none=True, exclude={"profiles"}).items():
        env[f"SUBQ_{name.upper()}"] = str(value)
    return env


class WorkerFleet:
    """Real `celery -A workers.app worker` processes; stopped (and reaped) at the end."""

    def __init__(self, settings: Settings, processes: int, log_dir: Path) -> None:
        self.settings = settings
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        for index in range(processes):
            log = log_dir / f"worker{index}.log"
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-n", f"w{index}@%h",
                     "--loglevel", "INFO", "--without-mingle", "--without-gossip"],
                    cwd=ROOT, env=settings_env(settings), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc, log in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited at start:\n{log.read_text()[-3000:]}")
            if all(b"ready." in log.read_bytes() for log in self.logs):
                return
            time.sleep(0.1)
        raise RuntimeError("workers did not become ready:\n" + "\n".join(l.read_text()[-1000:] for l in self.logs))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def workers(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerFleet]:
    fleet = WorkerFleet(settings, WORKER_PROCESSES, tmp_path_factory.mktemp("workers"))
    yield fleet
    fleet.stop()


@pytest.fixture
def coordinator(settings: Settings, workers: WorkerFleet) -> Iterator[Coordinator]:
    """A Coordinator whose work the session's worker processes run."""
    coord = Coordinator(settings)
    yield coord
    coord.close()


@pytest.fixture
def idle_coordinator(settings: Settings) -> Iterator[Coordinator]:
    """A Coordinator publishing to a queue no worker consumes, so messages can be counted."""
    coord = Coordinator(settings.model_copy(update={"queue": "subq-nobody"}))
    coord.client.delete("subq-nobody")
    yield coord
    coord.client.delete("subq-nobody")
    coord.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()

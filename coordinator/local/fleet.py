"""Starting local `celery worker` processes: for `subq demo`, `subq up` and the tests.

Each worker is a real `celery -A workers.app worker` process (started as
`python -m workers`, the same command without Celery's umbrella CLI) in its own process
group, reading the same `SUBQ_` settings, so stopping the group leaves nothing
behind. (A subprocess names `workers.app` by string; the coordinator still
never imports the execution plane.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from celery import Celery
from pydantic import SecretStr

from coordinator.errors import FleetError
from coordinator.settings import STANDARD_KEYS, Settings

__all__ = ["WorkerFleet", "settings_env", "stop_timeout_s"]

# A cold worker imports Celery and pydantic-ai in a few seconds; a loaded CI machine may take longer.
DEFAULT_START_TIMEOUT_S = 90.0
# How long one readiness ping collects replies; it is repeated until the start timeout.
PING_TIMEOUT_S = 1.0
# A warm shutdown hands its runs back within the workers' SUBQ_SHUTDOWN_GRACE_S; the group is killed this long
# after it, as a pod's termination grace does (deploy/kubernetes: 25 + 10 s). A fixed 20 s killed the workers
# before a run in a long call was handed back (at the grace less 3 s), leaving it to its lease's lapse.
STOP_MARGIN_S = 10.0


def stop_timeout_s(settings: Settings) -> float:
    """How long a fleet's stop waits for its workers' warm shutdown before it kills them."""
    return settings.shutdown_grace_s + STOP_MARGIN_S


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process exactly these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    for provider, variable in STANDARD_KEYS.items():  # under their own names, as Settings reads them
        key = settings.standard_key(provider)
        if key is not None:
            env[variable] = key.get_secret_value()
    provider_keys = {"openai_api_key", "anthropic_api_key"}
    for name, value in settings.model_dump(exclude_none=True, exclude={"profiles", *provider_keys}).items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        # pydantic-settings reads complex values (dicts, lists) from the environment as JSON.
        # default=str: paths in a list (SUBQ_SANDBOX_HIDDEN_PATHS, which `subq up` sets) as their text.
        env[f"SUBQ_{name.upper()}"] = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    if settings.profiles:
        env["SUBQ_PROFILES"] = _profiles_json(settings)
    return env


def worker_argv(app_module: str) -> list[str]:
    """The interpreter's arguments that start a worker of `app_module`, before the worker's options.

    subq's app starts through `python -m workers` (workers/app.py): Celery's own worker command
    without the `celery` command's imports of every subcommand and plugin, about 1 s of CPU less a
    start (issue 43, point 5); another app (the benchmark's bare one) through `celery -A`.
    """
    if app_module == "workers.app":
        return ["-m", "workers"]
    return ["-m", "celery", "-A", app_module, "worker"]


def _profiles_json(settings: Settings) -> str:
    return json.dumps(
        {
            name: {
                **profile.model_dump(mode="json", exclude_none=True, exclude={"api_key"}),
                **({"api_key": profile.api_key.get_secret_value()} if profile.api_key else {}),
            }
            for name, profile in settings.profiles.items()
        }
    )


class WorkerFleet:
    """N worker processes with logs in `log_dir`; `stop()` ends them and their children.

    With `SUBQ_WORKER_METRICS_PORT` set, process i serves its metrics on that port + i.
    `app_module` is the Celery app they run (subq's, or the benchmark's bare one);
    `loglevel` WARNING keeps per-task log lines out of what a benchmark times.
    """

    def __init__(
        self,
        settings: Settings,
        processes: int,
        log_dir: Path,
        *,
        app_module: str = "workers.app",
        loglevel: str = "INFO",
        name: str = "w",
    ) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.stop_timeout_s = stop_timeout_s(settings)
        # Full node names, so a ping can ask these workers alone (another fleet may share the broker).
        self.nodes = [f"{name}{index}@{socket.gethostname()}" for index in range(processes)]
        log_dir.mkdir(parents=True, exist_ok=True)
        env = settings_env(settings)
        port = settings.worker_metrics_port
        for index, node in enumerate(self.nodes):
            log = log_dir / f"worker{index}.log"
            self.logs.append(log)
            if port is not None:  # processes of one host cannot share a port: process i serves port + i
                env = {**env, "SUBQ_WORKER_METRICS_PORT": str(port + index)}
            with log.open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            *worker_argv(app_module),
                            "-n",
                            node,
                            "--loglevel",
                            loglevel,
                            "--without-mingle",
                            "--without-gossip",
                        ],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def wait_ready(self, timeout_s: float = DEFAULT_START_TIMEOUT_S, *, ping: Celery | None = None) -> None:
        """Return once every worker is ready; raise with its log if one exits.

        Ready means it logged `ready.` (an INFO line), or, with `ping` (an app on the
        same broker, for quiet logs), that it answered a ping: then it consumes.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc, log in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None:
                    raise FleetError(f"a worker exited at start (code {proc.returncode}):\n{_tail(log)}")
            if ping is not None:
                if len(ping.control.ping(self.nodes, timeout=PING_TIMEOUT_S, limit=len(self.nodes))) >= len(self.nodes):
                    return
            elif all(b"ready." in log.read_bytes() for log in self.logs):
                return
            time.sleep(0.1)
        raise FleetError("workers did not become ready in time:\n" + "\n".join(_tail(log) for log in self.logs))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.kill()  # the leader itself, whatever its group: the wait below must end
                proc.wait()

    def __enter__(self) -> WorkerFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def signal_group(leader_pid: int, sig: signal.Signals) -> None:
    """Signal a process group that may already be gone: then there is nothing left to signal.

    A leader can end between the check that it runs and the signal: a `subq up`
    stopped while it starts its workers can see one die of the same SIGTERM (a
    forked child gets its parent's group's signal until it makes its own session).
    """
    try:
        os.killpg(leader_pid, sig)
    except ProcessLookupError:
        pass


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"

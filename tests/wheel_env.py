"""The built wheel, installed non-editable in fresh virtual environments: each once per test run.

A pytest plugin (tests/conftest.py loads it). The wheel is built the way
deploy/Dockerfile builds it (the same files, the same `pip wheel` command) and
installed outside the checkout, no dev extras, in two venvs: `venv` with the
server extra, as the image installs it (tests/test_wheel.py, tests/test_compose.py,
tests/test_tracing.py), and `client_venv` without it, as a service that only talks
to the API installs it (tests/test_client_install.py). Building and installing take
a minute or more, so each is done once per run: the pytest-xdist workers share them
through lock files in the run's temporary folder, and the first to get there builds
(the wheel first; then only the venv that worker needs).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What deploy/Dockerfile copies into its build stage: the wheel is built from these alone.
BUILD_INPUTS = ("pyproject.toml", "README.md", "coordinator", "workers")
# The Dockerfile runs the same command, as `python -m pip wheel --no-deps . -w /dist`.
# Build isolation on: pip installs the build requirements pyproject.toml names
# (setuptools>=69, wheel) from the index, whatever this environment has.
PIP_WHEEL = ("-m", "pip", "wheel", "--no-deps")
BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 420
COMMAND_TIMEOUT_S = 60
# Making a venv without pip takes a fraction of a second; the bound is for a host loaded past reason.
# (With pip, ensurepip cost 7 s of CPU a venv and past a minute of wall beside a loaded suite.)
VENV_TIMEOUT_S = 300
# A graceful stop of an idle worker, API or Flower takes a second or two.
STOP_TIMEOUT_S = 60  # `subq up` waits its workers' shutdown grace and 10 s (coordinator/local/fleet.py)


@dataclass(frozen=True)
class Venv:
    """A virtual environment with the wheel installed, and a way to run its commands."""

    root: Path
    site_packages: Path
    workdir: Path  # an empty folder outside the checkout: the working directory of every command

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, extra: dict[str, str] | None = None, **subq: str) -> dict[str, str]:
        """This environment's PATH first; nothing from the caller's Python or SUBQ_ settings leaks in."""
        # PYTHONDONTWRITEBYTECODE too: the venv is installed --no-compile, so with it every command, service
        # and healthcheck compiled all it imports again (3.4 s of CPU a process, 4.8 s against 1.4 s with a
        # cache: issue 43); without it the first to import a module caches it, in the venv, not the checkout.
        leaky = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
        env = {k: v for k, v in os.environ.items() if k not in leaky and not k.startswith("SUBQ_")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.root))
        env["PYTHONNOUSERSITE"] = "1"  # no packages from ~/.local either
        env.update({f"SUBQ_{name.upper()}": value for name, value in subq.items()})
        env.update(extra or {})
        return env

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            cwd=self.workdir,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )


def run_checked(argv: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a build step; fail with its output (not just an exit code) when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done


def _copy_build_inputs(dest: Path) -> Path:
    """The files the Dockerfile copies, without bytecode; a copy, so the build writes nothing into the checkout.

    (setuptools builds in the source folder, and a stale build/lib there would leak
    files that no longer exist, such as a module moved into a package, into the wheel.)
    """
    dest.mkdir()
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / name)
    return dest


@dataclass(frozen=True)
class Built:
    source_copy: Path
    wheel: Path


def _shared_folder(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A folder of the whole run, the same for every xdist worker."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's temporary folder sits in the run's own; alone, the run's is base.
    shared = (base.parent if worker_id != "master" else base) / "subq-wheel"
    shared.mkdir(exist_ok=True)
    return shared


def _once(shared: Path, name: str, make: Callable[[Path], str]) -> str:
    """`make(shared / name)` once per run, by whichever xdist worker comes first; its answer to every caller.

    Each product has a lock of its own, so a worker waiting for one venv does not
    wait for the other's install.
    """
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        ready = shared / f"{name}.ready"
        if not ready.exists():
            shutil.rmtree(shared / name, ignore_errors=True)  # left by a worker that failed halfway
            ready.write_text(make(shared / name))
        return ready.read_text()


def _build_wheel(dest: Path) -> str:
    dest.mkdir()
    source = _copy_build_inputs(dest / "src")
    dist = dest / "dist"
    run_checked([sys.executable, *PIP_WHEEL, str(source), "-w", str(dist)], BUILD_TIMEOUT_S)
    (wheel,) = dist.glob("*.whl")
    return str(wheel)


def _install(root: Path, requirement: str) -> str:
    """A fresh venv at `root` with `requirement` (the wheel file, with or without extras); its site-packages."""
    # --without-pip: this environment's pip installs into it (`pip --python`), as it would its own;
    # ensurepip copied pip into each venv for 7 s of CPU (issue 43: the venvs were on the suite's
    # critical path, test_wheel's setup 65 s and test_client_install's 52 s). No test runs the venv's pip.
    run_checked([sys.executable, "-m", "venv", "--clear", "--without-pip", str(root)], VENV_TIMEOUT_S)
    python = str(root / "bin" / "python")
    # The wheel file itself (not the checkout, not -e), with its runtime dependencies and
    # no dev extras. pip's cache is left on: dependencies come from it when it has them.
    # --no-compile: byte-compiling every installed module took 6 of 15 s; the few modules
    # the commands import are compiled as they are imported.
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--disable-pip-version-check"]
    install = [*pip, "--no-compile", requirement]
    run_checked(install, INSTALL_TIMEOUT_S)
    site = run_checked([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], COMMAND_TIMEOUT_S)
    return site.stdout.strip()


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Built:
    """Built once per run, under a lock that the xdist workers share."""
    wheel = Path(_once(_shared_folder(tmp_path_factory, worker_id), "wheel", _build_wheel))
    return Built(wheel.parent.parent / "src", wheel)


@pytest.fixture(scope="session")
def source_copy(built_wheel: Built) -> Path:
    return built_wheel.source_copy


@pytest.fixture(scope="session")
def wheel(built_wheel: Built) -> Path:
    return built_wheel.wheel


def _venv(tmp_path_factory: pytest.TempPathFactory, worker_id: str, built_wheel: Built, name: str, extras: str) -> Venv:
    shared = _shared_folder(tmp_path_factory, worker_id)
    site = _once(shared, name, lambda root: _install(root, f"{built_wheel.wheel}{extras}"))
    return Venv(root=shared / name, site_packages=Path(site), workdir=tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def venv(built_wheel: Built, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Venv:
    """The wheel with the server extra, as deploy/Dockerfile installs it (less the otel extra)."""
    return _venv(tmp_path_factory, worker_id, built_wheel, "venv", "[server]")


@pytest.fixture(scope="session")
def client_venv(built_wheel: Built, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Venv:
    """The wheel alone, no extra: `pip install subagent-queue`, the Python client."""
    return _venv(tmp_path_factory, worker_id, built_wheel, "client-venv", "")


@dataclass(frozen=True)
class Service:
    """An installed command running in a process group of its own, with its output in `log`."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} log ---\n" + self.log.read_text(errors="replace")[-chars:]

    def assert_running(self) -> None:
        assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}:\n{self.tail()}"

    def stop(self) -> int:
        """A clean stop: SIGTERM to the whole group (what Docker and systemd send), then its exit code."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def started(
    venv: Venv, argv: list[str], log: Path, env: dict[str, str], cwd: Path | None = None, name: str = ""
) -> Iterator[Service]:
    """Start an installed command; its group is killed at the end if it is still up, so nothing outlives the test."""
    with log.open("wb") as out:
        executable = venv.bin / argv[0]
        proc = subprocess.Popen(
            [str(executable) if executable.exists() else argv[0], *argv[1:]],
            cwd=cwd or venv.workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Service(name or " ".join(argv[:2]), proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

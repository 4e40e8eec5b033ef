"""Create the project's virtual environment on first use, then run a command in it.

    python3 scripts/bootstrap.py subq demo
    python3 scripts/bootstrap.py pytest

Needs only Python 3.11+. The environment lives in `.venv/` beside this
project and is reinstalled when pyproject.toml changes.

It installs what the command needs, and no more: `subq` (the demo, the CLI)
gets the `server` extra; anything else (pytest, ruff, mypy: the test and check
commands) gets `dev`, which holds `server` and adds the test tools (pytest,
mypy, Playwright, kubectl, mcp-server-git, ...). The stamp file records which
extra is installed, so the demo after the tests installs nothing, and the
tests after the demo add only what they lack.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SUBQ_VENV", ROOT / ".venv"))
STAMP = VENV / ".subq-installed"
# The extra each command needs. The demo installed `dev` once, and a cold first `./scripts/demo`
# took 1:48 on a quiet 2-core machine, most of it test tools it never runs.
SERVER, DEV = "server", "dev"
SERVER_COMMANDS = frozenset({"subq"})
# Each extra, with the extras that hold it (`dev` brings `server`).
HOLDS = {SERVER: {SERVER, DEV}, DEV: {DEV}}
MIN_PYTHON = (3, 11)
# Run by the environment's python before an install: it runs, is new enough, and has pip.
USABLE = f"import sys, pip; sys.exit(sys.version_info < {MIN_PYTHON})"


def extra_for(command: str) -> str:
    """The extra a command needs: `server` for subq itself, `dev` for the test and check tools."""
    return SERVER if Path(command).name in SERVER_COMMANDS else DEV


def installed(stamp: Path) -> tuple[str, str]:
    """(the pyproject.toml hash, the extra) the environment was installed for; ('', '') if none. A stamp of
    one line (written before extras were chosen by command) was a `dev` install."""
    if not stamp.exists():
        return "", ""
    lines = stamp.read_text().split()
    return (lines[0], lines[1] if len(lines) > 1 else DEV) if lines else ("", "")


def usable(python: Path) -> bool:
    """Whether the environment's python runs, is new enough and has pip. One a failed creation left half made
    (Debian without python3-venv: the interpreter copied, no pip), or an older Python made, is made again."""
    if not python.exists():
        return False
    try:
        return subprocess.run([str(python), "-c", USABLE], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def create() -> bool:
    """A fresh environment in VENV; False, with one line saying why and nothing left half made, if it fails."""
    print(f"subq: creating a virtual environment in {VENV} ...", file=sys.stderr, flush=True)
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(VENV, ignore_errors=True)
        print(
            f"subq: cannot create a virtual environment in {VENV} ({exc}); on Debian or Ubuntu install python3-venv "
            "(apt-get install python3-venv), then run this again",
            file=sys.stderr,
        )
        return False
    return True


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: bootstrap.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    if sys.version_info < MIN_PYTHON:
        print(
            f"subq: needs Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer; {sys.executable} is "
            f"{sys.version_info[0]}.{sys.version_info[1]}: run this with a newer python3",
            file=sys.stderr,
        )
        return 2
    bindir = VENV / "bin"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not (bindir / "python").exists() and not create():
        return 1
    need = extra_for(sys.argv[1])
    have_hash, have = installed(STAMP)
    if have_hash != wanted or have not in HOLDS[need]:
        if not usable(bindir / "python") and not create():
            return 1
        what = "its test tools" if have_hash == wanted else "subq and its dependencies (first run only)"
        print(f"subq: installing {what} ...", file=sys.stderr, flush=True)
        # `subagent-queue` alone is the Python client; the demo and the CLI need the server extra,
        # the tests and checks the dev extra (the server and otel extras and the test tools).
        done = subprocess.run(
            [str(bindir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "-e", f"{ROOT}[{need}]"],
        )  # fmt: skip
        if done.returncode != 0:
            print(
                f"subq: installing failed (pip exited {done.returncode}, saying why above); run this again once "
                "that is mended: it starts the install over",
                file=sys.stderr,
            )
            return done.returncode
        STAMP.write_text(f"{wanted} {need}\n")
    command = sys.argv[1:]
    executable = bindir / command[0]
    if executable.exists():
        command[0] = str(executable)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(VENV)}
    os.chdir(ROOT)
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

"""Create the project's virtual environment on first use, then run a command in it.

    python3 scripts/bootstrap.py subq demo
    python3 scripts/bootstrap.py pytest

Needs only Python 3.11+. The environment lives in `.venv/` beside this
project and is reinstalled when pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SUBQ_VENV", ROOT / ".venv"))
STAMP = VENV / ".subq-installed"


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: bootstrap.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    bindir = VENV / "bin"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not (bindir / "python").exists():
        print(f"subq: creating a virtual environment in {VENV} ...", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    if not STAMP.exists() or STAMP.read_text().strip() != wanted:
        print("subq: installing subq and its dependencies (first run only) ...", file=sys.stderr, flush=True)
        # The dev extra brings the server and otel extras (pyproject.toml): `subagent-queue`
        # alone is the Python client, and the demo, the CLI and the tests need the server.
        subprocess.run(
            [str(bindir / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "-e", f"{ROOT}[dev]"],
            check=True,
        )  # fmt: skip
        STAMP.write_text(wanted)
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

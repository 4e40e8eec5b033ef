"""scripts/bootstrap.py installs what the command needs: the demo the server extra, the tests the dev extra.

Run for real on an environment whose `python` is a stand-in that writes down the
pip command it was given (no package is downloaded), and whose `subq` and
`pytest` say they ran: the choice of extra, the stamp and the reinstall rules
are bootstrap's own code, run as `./scripts/demo` and `./scripts/test` run it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "scripts" / "bootstrap.py"


def _stand_ins(venv: Path) -> Path:
    """An environment whose python logs each call (as pip would be run) and whose subq and pytest echo."""
    bindir = venv / "bin"
    bindir.mkdir(parents=True)
    log = venv / "pip.log"
    (bindir / "python").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    for tool in ("subq", "pytest"):
        (bindir / tool).write_text(f'#!/bin/sh\necho "{tool} ran: $@"\n')
    for script in bindir.iterdir():
        script.chmod(0o755)
    return log


def _boot(venv: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SUBQ_VENV": str(venv)}
    return subprocess.run([sys.executable, str(BOOTSTRAP), *command], env=env, capture_output=True, text=True)


def _installs(log: Path) -> list[str]:
    """The extra of each `pip install -e ROOT[extra]` made so far."""
    if not log.exists():
        return []
    return [line.rsplit("[", 1)[1].rstrip("]") for line in log.read_text().splitlines() if " install " in line]


def test_the_demo_installs_the_server_extra_and_the_tests_add_the_rest(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    log = _stand_ins(venv)
    demo = _boot(venv, "subq", "demo")
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout == "subq ran: demo\n"
    assert _installs(log) == ["server"], "the demo installs no test tools"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert (venv / ".subq-installed").read_text() == f"{wanted} server\n"

    again = _boot(venv, "subq", "status", "x")
    assert again.returncode == 0 and _installs(log) == ["server"], "nothing is installed twice"

    tests = _boot(venv, "pytest", "-q")
    assert tests.returncode == 0, tests.stderr
    assert tests.stdout == "pytest ran: -q\n"
    assert _installs(log) == ["server", "dev"], "the tests install the dev extra"
    assert "installing its test tools" in tests.stderr

    demo_after = _boot(venv, "subq", "demo")
    assert demo_after.returncode == 0 and _installs(log) == ["server", "dev"], "dev holds what the demo needs"


def test_an_environment_stamped_before_extras_were_chosen_counts_as_dev(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    log = _stand_ins(venv)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".subq-installed").write_text(wanted)  # the old stamp: the hash alone, after a dev install
    assert _boot(venv, "pytest").returncode == 0
    assert _boot(venv, "subq", "demo").returncode == 0
    assert _installs(log) == [], "an up-to-date environment is not installed again"
    (venv / ".subq-installed").write_text("an older pyproject.toml server\n")
    assert _boot(venv, "subq", "demo").returncode == 0
    assert _installs(log) == ["server"], "a changed pyproject.toml is installed again"


def test_a_failed_install_is_one_line_and_the_next_run_starts_it_over(tmp_path: Path) -> None:
    """pip's failure (no network, a broken mirror) was a traceback of bootstrap's own; the stamp must not say
    installed, so the next run tries again."""
    venv = tmp_path / "venv"
    log = _stand_ins(venv)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase "$*" in *" install "*) exit 3;; esac\n')
    failed = _boot(venv, "subq", "demo")
    assert failed.returncode == 3 and failed.stdout == ""
    assert failed.stderr.splitlines()[-1].startswith("subq: installing failed (pip exited 3, saying why above)")
    assert "Traceback" not in failed.stderr and not (venv / ".subq-installed").exists()
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    assert _boot(venv, "subq", "demo").returncode == 0 and _installs(log) == ["server", "server"]


def test_an_environment_that_cannot_be_made_says_why_in_one_line(tmp_path: Path) -> None:
    """Debian without python3-venv stops the creation half way; so does a path that cannot be a folder. One line
    saying what to do, and no half-made environment a next run would take as made."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    made = _boot(blocker / "venv", "subq", "demo")
    assert made.returncode == 1 and made.stdout == ""
    (line,) = [line for line in made.stderr.splitlines() if "creating" not in line]
    assert line.startswith(f"subq: cannot create a virtual environment in {blocker / 'venv'} (")
    assert line.endswith("install python3-venv (apt-get install python3-venv), then run this again")


def test_an_environment_without_pip_or_too_old_is_not_taken_as_usable(tmp_path: Path) -> None:
    """A creation that stopped after copying the interpreter left a python without pip, and every later run
    failed in pip with a traceback; an environment an older Python made could never install subq."""
    sys.path.insert(0, str(BOOTSTRAP.parent))
    try:
        import bootstrap
    finally:
        sys.path.remove(str(BOOTSTRAP.parent))
    half_made = tmp_path / "python"
    half_made.write_text('#!/bin/sh\ncase "$*" in *"import sys, pip"*) exit 1;; esac\n')
    half_made.chmod(0o755)
    assert not bootstrap.usable(half_made)
    assert not bootstrap.usable(tmp_path / "missing")
    assert bootstrap.usable(Path(sys.executable))

"""The `subq` command as a user runs it: its exit codes, output and messages.

The commands run in this process through `run_cli`, the function behind the console
script's `main()`, with the same arguments, SUBQ_ environment, stdin, stdout and
stderr a separate process would have; tests/test_console_script.py runs the
installed `subq` script itself. `subq()` runs `python -m coordinator` as a real
process, for tests that need one (tests/test_up.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import NoReturn
from unittest import mock
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from coordinator import Coordinator, Settings
from coordinator.cli import run_cli
from coordinator.export import FILE_NAMES
from coordinator.local.demo import DEMO_PLAN
from coordinator.local.ports import free_port
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, agent, call, reply, subtask
from tests.helpers import TOKEN, Transport, api_coordinator, script, state, usage_step
from tests.test_bad_input import NO_TREE

COMMANDS = ["up", "worker", "api", "flower", "demo", "run", "status", "todos", "tree", "history", "export"]


# The caller's variables that would change what a command does; neither runner passes them on.
CALLER_ONLY = ("SUBQ_", "FLOWER_")


def subq(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 120, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`subq <args>` as a separate process (`python -m coordinator`), with `env` as its only SUBQ_ variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(CALLER_ONLY)}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        env=base | (env or {}), capture_output=True, text=True, timeout=timeout_s, input=stdin,
    )  # fmt: skip


class Terminal(io.StringIO):
    """A captured stdout that says it is a terminal, as a user's is (rich takes its width from COLUMNS)."""

    def isatty(self) -> bool:
        return True


def cli(
    *args: str, env: dict[str, str] | None = None, stdin: str | bytes | None = None, tty: bool = False
) -> subprocess.CompletedProcess[str]:
    """`subq <args>` run in this process, as `subq()` would run it in another.

    The environment holds `env` as its only SUBQ_/FLOWER_ variables while the command
    runs; stdin reads `stdin` (empty if None; a str as UTF-8), as text or through its
    bytes (`sys.stdin.buffer`) as a process's stdin; stdout and stderr are captured (stdout
    as a terminal with `tty`); the exit code is the one `main()` would exit with
    (`run_cli`'s result).
    """
    out, err = Terminal() if tty else io.StringIO(), io.StringIO()
    with (
        _environment(env or {}),
        mock.patch("os.execve", _refuse_exec),
        mock.patch("uvicorn.run", _refuse_serve),
        mock.patch.object(sys, "stdin", _stdin(stdin)),
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        code = run_cli(list(args))
    return subprocess.CompletedProcess(["subq", *args], code, out.getvalue(), err.getvalue())


def _stdin(given: str | bytes | None) -> io.TextIOWrapper:
    """A process's stdin holding `given`: text over bytes, decoded as under a UTF-8 locale (surrogateescape)."""
    data = given.encode() if isinstance(given, str) else given or b""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ without the caller's SUBQ_/FLOWER_ variables, plus `env`; restored afterwards."""
    touched = {k for k in os.environ if k.startswith(CALLER_ONLY)} | set(env)
    saved = {k: os.environ.get(k) for k in touched}
    for name in touched:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# What each command that would have replaced the test process would have run: its argv and environment.
EXECS: list[tuple[list[str], dict[str, str]]] = []


def _refuse_exec(path: str, argv: list[str], env: dict[str, str]) -> NoReturn:
    """`subq worker` and `subq flower` end in os.execve: here it would replace the test process."""
    EXECS.append((list(argv), dict(env)))
    raise AssertionError(f"the command would exec {argv!r}")


def test_a_workers_concurrency_option_is_the_setting_its_processes_read() -> None:
    """`subq worker --concurrency 64` gave Celery 64 threads, and the worker's settings still said 32: fair shares
    counted the fleet's capacity from the setting, parking runs while threads sat idle."""
    EXECS.clear()
    env = {"SUBQ_REDIS_URL": "redis://127.0.0.1:1/0", "SUBQ_WORKER_CONCURRENCY": "32"}
    with pytest.raises(AssertionError, match="would exec"):
        cli("worker", "--concurrency", "64", env=env)
    ((argv, environ),) = EXECS
    assert argv[-2:] == ["--concurrency", "64"] and environ["SUBQ_WORKER_CONCURRENCY"] == "64"


def _refuse_serve(*args: object, **kwargs: object) -> NoReturn:
    """`subq api` ends in uvicorn.run: here it would serve from the test process until the test's timeout."""
    raise AssertionError(f"the command would serve {kwargs.get('host')}:{kwargs.get('port')}")


def test_demo_runs_on_an_embedded_redis_and_leaves_nothing_behind() -> None:
    marker = uuid.uuid4().hex  # inherited by everything the demo starts
    proc = cli("demo", env={"DEMO_TEST_MARKER": marker})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    url = re.search(r"embedded Redis at (redis://\S+) ", out)
    assert url is not None, out
    report = out[out.index("Todo list of ") :]
    rows = [line.split() for line in report.splitlines() if line.startswith("  [")]
    assert len(rows) == len(DEMO_PLAN.splitlines()) and all(row[0] == "[x]" for row in rows), report
    own = re.search(r"Root own cost:   \$(\d+)\.(\d{6}) \((\d+) tokens", report)
    total = re.search(r"Root total cost: \$(\d+)\.(\d{6}) \((\d+) tokens", report)
    assert own is not None and total is not None, report
    micros = [int(row[-1].replace("$", "").replace(".", "")) for row in rows]
    tokens = [int(row[-2]) for row in rows]
    assert int(total[1] + total[2]) == int(own[1] + own[2]) + sum(micros) > int(own[1] + own[2]) > 0
    assert int(total[3]) == int(own[3]) + sum(tokens)
    assert "genai-prices" in out and "offline model" in out
    assert processes_marked("DEMO_TEST_MARKER", marker) == []  # workers (redis-server rewrites its environ, so:)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url.group(1), socket_connect_timeout=1).ping()


def processes_marked(name: str, marker: str) -> list[str]:
    """Command lines of the live processes whose environment carries `name=marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get(name) == marker:
                found.append(" ".join(proc.info["cmdline"] or []))
        except psutil.Error:
            continue
    return found


def test_help_everywhere() -> None:
    for command in ([], *([c] for c in COMMANDS)):
        proc = cli(*command, "--help")
        assert proc.returncode == 0 and "Usage: " in proc.stdout, (command, proc.stderr)
        assert proc.stderr == ""
    bare = cli()
    assert bare.returncode == 2 and all(c in bare.stdout for c in COMMANDS)


# -- every malformed input: one line, a non-zero exit, nothing changed -------------------


@pytest.fixture
def env(settings: Settings) -> dict[str, str]:
    """The test Redis and prefix, and a queue no worker consumes, so a published message would stay countable."""
    return {
        "SUBQ_REDIS_URL": settings.redis_url or "",
        "SUBQ_KEY_PREFIX": settings.key_prefix,
        "SUBQ_QUEUE": "subq-nobody",
    }


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "no-items.md").write_text("just prose, no checkbox\n")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("x")
    return {
        "{missing}": str(tmp_path / "missing.md"), "{no_items}": str(tmp_path / "no-items.md"),
        "{folder}": str(tmp_path / "a-folder"), "{new_dir}": str(tmp_path / "new-dir"),
        "{file}": str(tmp_path / "a-file"),
    }  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


UNKNOWN = "0123456789abcdef"
USAGE_ERRORS = [  # click refuses these before any command code runs: exit 2
    (["frob"], "subq: No such command 'frob'. (see: subq --help)"),
    (["run"], "subq run: Missing argument 'prompt'. (see: subq run --help)"),
    (["run", "p", "--bogus"], "subq run: No such option: --bogus"),
    (["run", "p", "--todos"], "subq: Option '--todos' requires an argument."),
    (["tree"], "subq tree: Missing argument 'task_id'."),
    (["export", UNKNOWN], "subq export: Missing argument 'directory'."),
    (["history", "--limit", "abc"], "subq history: Invalid value for '--limit'"),
    (["up", "--workers", "0"], "subq up: Invalid value for '--workers'"),
    (["demo", "--workers", "0"], "subq demo: Invalid value for '--workers'"),
    (["api", "--port", "70000"], "subq api: Invalid value for '--port'"),
    (["worker", "--concurrency", "0"], "subq worker: Invalid value for '--concurrency'"),
    # Past the setting's own bound: refused here, naming the option (the worker it started refused a variable never set).
    (
        ["worker", "--concurrency", "5000"],
        "subq worker: Invalid value for '--concurrency': Input should be less than or equal to 1024",
    ),
]
OPERATOR_ERRORS = [  # subq's own validation of an operator command: exit 1, the same over Redis and the API
    (["run", ""], "subq: prompt must be a non-empty string"),
    (["run", "   "], "subq: prompt must be a non-empty string"),
    (["run", "p", "--profile", "nope"], "subq: Invalid profile: nope"),
    (["run", "p", "--todos", "{missing}"], "subq: Cannot read --todos {missing}: No such file or directory"),
    (["run", "p", "--todos", "{folder}"], "subq: Cannot read --todos {folder}: Is a directory"),
    (["run", "p", "--todos", "{no_items}"], "subq: The todo update has no items"),
    (["status", "not-an-id"], "subq: Unknown id: 'not-an-id' is not a subq task or batch id"),
    (["todos", UNKNOWN], f"subq: Unknown task: {UNKNOWN}"),
    (["tree", UNKNOWN], f"subq: Unknown task: {UNKNOWN}"),
    (["tree", "x" * 17], "subq: Unknown id"),
    (["history", "--status", "weird"], "subq: status must be one of active"),
    (["history", "--limit", "0"], "subq: limit must be between 1 and 500"),
    (["history", "--cursor", "-1"], "subq: cursor must be between 0 and 9007199254740992"),
    (["history", "--cursor", "9" * 30], "subq: cursor must be between 0 and 9007199254740992"),
    (["run", "p", "--profile", ""], "subq: profile must not be empty: leave it out for the default profile"),
    # An argument that is not UTF-8 reaches Python as lone surrogates: a traceback, and a tenant's root counted.
    (["run", "a\udced\udca0\udc80"], "subq: prompt holds a lone surrogate '\\udced' at character 2"),
    (["history", "--root", "nope"], "subq: Unknown id: 'nope'"),
    (["export", UNKNOWN, "{new_dir}"], f"subq: Unknown task: {UNKNOWN}"),
    (["export", "not-an-id", "{new_dir}"], "subq: Unknown id: 'not-an-id'"),
    # Arguments that are not UTF-8 reached the HTTP client (or hiredis) as lone surrogates: a traceback, not a refusal.
    (
        ["run", "p", "--profile", "\udcff"],
        "subq: Invalid profile: '\\udcff' holds a lone surrogate '\\udcff' at character 1, which is no character",
    ),
    (["audit", "--before", "\udcff"], "subq: before must be an entry id as <ms>-<n>, not '\\udcff'"),
    (["audit", "--before", "x"], "subq: before must be an entry id as <ms>-<n>, not 'x'"),
    (["approvals", "--root", "\udcff"], "subq: Unknown id: '\\udcff' is not a subq task or batch id"),
    (["redeliver", UNKNOWN, "\udcff"], f"subq: Unknown delivery '\\udcff' of task {UNKNOWN}"),
    # ".." became another route over the API (httpx resolves dot segments).
    (["redeliver", UNKNOWN, ".."], f"subq: Unknown delivery '..' of task {UNKNOWN}"),
    # The first to read stdin left the second nothing: "--output-schema - is not JSON".
    (
        ["run", "p", "--todos", "-", "--output-schema", "-"],
        "subq: --todos and --output-schema cannot both read stdin ('-'): give one as a file",
    ),
]
SUBQ_ERRORS = [  # subq's own validation of the commands that run on this machine, and of Redis settings: exit 1
    (["flower"], "subq: Flower needs basic auth: pass --password (or set SUBQ_FLOWER_PASSWORD)"),
    (["flower", "--no-auth", "--password", "pw"], "subq: Give either --password or --no-auth, not both"),
    (["flower", "--user", "a:b", "--password", "pw"], "subq: Flower user must be non-empty, without ':' or ','"),
    (["flower", "--password", "a,b"], "subq: Flower password must be non-empty, without ','"),
    (["flower", "--password", "change-me"], "subq: Flower's password 'change-me' is the example's placeholder"),
    (["api"], "subq: Invalid setting SUBQ_API_TOKEN: not set"),
    (
        ["up", "--no-api", "--flower-port", "{busy}"],
        "subq: Port {busy} on 127.0.0.1 is in use; choose another with --flower-port",
    ),
    (
        ["up", "--api-port", "{busy}", "--flower-port", "{free}"],
        "subq: Port {busy} on 127.0.0.1 is in use; choose another with --api-port",
    ),
    (["up", "--api-port", "9", "--flower-port", "9"], "subq: --api-port and --flower-port must differ"),
    (["--redis-url", "nonsense", "status", UNKNOWN], "subq: Invalid setting SUBQ_REDIS_URL: Redis URL must specify"),
    (["--queue", "a queue", "status", UNKNOWN], "subq: Invalid setting SUBQ_QUEUE: String should match"),
    (["--key-prefix", "", "history"], "subq: Invalid setting SUBQ_KEY_PREFIX"),
]
UNAVAILABLE = [  # subq out of reach: exit 69, not the 1 of a failed root (a script must not start the work again)
    (
        ["--redis-url", "redis://127.0.0.1:1/0", "up", "--no-api", "--flower-port", "{free}"],
        "subq: Redis is unreachable",
    ),
    (["--redis-url", "redis://127.0.0.1:1/0", "status", UNKNOWN], "subq: Redis is unreachable"),
    (["--redis-url", "redis://127.0.0.1:1/0", "result", UNKNOWN], "subq: Redis is unreachable"),
    (["--redis-url", "redis://127.0.0.1:1/0", "run", "p", "--follow"], "subq: Redis is unreachable"),
]


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [(a, m, 2) for a, m in USAGE_ERRORS] + [(a, m, 1) for a, m in SUBQ_ERRORS] + [(a, m, 69) for a, m in UNAVAILABLE],
    ids=[" ".join(a) or "-" for a, _ in USAGE_ERRORS + SUBQ_ERRORS + UNAVAILABLE],
)
def test_malformed_input_is_one_line_and_changes_nothing(
    idle_coordinator: Coordinator, env: dict[str, str], files: dict[str, str], busy_port: int,
    args: list[str], message: str, code: int,
) -> None:  # fmt: skip
    _refused(idle_coordinator, env, files, busy_port, args, message, code)


@pytest.mark.parametrize(("args", "message"), OPERATOR_ERRORS, ids=[" ".join(a) for a, _ in OPERATOR_ERRORS])
def test_operator_commands_refuse_bad_input_alike_over_redis_and_the_api(
    idle_coordinator: Coordinator, settings: Settings, transport: Transport, files: dict[str, str],
    busy_port: int, args: list[str], message: str,
) -> None:  # fmt: skip
    env = transport.env(settings.model_copy(update={"queue": "subq-nobody"}))
    _refused(idle_coordinator, env, files, busy_port, args, message, 1)


def _refused(
    idle_coordinator: Coordinator, env: dict[str, str], files: dict[str, str], busy_port: int,
    args: list[str], message: str, code: int,
) -> None:  # fmt: skip
    """The command exits `code` with `message` as its one line, and changes nothing."""
    values = {**files, "{busy}": str(busy_port), "{free}": str(free_port())}
    args = [values.get(a, a) for a in args]
    for name, value in values.items():
        message = message.replace(name, value)
    before = state(idle_coordinator, NO_TREE)
    proc = cli(*args, env=env)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert state(idle_coordinator, NO_TREE) == before, "a refused command changed Redis or published a message"
    assert not Path(files["{new_dir}"]).exists()


# -- reaching subq through its HTTP API: a bad URL or token is one line and changes nothing --


@pytest.fixture(scope="module")
def idle_api(settings: Settings) -> Iterator[str]:
    """An API server over the idle coordinator's keys and queue (nothing consumes them)."""
    with Transport("api") as api:
        yield api.server(settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqidle"})).url


API_REFUSALS = [  # (arguments, environment, the line on stderr); {api} is the idle API's URL
    (["--api-url", "nonsense", "run", "p"], {}, "subq: Invalid setting SUBQ_API_URL: 'nonsense' is not an http:// or https:// URL with a host"),
    (["run", "p"], {"SUBQ_API_URL": "ftp://h"}, "subq: Invalid setting SUBQ_API_URL: 'ftp://h' is not an http:// or https:// URL"),
    (["--api-url", "http://h:99999", "status", UNKNOWN], {}, "subq: Invalid setting SUBQ_API_URL: 'http://h:99999': Port out of range"),
    (["--api-url", "{api}?x=1", "status", UNKNOWN], {}, "subq: Invalid setting SUBQ_API_URL: '{api}?x=1': give the API's base URL"),
    # A user and password replaced the bearer token, and the refusal quoted them back; a space got past the check.
    (["--api-url", "http://ops:s3cr3t@127.0.0.1:1", "run", "p"], {"SUBQ_API_TOKEN": TOKEN}, "subq: Invalid setting SUBQ_API_URL: 'http://<user>@127.0.0.1:1' carries a user and password"),
    (["--api-url", " {api}", "run", "p"], {"SUBQ_API_TOKEN": TOKEN}, "subq: Invalid setting SUBQ_API_URL: ' {api}' has spaces around it"),
    # An id of no task's shape: on Redis and over the API alike (it became another path: POST /v1/cancel).
    (["--api-url", "{api}", "cancel", "..", "--reason", "r"], {"SUBQ_API_TOKEN": TOKEN}, "subq: Unknown id: '..' is not a subq task or batch id"),
    (["--api-url", "{api}", "status", UNKNOWN + "/todos"], {"SUBQ_API_TOKEN": TOKEN}, f"subq: Unknown id: '{UNKNOWN}/todos' is not a subq task or batch id"),
    (["--api-url", "{api}", "run", "p"], {}, "subq: Missing bearer token: send 'Authorization: Bearer <token>' (the server's SUBQ_API_TOKEN); set SUBQ_API_TOKEN to the token of the API at {api}"),
    (["--api-url", "{api}", "run", "p"], {"SUBQ_API_TOKEN": "wrong"}, "subq: Invalid bearer token; set SUBQ_API_TOKEN to the token of the API at {api}"),
    (["cancel", UNKNOWN, "--reason", "x"], {"SUBQ_API_URL": "{api}", "SUBQ_API_TOKEN": "wrong"}, "subq: Invalid bearer token; set SUBQ_API_TOKEN"),
    (["--api-url", "{api}", "run", "p"], {"SUBQ_API_TOKEN": "tök\u00a0"}, "subq: The API token (SUBQ_API_TOKEN) must be printable ASCII with no spaces: check it was pasted whole"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "message"), API_REFUSALS, ids=[" ".join(a) for a, _, _ in API_REFUSALS])
def test_a_bad_api_url_or_token_is_one_line_and_changes_nothing(
    idle_coordinator: Coordinator, idle_api: str, args: list[str], env: dict[str, str], message: str
) -> None:
    args = [a.replace("{api}", idle_api) for a in args]
    env = {k: v.replace("{api}", idle_api) for k, v in env.items()}
    before = state(idle_coordinator, NO_TREE)
    proc = cli(*args, env=env)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr.startswith(message.replace("{api}", idle_api)), proc.stderr
    assert proc.stderr.count("\n") == 1
    assert state(idle_coordinator, NO_TREE) == before, "a refused command changed Redis or published a message"


@pytest.mark.parametrize("args", [["run", "p"], ["run", "p", "--follow"], ["result", UNKNOWN], ["status", UNKNOWN]])
def test_an_api_out_of_reach_exits_69_not_as_a_failed_root(idle_coordinator: Coordinator, args: list[str]) -> None:
    """A follower that lost sight of the API cannot say the tree failed: 69 (EX_UNAVAILABLE), docs/cli.md."""
    before = state(idle_coordinator, NO_TREE)
    proc = cli("--api-url", "http://127.0.0.1:1", *args, env={"SUBQ_API_TOKEN": TOKEN})
    assert (proc.returncode, proc.stdout) == (69, ""), proc.stderr
    assert proc.stderr.startswith("subq: The subq API at http://127.0.0.1:1 is unreachable: ConnectError")
    assert proc.stderr.count("\n") == 1
    assert state(idle_coordinator, NO_TREE) == before


def test_a_redis_that_answers_and_refuses_exits_1_not_69(settings: Settings) -> None:
    """A wrong password is no outage: a script told to look again later (69) would try it again for good."""
    url = urlsplit(settings.redis_url or "")
    wrong = url._replace(netloc=f"subq:wrong-password@{url.hostname}:{url.port}").geturl()
    proc = cli("--redis-url", wrong, "status", UNKNOWN)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr.startswith("subq: Redis") and proc.stderr.count("\n") == 1, proc.stderr


def test_an_export_it_cannot_write_is_one_line(idle_coordinator: Coordinator, tmp_path: Path) -> None:
    """A folder under a file (or a read-only or full disk) is the error's one line, not a traceback."""
    root = idle_coordinator.create_task("Export me", run=False)
    a_file = tmp_path / "report.txt"
    a_file.write_text("a file")
    env = {"SUBQ_REDIS_URL": idle_coordinator.settings.redis_url or "", "SUBQ_KEY_PREFIX": "subqidle"}
    proc = cli("export", root.id, str(a_file / "out"), env=env)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr == f"subq: cannot write {a_file / 'out'}: Not a directory\n"


@pytest.mark.parametrize(
    ("option", "text"), [("--todos", "[ ] caf\xe9\n"), ("--output-schema", '{"title": "caf\xe9"}')]
)
def test_stdin_that_is_not_utf8_is_refused_as_a_file_is(
    idle_coordinator: Coordinator, transport: Transport, tmp_path: Path, option: str, text: str
) -> None:
    """Stdin was read as text, decoded with the locale's encoding and surrogateescape: under LC_ALL=C a Latin-1
    "café" became "caf\\udce9", stored as "caf?" on Redis (a traceback through the API), where a file of the
    same bytes was refused. Both are read as UTF-8 now, and refused alike."""
    data = text.encode("latin-1")
    with pytest.raises(UnicodeDecodeError) as undecodable:
        data.decode("utf-8")
    a_file = tmp_path / "latin-1"
    a_file.write_bytes(data)
    env = transport.env(idle_coordinator.settings)
    before = state(idle_coordinator, NO_TREE)
    for path, stdin in (("-", data), (str(a_file), None)):
        proc = cli("run", "p", option, path, env=env, stdin=stdin)
        assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
        assert proc.stderr == f"subq: Cannot read {option} {path}: {undecodable.value}\n"
    assert state(idle_coordinator, NO_TREE) == before, "a refused command changed Redis or published a message"


def test_stdin_in_utf8_is_read_whatever_the_locale(idle_coordinator: Coordinator, transport: Transport) -> None:
    proc = cli("run", "p", "--todos", "-", env=transport.env(idle_coordinator.settings), stdin="[ ] café\n")
    assert proc.returncode == 0, proc.stderr
    assert [item.content for item in idle_coordinator.get_todos(proc.stdout.strip())] == ["café"]


def test_history_of_a_childs_id_is_refused_not_an_empty_page(
    idle_coordinator: Coordinator, transport: Transport
) -> None:
    """`--root` with a child's id read no task and printed an empty page on Redis; through the API it was refused.
    Both refuse it now, as `subq approvals --root` does, and change nothing."""
    root = idle_coordinator.create_task("a root")
    (child,) = idle_coordinator.delegate(root.id, [{"description": "c", "message": "m"}]).child_ids
    before = state(idle_coordinator, root.id)
    proc = cli("history", "--root", child, env=transport.env(idle_coordinator.settings))
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr == f"subq: root_id: {child} is not a root task (its root is {root.id})\n"
    assert state(idle_coordinator, root.id) == before


def test_historys_next_page_hint_keeps_the_filters(settings: Settings, transport: Transport) -> None:
    """The hint said `subq history --cursor N` alone: followed, it listed every task from there, not the filtered
    ones. It repeats the filters and the page size now, quoted for a shell (a value with a space)."""
    tag = f"hint {uuid.uuid4().hex[:8]}"
    with api_coordinator(settings, f"subqhint{uuid.uuid4().hex[:8]}", "subq-nobody") as coord:
        roots = [coord.create_task(f"root {n}", metadata={"run": tag}).id for n in range(4)]
        for root in roots[1::2]:
            coord.cancel(root, "test")
        env = transport.env(coord.settings)
        first = cli("history", "--status", "cancelled", "--meta", f"run={tag}", "--limit", "1", env=env)
        assert first.returncode == 0 and roots[3] in first.stdout, first.stderr
        hint = re.fullmatch(r"\(more: (.*)\)\n", first.stderr)
        assert hint is not None, first.stderr
        assert hint[1] == f"subq history --status cancelled --meta 'run={tag}' --limit 1 --cursor 1"
        second = cli(*shlex.split(hint[1])[1:], env=env)
        assert second.returncode == 0 and roots[1] in second.stdout and roots[2] not in second.stdout, second


def test_the_api_needs_no_redis_settings(idle_coordinator: Coordinator, idle_api: str) -> None:
    """With only the API's URL and token, a run starts (and its message waits on the idle queue)."""
    proc = cli("run", "p", env={"SUBQ_API_URL": idle_api, "SUBQ_API_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr
    assert idle_coordinator.get_task(proc.stdout.strip()).prompt == "p"


@pytest.mark.parametrize(
    ("command", "env", "message"),
    [
        (["status", UNKNOWN], {}, "subq: Invalid setting SUBQ_REDIS_URL: not set"),
        (["status", UNKNOWN], {"SUBQ_MAX_DEPTH": "deep"}, "subq: Invalid setting SUBQ_MAX_DEPTH"),
        (["worker"], {"SUBQ_WORKER_CONCURRENCY": "many"}, "subq: Invalid setting SUBQ_WORKER_CONCURRENCY"),
        (["flower", "--password", "pw"], {}, "subq: Invalid setting SUBQ_REDIS_URL: not set"),
        (
            ["api"],
            {"SUBQ_API_TRUSTED_PROXIES": "10.0.0.0/8,proxy.local"},
            "subq: Invalid setting SUBQ_API_TRUSTED_PROXIES: 'proxy.local' is not an IP address or network",
        ),
        (["api"], {"SUBQ_API_AUTH_ATTEMPTS_PER_MIN": "0"}, "subq: Invalid setting SUBQ_API_AUTH_ATTEMPTS_PER_MIN"),
        (["api"], {"SUBQ_API_OPEN_REQUESTS_PER_MIN": "lots"}, "subq: Invalid setting SUBQ_API_OPEN_REQUESTS_PER_MIN"),
        (["api"], {"SUBQ_API_HTTPS": "maybe"}, "subq: Invalid setting SUBQ_API_HTTPS"),
        (  # .env.example's value, as a copy holds it before it is filled in
            ["api"],
            {"SUBQ_REDIS_URL": "redis://127.0.0.1:1/0", "SUBQ_API_TOKEN": "change-me"},
            "subq: Invalid setting SUBQ_API_TOKEN: 'change-me' is the example's placeholder, not a token; generate",
        ),
    ],
)
def test_bad_settings_are_one_line(command: list[str], env: dict[str, str], message: str) -> None:
    proc = cli(*command, env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1


# -- reading what ran --------------------------------------------------------------------


def test_status_and_todos_show_the_figures(coordinator: Coordinator, settings: Settings, transport: Transport) -> None:
    parent = coordinator.create_task("p", todos="[ ] first\n[ ] second")
    batch = coordinator.delegate(parent.id, [{"description": "c", "message": script(usage_step())}])
    coordinator.wait(parent.id, 60)
    env = transport.env(settings)
    todos = cli("todos", parent.id, env=env)
    assert todos.returncode == 0, todos.stderr
    assert f"[x] first  ({batch.child_ids[0]}: 13500 tokens, $0.021000)" in todos.stdout
    assert "[ ] second" in todos.stdout
    status = cli("status", parent.id, "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert '"total_cost_micros": 21000' in status.stdout


@pytest.fixture
def fleet_env(settings: Settings, coordinator: Coordinator, transport: Transport) -> dict[str, str]:
    """Reaches the test workers (the `coordinator` fixture starts them), over Redis or the API."""
    return transport.env(settings)


def test_run_follow_then_tree_history_and_export(fleet_env: dict[str, str], tmp_path: Path) -> None:
    root = agent(
        call("run_subagents", tasks=[subtask("A", reply("A done")), subtask("B", reply("B done"))]),
        call("attempt_completion", result="Report ready"),
        text="Prepare the report.",
    )
    todo_file = tmp_path / "plan.md"
    todo_file.write_text("[ ] A\n[ ] B\n")
    run = cli("run", root, "--todos", str(todo_file), "--follow", env=fleet_env)
    assert run.returncode == 0, run.stderr
    root_id = run.stdout.splitlines()[0]
    assert re.fullmatch(r"[0-9a-f]{16}", root_id)
    live_log, _, final = run.stdout.partition("\n\n")
    assert final.startswith(f"{root_id}  completed")
    # The final tree ends the output: the root's own 2 requests and one per child.
    assert f"{root_id}  completed  'Prepare the report.'  own {2 * STEP_TOKENS} tokens $0.042000, " \
        f"total {4 * STEP_TOKENS} tokens $0.084000" in run.stdout  # fmt: skip

    tree = cli("tree", root_id, env=fleet_env)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    for name in ("A", "B"):
        item = next(line for line in lines if f"[x] {name} " in line)
        assert re.search(rf"\[x\] {name}\s+{STEP_TOKENS} tokens\s+\$0\.021000  -> {root_id}-[0-9a-f]{{12}}$", item)
    children = [line for line in lines if re.match(r"^(\|--|`--) ", line)]
    for child in children:  # the live view showed every task as it ran
        assert f"\n  {child[4:33]}  " in live_log
    assert len(children) == 2 and all("completed" in c and "total 13500 tokens $0.021000" in c for c in children)
    tree_json = cli("tree", root_id, "--json", env=fleet_env)
    assert tree_json.returncode == 0, tree_json.stderr
    as_json = json.loads(tree_json.stdout)
    assert as_json["total_cost_micros"] == 4 * STEP_COST_MICROS
    assert [c["todos"] for c in as_json["children"]] == [[], []]

    page = json.loads(cli("history", "--root", root_id, "--json", env=fleet_env).stdout)
    assert len(page["items"]) == 3 and page["next_cursor"] is None
    assert {i["id"] for i in page["items"]} == {root_id, *(c["id"] for c in as_json["children"])}
    table = cli("history", "--root", root_id, "--limit", "1", env=fleet_env)
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 2  # the header and one task
    assert table.stderr.strip() == f"(more: subq history --root {root_id} --limit 1 --cursor 1)"

    out = tmp_path / "export"
    exported = cli("export", root_id, str(out), env=fleet_env)
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.strip() == f"Exported 3 tasks ({3 * len(FILE_NAMES)} files) to {out}"
    history_item = json.loads((out / root_id / "history_item.json").read_text())
    assert history_item["status"] == "completed" and history_item["total_cost"] == 0.042


def test_run_follow_exits_1_when_the_root_fails(fleet_env: dict[str, str]) -> None:
    failing = agent({"fail": "the provider refused the request"}, text="Doomed.")
    run = cli("run", failing, "--todos", "-", "--follow", env=fleet_env, stdin="[ ] only item\n")
    assert run.returncode == 1
    root_id = run.stdout.splitlines()[0]
    assert "[ ] only item" in run.stdout
    assert run.stderr.startswith(f"subq: run {root_id} failed: ")
    assert "the provider refused the request" in run.stderr

"""`subq up` end to end: the whole stack from one command, used from a second process, stopped by a signal.

Every process `subq up` starts inherits a marker variable, so the test can find
any that outlived it (redis-server rewrites its environment, so its port is
checked instead).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis

from coordinator.local.fleet import signal_group
from coordinator.local.ports import free_port, port_free
from coordinator.local.up import write_private_file
from tests.agents import STEP_COST_MICROS, STEP_TOKENS, tree_root
from tests.helpers import eventually
from tests.test_cli import processes_marked, subq

START_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 60.0
SEEN_TIMEOUT_S = 30.0


class Up:
    """`subq up` as a subprocess in its own session, its stdout read line by line."""

    def __init__(self, args: list[str], marker: str, **settings: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBQ_", "FLOWER_"))}
        env.update(settings, UP_TEST_MARKER=marker)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "up", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def read_until(self, last: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if line == last:
                return "\n".join(self.seen)
        raise AssertionError(f"subq up never printed {last!r}:\n" + "\n".join(self.seen))

    def interrupt(self, sig: signal.Signals) -> int:
        """Signal the session's process group (a terminal's Ctrl-C reaches the whole foreground group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=10)  # its last lines: the reader ends at the pipe's end (a loaded host is slow)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

    def kill(self) -> None:
        """Last resort for a failed test: the group, and every process carrying the marker."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def marker() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    for pid in _marked_pids(value):  # only after a failure: a passing test found none
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _marked_pids(marker: str) -> list[int]:
    import psutil

    pids = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("UP_TEST_MARKER") == marker:
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


# The reproduction of issue 39: a raw `SET pwned yes` (after AUTH, the password given on the command line).
SANDBOXED_SET = (
    'python3 -c \'import socket,sys; s=socket.create_connection(("127.0.0.1", int(sys.argv[1])), 5); '
    's.sendall(f"AUTH {{sys.argv[2]}}\\r\\nSET pwned yes\\r\\n".encode()); print(s.recv(100))\' {port} {password}'
)


def _sandbox_reaches_none_of(redis_url: str, ports: list[int]) -> None:
    """A command with `network = true`, in the real sandbox, reaches none of the stack's ports (its 127.0.0.1 is
    its own loopback, where nothing listens): Redis is unchanged."""
    import asyncio
    import tempfile

    from coordinator import RunCommand
    from workers.runtime import commands

    password = urlsplit(redis_url).password or ""
    with tempfile.TemporaryDirectory() as folder:
        config = RunCommand(cwd=Path(folder), network=True)
        for port in ports:
            tried = asyncio.run(commands.run(SANDBOXED_SET.format(port=port, password=password), config))
            assert tried.exit_code not in (None, 0) and "ConnectionRefusedError" in tried.output, (port, tried.text())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get("pwned") is None
    finally:
        client.close()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_up_serves_a_run_from_another_terminal_and_ctrl_c_leaves_nothing(marker: str) -> None:
    api_port = free_port(4)  # below the ephemeral range; then Flower's, and the two workers' metrics ports
    flower_port, metrics_port = api_port + 1, api_port + 2
    args = ["--workers", "2", "--api-port", str(api_port), "--flower-port", str(flower_port)]
    up = Up(args, marker, SUBQ_WORKER_METRICS_PORT=str(metrics_port))
    try:
        banner = up.read_until("Press Ctrl-C to stop everything.", START_TIMEOUT_S)
        redis_url = _find(r"^  Redis    (redis://\S+)  \(embedded", banner)
        flower_url, user = _find(
            r"^  Flower   (http://\S+)  \(user: (\S+), password: subq_flower_password in the credentials file\)",
            banner, groups=2,
        )  # fmt: skip
        credentials = Path(_find(r"^  Secrets  (/\S+)  \(readable only by you; removed when subq up stops\)$", banner))
        assert _find(r"^  (\. \S+)$", banner) == f". {credentials}"
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        assert credentials.stat().st_uid == os.getuid()
        exported, password = _load(credentials)
        assert set(exported) == {"SUBQ_REDIS_URL", "SUBQ_API_URL", "SUBQ_API_TOKEN"}
        # The embedded Redis has a password (issue 39): in the file's URL, masked in the banner.
        redis_password = urlsplit(exported["SUBQ_REDIS_URL"]).password or ""
        assert exported["SUBQ_REDIS_URL"].replace(redis_password, "***") == redis_url
        # The secrets are in the file only: not on stdout, where scrollback and logs keep them.
        for secret in (exported["SUBQ_API_TOKEN"], password, redis_password):
            assert len(secret) >= 20 and secret not in banner, banner
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        _check_redis_password(exported["SUBQ_REDIS_URL"], redis_port)

        # A second terminal, with only the printed environment.
        run = subq("run", tree_root(), "--follow", env=exported)
        assert run.returncode == 0, run.stdout + run.stderr
        root_id = run.stdout.splitlines()[0]
        tree = subq("tree", root_id, env=exported)
        assert tree.returncode == 0, tree.stderr
        items = [line for line in tree.stdout.splitlines() if re.search(r"\[x\] (A|B|C|B1|B2) ", line)]
        assert len(items) == 5
        for line in items:  # every item: its tokens and cost, and the child it links to
            name = re.search(r"\[x\] (\S+)", line).group(1)  # type: ignore[union-attr]
            requests = 5 if name == "B" else 1  # B made three requests, its two children one each
            assert f"{requests * STEP_TOKENS} tokens" in line and f"$0.{requests * STEP_COST_MICROS:06d}" in line
            assert re.search(rf"-> {root_id}-[0-9a-f]{{12}}$", line)
        assert f"total {11 * STEP_TOKENS} tokens $0.{11 * STEP_COST_MICROS:06d}" in tree.stdout.splitlines()[0]

        def flower_tasks() -> dict[str, Any] | None:
            response = httpx.get(f"{flower_url}/api/tasks?taskname=subq.run_task", auth=(user, password), timeout=10)
            runs = {k: v for k, v in response.json().items() if k.startswith(root_id) and v["state"] == "SUCCESS"}
            return runs if {k for k in runs if "-r" not in k} >= {root_id} and len(runs) >= 6 else None

        runs = eventually(flower_tasks, "the run's tasks in Flower", SEEN_TIMEOUT_S, every_s=0.5)
        assert all(v["args"].startswith(f"task={k.split('-r')[0]} ") for k, v in runs.items())
        assert httpx.get(f"{flower_url}/api/tasks", timeout=10).status_code == 401

        # Flower's broker page and a worker's page (its configuration) name Redis, not its password.
        def flower_workers() -> dict[str, Any] | None:
            listed = httpx.get(f"{flower_url}/api/workers?refresh=1", auth=(user, password), timeout=20)
            return listed.json() or None

        worker = next(iter(eventually(flower_workers, "the workers in Flower", SEEN_TIMEOUT_S, every_s=0.5)))
        for page in ("broker", f"worker/{worker}"):
            shown = httpx.get(f"{flower_url}/{page}", auth=(user, password), timeout=10)
            assert shown.status_code == 200 and f"127.0.0.1:{redis_port}" in shown.text, page
            assert redis_password not in shown.text, page

        api_url = _find(r"^  API      (http://\S+)  \(token: SUBQ_API_TOKEN in the credentials file\)$", banner)
        token = exported["SUBQ_API_TOKEN"]
        url = f"{api_url}/v1/tasks/{root_id}/tree"
        answer = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["total_cost_micros"] == 11 * STEP_COST_MICROS
        assert httpx.get(url, timeout=10).status_code == 401
        _sandbox_reaches_none_of(exported["SUBQ_REDIS_URL"], [redis_port, int(urlsplit(api_url).port or 0),
                                 int(urlsplit(flower_url).port or 0)])  # fmt: skip
        # Each worker's own counters, at the ports printed: together, the tree's spend.
        ports = _find(r"^  Metrics  http://\S+  \(each worker's counters: ports (.+)\)$", banner).split(", ")
        assert ports == [str(metrics_port), str(metrics_port + 1)]
        scraped = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in ports]
        spent = sum(float(line.split()[-1]) for text in scraped for line in text.splitlines()
                    if line.startswith("subq_cost_micro_usd_total{"))  # fmt: skip
        assert spent == 11 * STEP_COST_MICROS
        # The web view's address, signed in with the same token, shows the tree.
        web_url = _find(r"^  Web      (http://\S+)  \(the live trees in a browser; sign in with the token\)", banner)
        assert web_url == f"{api_url}/ui/"
        with httpx.Client(timeout=10, follow_redirects=True) as browser:
            signed_in = browser.post(f"{web_url}login", data={"token": token, "next": f"/ui/tasks/{root_id}"})
            assert signed_in.status_code == 200 and f'id="task-{root_id}"' in signed_in.text
            assert redis_password not in signed_in.text
        # Every log of the stack (Celery's banners, Flower's and uvicorn's lines) and no process's command line.
        log_dir = Path(_find(r"^  Logs     (/\S+)  \(removed when subq up stops\)$", banner))
        logs = [log for log in log_dir.iterdir() if log != credentials]
        assert logs and not [log.name for log in logs if redis_password in log.read_text(errors="replace")]
        assert not [
            p.pid for p in psutil.process_iter(["cmdline"]) if redis_password in " ".join(p.info["cmdline"] or [])
        ]
        # The first run the banner suggests, pasted into a shell with the printed environment: its plan fans out.
        _the_suggested_run_fans_out(_find(r"^  \. \S+\n((?:  .+\n)+)", banner + "\n"), exported)
    finally:
        code = up.interrupt(signal.SIGINT)
        up.kill()
    assert code == 0, "\n".join(up.seen)
    assert up.seen[-1] == "subq up: SIGINT received; everything it started is stopped."
    assert exported["SUBQ_API_TOKEN"] not in "\n".join(up.seen) and password not in "\n".join(up.seen)
    assert not credentials.exists()
    assert processes_marked("UP_TEST_MARKER", marker) == []
    for port in (flower_port, api_port, redis_port):
        assert not _answers(port), f"port {port} still answers"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(exported["SUBQ_REDIS_URL"], socket_connect_timeout=1).ping()


def _check_redis_password(url: str, port: int) -> None:
    """`subq up`'s Redis refuses a client without its password (the incident's `SET pwned yes` included)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"SET pwned yes\r\n")
        assert sock.recv(200).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2).ping()
    with redis.Redis.from_url(url, socket_connect_timeout=2) as client:
        assert client.ping() and client.get("pwned") is None


def test_sigterm_while_starting_stops_what_was_started(marker: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    up = Up(["--no-api", "--workers", "2", "--flower-port", str(free_port()), "--log-dir", str(log_dir)], marker)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (log_dir / "worker1.log").exists():  # the workers are starting, nothing is ready yet
            assert time.monotonic() < deadline and up.proc.poll() is None, "subq up did not start its workers"
            time.sleep(0.05)
    finally:
        code = up.interrupt(signal.SIGTERM)
        up.kill()
    assert code == 0, "\n".join(up.seen)
    assert up.seen[-1] == "subq up: SIGTERM received; everything it started is stopped."
    assert "subq is up" not in "\n".join(up.seen)
    assert processes_marked("UP_TEST_MARKER", marker) == []


def test_a_group_already_gone_is_signalled_without_an_error() -> None:
    """`subq up` stopped while it starts its workers can find a worker's group gone between its check and its signal."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        signal_group(alive.pid, signal.SIGTERM)
        assert alive.wait(timeout=STOP_TIMEOUT_S) == -signal.SIGTERM
    finally:
        alive.kill()
    # No process has the id pid_max (ids stay below it): a group certainly gone, which `os.killpg` refuses.
    gone = int(Path("/proc/sys/kernel/pid_max").read_text())
    with pytest.raises(ProcessLookupError):
        os.killpg(gone, signal.SIGTERM)
    signal_group(gone, signal.SIGTERM)


def _held_port() -> tuple[socket.socket, int]:
    """A listening socket on 127.0.0.1 whose port's predecessor is free (it is worker 0's port in the test)."""
    for _ in range(100):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if port_free("127.0.0.1", port - 1):
            held.listen()
            return held, port
        held.close()
    raise AssertionError("no port with a free predecessor")


@pytest.mark.parametrize("case", ["in use", "flower's", "past 65535"])
def test_a_workers_metrics_port_is_checked_before_anything_starts(marker: str, tmp_path: Path, case: str) -> None:
    """Worker i serves SUBQ_WORKER_METRICS_PORT + i: a port it could not bind is one line, and nothing starts.

    Found late, the worker exited at start and took down a stack that had already started.
    """
    held, taken = _held_port()
    api_port, flower_port, log_dir = free_port(), free_port(), tmp_path / "logs"
    with held:
        base, expected = {
            "in use": (taken - 1, f"Port {taken} on 127.0.0.1 is in use (worker 1's metrics port, "
                       f"SUBQ_WORKER_METRICS_PORT={taken - 1} + 1); choose another SUBQ_WORKER_METRICS_PORT"),
            "flower's": (flower_port - 1, f"Port {flower_port} is both --flower-port and worker 1's metrics port, "
                         f"SUBQ_WORKER_METRICS_PORT={flower_port - 1} + 1; choose another SUBQ_WORKER_METRICS_PORT "
                         "or --flower-port"),
            "past 65535": (65535, "Port 65536 is past 65535 (worker 1's metrics port, SUBQ_WORKER_METRICS_PORT=65535 "
                           "+ 1); choose a lower SUBQ_WORKER_METRICS_PORT"),
        }[case]  # fmt: skip
        args = ["up", "--workers", "2", "--api-port", str(api_port), "--flower-port", str(flower_port)]
        env = {"SUBQ_WORKER_METRICS_PORT": str(base), "SUBQ_WORKER_METRICS_HOST": "127.0.0.1", "UP_TEST_MARKER": marker}
        refused = subq(*args, "--log-dir", str(log_dir), env=env, timeout_s=START_TIMEOUT_S)
    assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", f"subq: {expected}\n")
    # Nothing started: no embedded Redis (the log folder is made after it), no worker, API or Flower.
    assert not log_dir.exists()
    assert processes_marked("UP_TEST_MARKER", marker) == []
    assert not _answers(api_port) and not _answers(flower_port)


def _load(credentials: Path) -> tuple[dict[str, str], str]:
    """What a second terminal gets from `. <file>`: the exported SUBQ_ variables, and the Flower password."""
    clean = {"PATH": os.environ["PATH"]}
    shell = ["sh", "-c", '. "$1" && env && printf "%s" "$subq_flower_password" >&2', "sh", str(credentials)]
    loaded = subprocess.run(shell, env=clean, capture_output=True, text=True, timeout=10, check=True)
    exported = dict(line.split("=", 1) for line in loaded.stdout.splitlines() if line.startswith("SUBQ_"))
    assert "subq_flower" not in loaded.stdout, "the Flower login must not be exported to every later program"
    return exported, loaded.stderr


def test_the_credentials_file_is_private_and_replaces_what_was_there(tmp_path: Path) -> None:
    """Created 0600 under a umask that takes nothing away; an earlier file or a link there is replaced, not followed."""
    path, elsewhere = tmp_path / "credentials.env", tmp_path / "elsewhere"
    previous = os.umask(0)
    try:
        write_private_file(path, "first\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "first\n"
        path.chmod(0o644)  # an earlier run's file that someone made readable
        write_private_file(path, "second\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "second\n"
        elsewhere.write_text("not yours\n")
        elsewhere.chmod(0o644)
        path.unlink()
        path.symlink_to(elsewhere)
        write_private_file(path, "third\n")
    finally:
        os.umask(previous)
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "third\n"
    assert elsewhere.read_text() == "not yours\n" and stat.S_IMODE(elsewhere.stat().st_mode) == 0o644


def _the_suggested_run_fans_out(pasted: str, exported: dict[str, str]) -> None:
    """`pasted` run by a POSIX shell, as a user pastes it, with `subq` on PATH and `exported` its only SUBQ_
    variables: a root whose every plan item is checked and carried out by a child of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBQ_", "FLOWER_"))} | exported
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    shell = subprocess.run(["sh", "-c", pasted], env=env, capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0, pasted + shell.stdout + shell.stderr
    root_id = shell.stdout.splitlines()[0]
    tree = subq("tree", root_id, env=exported)
    assert tree.returncode == 0, tree.stderr
    items = [line for line in tree.stdout.splitlines() if re.search(r"\[.\] ", line)]
    assert len(items) == 3, tree.stdout
    children = {re.search(rf"\[x\] .* -> ({root_id}-[0-9a-f]{{12}})$", line).group(1) for line in items}  # type: ignore[union-attr]
    assert len(children) == 3, tree.stdout


def _find(pattern: str, text: str, groups: int = 1) -> Any:
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"{pattern!r} not in:\n{text}"
    return match.group(1) if groups == 1 else match.groups()


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (["--log-dir", "/etc/passwd"], "--log-dir /etc/passwd: not a folder"),
        (["--log-dir", "/etc/passwd/logs"], "--log-dir /etc/passwd/logs: /etc/passwd is not a folder"),
        (["--log-dir", "/proc/subq-logs"], "--log-dir /proc/subq-logs: "),  # root may: found as it is made
        (["--host", "no such host"], "--host 'no such host': no server can listen there"),
    ],
)
def test_a_log_dir_or_host_that_cannot_serve_is_one_line_before_anything_starts(
    marker: str, option: list[str], expected: str
) -> None:
    """Found late, each was a traceback after the embedded Redis had started (a log folder that is a file, or in
    one), or a line blaming a port nobody held (a host that does not resolve)."""
    api_port, flower_port = free_port(), free_port()
    args = ["up", "--workers", "1", "--api-port", str(api_port), "--flower-port", str(flower_port), *option]
    refused = subq(*args, env={"UP_TEST_MARKER": marker}, timeout_s=START_TIMEOUT_S)
    assert (refused.returncode, refused.stdout) == (1, ""), refused
    assert refused.stderr.startswith(f"subq: {expected}") and refused.stderr.count("\n") == 1, refused.stderr
    assert processes_marked("UP_TEST_MARKER", marker) == []

"""Every Redis subq starts has a password, and a worker on one without says so (issue 39).

The incident: a sandboxed command allowed the network opened a TCP connection to
the embedded Redis's port and sent `SET pwned yes`, and it worked. Real
redis-server and worker processes throughout; `subq up`'s Redis is checked in
tests/test_up.py, on the stack it already starts.
"""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import redis
from pydantic import SecretStr

from coordinator import ConfigError, Settings
from coordinator.local.embedded_redis import find_redis_server, local_redis
from coordinator.local.fleet import WorkerFleet, settings_env
from coordinator.local.ports import free_port
from coordinator.redis_clients import check_redis_url, credentials_refused, password_warning, redis_client
from tests.helpers import CHECK_TIMEOUT_S, eventually

# The warning's own words, as a worker logs it (coordinator/redis_clients.py, password_warning).
NO_PASSWORD = "carries no password"
# The incident's command, as the sandboxed command sent it: inline, no client library.
INCIDENT = b"SET pwned yes\r\n"
WHY = (
    "anything that can connect to that Redis, a sandboxed command allowed the network included, can read and "
    'change every task (docs/deploy.md, "Redis\'s password")'
)


def _raw(port: int, command: bytes) -> bytes:
    """What Redis answers to `command` sent on a fresh TCP connection, as the sandboxed command sent it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(200)


def _redis_servers_of_this_process(port: int) -> list[psutil.Process]:
    """This process's redis-server children listening on `port` (the session's own Redis may run beside it)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "redis-server" in p.name() and any(c.laddr.port == port for c in p.net_connections(kind="tcp"))
    ]


def test_the_embedded_redis_refuses_a_client_without_its_password() -> None:
    with local_redis() as url:
        parts = urlsplit(url)
        password, port = parts.password, parts.port
        assert port is not None and password is not None and len(password) >= 32
        assert url == f"redis://:{password}@127.0.0.1:{port}/0"
        # The incident, again: refused, and nothing written.
        assert _raw(port, INCIDENT).startswith(b"-NOAUTH")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="not-it", socket_connect_timeout=2).ping()
        with redis.Redis.from_url(url) as client:
            assert client.ping() and client.get("pwned") is None
        # Not on redis-server's command line, which every local user can read.
        (server,) = _redis_servers_of_this_process(port)
        for pid in (server.pid, *(p.pid for p in server.children(recursive=True))):
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # In a config file only this user can read, in a folder only this user can enter: the
        # server's working folder (--dir), as redis-server rewrites its process title.
        config = Path(server.cwd()) / "redis.conf"
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
        assert config.read_text() == f"requirepass {password}\n"
    assert not config.parent.exists()


def test_each_start_has_a_new_password() -> None:
    with local_redis() as first, local_redis() as second:
        assert urlsplit(first).password != urlsplit(second).password


@contextmanager
def _redis_without_password() -> Iterator[str]:
    """A redis-server as an operator may run one, with no password: the case the worker warns about."""
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:

        def answers() -> bool:
            try:
                return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
            except redis.ConnectionError:
                return False

        eventually(answers, "the password-less redis-server", 10, every_s=0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_worker_on_a_redis_without_a_password_warns_in_one_line(tmp_path: Path) -> None:
    """One line at the start of a worker whose SUBQ_REDIS_URL has no password; none where it has one."""
    with ExitStack() as stack:
        bare_url = stack.enter_context(_redis_without_password())
        guarded_url = stack.enter_context(local_redis())
        fleets = {
            name: stack.enter_context(
                WorkerFleet(Settings(redis_url=url, worker_concurrency=2), 1, tmp_path / name, name=name)
            )
            for name, url in (("bare", bare_url), ("guarded", guarded_url))
        }
        for fleet in fleets.values():
            fleet.wait_ready()
    bare = fleets["bare"].logs[0].read_text()
    guarded = fleets["guarded"].logs[0].read_text()
    warnings = [line for line in bare.splitlines() if NO_PASSWORD in line]
    assert len(warnings) == 1, bare
    assert warnings[0].endswith(f"subq worker: warning: SUBQ_REDIS_URL ({bare_url}) carries no password: {WHY}")
    assert NO_PASSWORD not in guarded, guarded
    # The guarded worker's log, Celery's banner included, shows where Redis is, never its password.
    password = urlsplit(guarded_url).password
    assert password is not None and password not in guarded
    assert f"127.0.0.1:{urlsplit(guarded_url).port}" in guarded


@pytest.mark.parametrize(
    ("url", "settings"),
    [
        ("redis://127.0.0.1:6379/0", {}),
        ("redis://subq@127.0.0.1:6379/0", {}),  # a user without a password sends no AUTH
        ("unix:///run/redis/redis.sock", {}),  # a command's read-only view still lets it connect
        ("redis://:@127.0.0.1:6379/0", {}),
    ],
)
def test_the_warning_names_each_url_without_a_password(url: str, settings: dict[str, str]) -> None:
    warning = password_warning(Settings(redis_url=url, **settings))
    assert warning is not None and NO_PASSWORD in warning and "docs/deploy.md" in warning


@pytest.mark.parametrize(
    "given",
    [
        {"redis_url": "redis://:s3cret@127.0.0.1:6379/0"},
        {"redis_url": "rediss://subq:s3cret@redis.internal:6380/0?ssl_cert_reqs=required"},
        {"redis_url": "redis://127.0.0.1:6379/0?password=s3cret"},
        {"redis_url": "unix://:s3cret@/run/redis/redis.sock"},
        {"redis_sentinels": "s1:26379", "redis_sentinel_master": "subq", "redis_password": "s3cret"},
    ],
)
def test_no_warning_with_a_password(given: dict[str, str]) -> None:
    assert password_warning(Settings(**given)) is None  # type: ignore[arg-type]


def test_under_sentinel_the_warning_names_subq_redis_password() -> None:
    warning = password_warning(Settings(redis_sentinels="s1:26379", redis_sentinel_master="subq"))
    assert warning is not None and warning.startswith("SUBQ_REDIS_PASSWORD is not set: ")


# Each malformed URL holds a password whose pieces must not show in the error: "xq", "zv", "hunter2".
EARLY_END = "its password holds a '/', '?' or '#', which ends the host part early"
MALFORMED = [
    ("redis://:xq#zv@127.0.0.1:6379/0", EARLY_END),
    ("redis://:xq/zv@127.0.0.1:6379/0", EARLY_END),
    ("redis://:xq?zv@127.0.0.1:6379/0", EARLY_END),
    ("redis://:hunter2@127.0.0.1:xq/0", "its port is not a number from 1 to 65535"),
    ("redis://:hunter2@:6379/0", "no host after the '//'"),
    ("redis://:hunter2@127.0.0.1:6379/xq", "the database after the host must be a number, as in /0"),
]
SECRET_PIECES = ("xq", "zv", "hunter2")


@pytest.mark.parametrize(("url", "reason"), MALFORMED)
def test_a_malformed_url_is_one_line_without_its_password(url: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_redis_url(url)
    message = str(caught.value)
    assert message.startswith(f"Invalid setting SUBQ_REDIS_URL: {reason}") and caught.value.field == "SUBQ_REDIS_URL"
    assert not any(piece in message for piece in SECRET_PIECES), message
    # Every client subq makes reads the URL through the same check.
    with pytest.raises(ConfigError, match="^Invalid setting SUBQ_REDIS_URL: "):
        redis_client(Settings(redis_url=url))


def test_a_malformed_url_stops_the_worker_and_the_cli_with_one_line() -> None:
    """The worker's start and a CLI command each fail with the one line, and no piece of the password."""
    url, reason = MALFORMED[0]
    env = settings_env(Settings(redis_url=url))
    worker = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "--loglevel", "INFO"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode != 0
    assert worker.stderr.strip().splitlines()[-1] == f"subq worker: Invalid setting SUBQ_REDIS_URL: {reason}; " + (
        "percent-encode each character of the password but letters, digits and -._~ "
        "(urllib.parse.quote(password, safe=''))"
    )
    from tests.test_cli import cli as in_process  # the command's words, without a process of its own (1.2 s of CPU)

    cli = in_process("status", "t-nothing", env={k: v for k, v in env.items() if k.startswith("SUBQ_")})
    assert cli.returncode != 0 and cli.stdout == ""
    assert (
        cli.stderr.startswith(f"subq: Invalid setting SUBQ_REDIS_URL: {reason}") and len(cli.stderr.splitlines()) == 1
    )
    for out in (worker.stdout + worker.stderr, cli.stderr):
        assert not any(piece in out for piece in SECRET_PIECES), out


def _api_start_log(url: str, tmp_path: Path) -> str:
    """What `subq api` writes from its start until it answers /livez, then a SIGTERM (its whole log)."""
    port = free_port()
    env = settings_env(Settings(redis_url=url, api_token=SecretStr("api-warning-test-token")))
    log = tmp_path / f"api-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "api", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def live() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        eventually(live, "subq api to answer /livez", 60, every_s=0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return log.read_text()


def test_an_api_on_a_redis_without_a_password_warns_in_one_line(tmp_path: Path) -> None:
    """`subq api` says it once at its start, beside the worker's line; nothing where the URL has a password."""
    with _redis_without_password() as bare_url, local_redis() as guarded_url:
        bare, guarded = _api_start_log(bare_url, tmp_path), _api_start_log(guarded_url, tmp_path)
    warnings = [line for line in bare.splitlines() if NO_PASSWORD in line]
    assert warnings == [f"subq api: warning: SUBQ_REDIS_URL ({bare_url}) carries no password: {WHY}"], bare
    assert NO_PASSWORD not in guarded, guarded
    password = urlsplit(guarded_url).password
    assert password is not None and password not in guarded


@pytest.mark.parametrize("given", ["a wrong password", "no password"])
def test_a_worker_whose_redis_refuses_its_credentials_stops_at_start_with_one_line(given: str) -> None:
    """A wrong password is no outage to wait out: before, Celery tried its broker again forever, one log line a
    try, and the worker ran nothing. It stops at start, saying so, its password in no line, nothing written."""
    with local_redis() as url:
        parts = urlsplit(url)
        wrong = f"redis://:not-{parts.password}@127.0.0.1:{parts.port}/0"
        bare = f"redis://127.0.0.1:{parts.port}/0"
        given_url = wrong if given == "a wrong password" else bare
        with redis.Redis.from_url(url) as client:
            keys_before = client.dbsize()
        env = settings_env(Settings(redis_url=given_url))
        started = subprocess.run(
            [sys.executable, "-m", "workers", "--loglevel", "INFO"], env=env, capture_output=True, text=True,
            timeout=CHECK_TIMEOUT_S, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        told = started.stdout + started.stderr
        assert started.returncode != 0, told
        said = "username-password pair" if given == "a wrong password" else "authenticated"  # Redis' own words
        lines = [line for line in told.splitlines() if "refused its credentials" in line]
        assert lines and said in lines[0].lower(), told
        assert f"subq's Redis (redis://127.0.0.1:{parts.port}/0) refused its credentials" in lines[0], told
        assert parts.password not in told
        with redis.Redis.from_url(url) as client:
            assert client.dbsize() == keys_before, "the refused worker wrote nothing"


def test_a_redis_out_of_reach_is_no_refusal() -> None:
    """A Redis down (or no sentinel answering) is the outage a worker waits out: its start says nothing of it."""
    assert credentials_refused(Settings(redis_url=f"redis://:secret@127.0.0.1:{free_port()}/0")) is None
    with local_redis() as url:
        assert credentials_refused(Settings(redis_url=url)) is None

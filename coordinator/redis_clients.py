"""Every Redis client subq makes, made here: one Redis (SUBQ_REDIS_URL), or the master Redis Sentinel names.

subq's own clients (the store of every process, a worker's pool, the API's health
reads, the CLI, `subq up`'s check) come from `redis_client`; Celery's broker and
result backend take the same choice as a URL and transport options
(`celery_url`, `sentinel_transport_options`), for kombu's and
Celery's own sentinel transports (`sentinel://h1:p1;sentinel://h2:p2` with
`master_name`).

With one Redis a client is `redis.Redis.from_url`, exactly as before this module
existed. Under Sentinel it is `Sentinel(...).master_for(...)`: every new
connection asks the sentinels where the master is, so a connection lost in a
failover reconnects to the replica they promoted. A command that fails with a
connection error meanwhile is sent again with backoff (`failover_retry`) for
about as long as a failover takes, so a run in flight carries on with its step on
the new master rather than failing its task. A step sent again after a connection
error that came before it ran (a refused connect, READONLY, NOREPLICAS, the
health check) changes nothing; one whose own reply was lost after it ran (the
master killed right after, a read timeout) arrives a second time. A run's steps
(start, flush, tool step, end), a decision, an approval's request, the once-only
claims, a batch's close, a stop, a retry and a slot's release know their own resend
and answer it as they did the first time, writing nothing twice
(coordinator/store/fields.py: `run_token`, `last_step`, `end_reply`, ...;
tests/test_resend.py). A WATCH transaction is never sent again (redis-py raises WatchError for a connection
lost while watching) but run again on the state it finds, so each knows its own commit (a delegation by its
batch id, a root by its history number); what is left is docs/architecture.md's known gaps. A step's WAIT, read
after its reply, never sends it again (`store/base.py`'s `read_wait`).

A connection to the master is checked to be one (`ROLE`) before its first command:
right after a switch a sentinel may still name the old master, now a replica, and
a transaction that met its READONLY would otherwise try again at once, on the
same stale answer, until its attempts ran out. A master that refuses a write for
lack of replicas (`NOREPLICAS`, its `min-replicas-to-write`: the old master of a
switch once its replicas follow the new one) is left the same way as one that
answers READONLY: the command is sent again, to the master the sentinels name
(docs/deploy.md, "A planned switch").

TLS under Sentinel, which has no URL to carry it, comes from the SUBQ_REDIS_TLS
settings (`tls_options`): the same options for subq's clients, for Celery's
`broker_use_ssl` and `redis_backend_use_ssl` (`celery_tls`), and for the
sentinels themselves (`sentinel_kwargs`).

SUBQ_REDIS_URL is checked here before any client reads it (`redis_url`): redis-py's
own errors for a malformed URL quote the part they could not read, which for a
password holding `/`, `?` or `#` is a piece of the password, and a password
holding `#` or `?` made redis-py connect to localhost without a word. A Redis
reached without a password is named by `password_warning`, which a worker logs
at its start (issue 39: a sandboxed command allowed the network wrote to a
Redis that had none).
"""

from __future__ import annotations

import socket
import time
from typing import Any, cast
from urllib.parse import SplitResult, quote, urlsplit

import hiredis
import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import HiredisRespSerializer
from redis.retry import Retry
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.utils import str_if_bytes

from coordinator.errors import ConfigError
from coordinator.settings import Settings
from coordinator.text import ascii_digits

__all__ = [
    "FAILOVER_RETRIES",
    "ROLE_CHECK_INTERVAL_S",
    "SENTINEL_ASK_TIMEOUT_S",
    "SENTINEL_CONNECT_TIMEOUT_S",
    "BlockingSentinelConnectionPool",
    "FollowingConnection",
    "FollowingSSLConnection",
    "LeanPacker",
    "Sentinels",
    "celery_tls",
    "celery_url",
    "describe",
    "failover_retry",
    "password_warning",
    "redis_client",
    "redis_url",
    "sentinel_transport_options",
    "tls_options",
]

# A failover takes the sentinels' down-after-milliseconds (5 s in deploy/) plus an election and the
# promotion (a second or two): a command is sent again for about 30 s (0.05 s doubling to 1 s, then
# each second), so a run in flight outlasts a failover, and a Redis that stays gone still fails it.
FAILOVER_RETRIES = 34
FAILOVER_BACKOFF_CAP_S = 1.0
FAILOVER_BACKOFF_BASE_S = 0.05
# ReadOnlyError: a command that reached the old master after it came back as a replica. redis-py's
# sentinel connection already turns the replies it reads itself into a ConnectionError; this covers
# any other path, and each retry reconnects, to the master the sentinels name by then.
FAILOVER_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)
# The error code of a master with fewer good replicas than its min-replicas-to-write (Redis's own words).
NOREPLICAS = "NOREPLICAS "
# ... and of a replica asked to write (a master the sentinels replaced, once it follows the new one).
READONLY = "READONLY "
# A connection's refusals this far apart are a new streak, whose backoff starts again at the base.
REFUSALS_FORGOTTEN_S = 5.0


def failover_retry() -> Retry:
    """How a command that lost its connection is sent again under Sentinel (one per client: it is theirs)."""
    backoff = ExponentialBackoff(cap=FAILOVER_BACKOFF_CAP_S, base=FAILOVER_BACKOFF_BASE_S)
    return Retry(backoff, FAILOVER_RETRIES, FAILOVER_ERRORS)


# A connection idle this long asks its server's ROLE before its next command (FollowingConnection.check_health):
# after a switch, idle pooled connections still lead to the old master; one busy is seldom idle, and pays nothing.
ROLE_CHECK_INTERVAL_S = 1.0
# A new connection to a master whose machine died waits this long before the next try.
SENTINEL_CONNECT_TIMEOUT_S = 5.0
# A sentinel on the same network answers in a millisecond; one silent this long is passed over.
SENTINEL_ASK_TIMEOUT_S = 1.0
# A master whose machine died does not close its sockets. No read timeout finds it, since `wait` and
# the live views block on XREAD for as long as they were asked to; TCP keepalive probes do: silent
# for 5 s, then 3 probes 2 s apart, and the connection fails over about 11 s after the machine died.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """The sentinel-managed pool, which makes a thread wait for a free connection (a worker's pool)."""


class FollowingConnection(SentinelManagedConnection):
    """redis-py's sentinel-managed connection, which asks the sentinels where the master is on every reconnect,
    takes only a master, and leaves one that refuses writes for lack of replicas.

    redis-py asks them only in `connect()`, which a pool calls for a new connection. A
    command whose connection was lost is sent again on the same connection, which
    reconnects through `connect_check_health` to the address it had: the dead master,
    refused until the command's retries run out (redis-py issue 3874, open in 8.1).
    Here that reconnect goes through `connect()` as well.

    The server they name must answer `ROLE` as a master: a sentinel that has not yet heard
    of a switch names the old master, already a replica (seen in tests/test_sentinel.py's
    planned switch: a transaction met READONLY on each of its 50 attempts within a few
    milliseconds, and its caller was told of a conflict). Refused, the connect is tried again
    with the failover backoff, asking the sentinels each time. A master's `NOREPLICAS`
    (fewer replicas than its `min-replicas-to-write`) is a ConnectionError, as redis-py makes
    of READONLY: nothing of the command was written, so it is sent again, after a reconnect
    that asks the sentinels. So is a script's READONLY, which redis-py misses on Redis 6.2
    (wrapped in "Error running script"; seen as a submit's error right after a planned switch).
    """

    _asking_sentinels = False

    def connect(self) -> None:
        self._asking_sentinels = True  # connect() ends in connect_check_health, to the address they gave
        try:
            # (pyproject.toml's untyped_calls_exclude does not reach a call through super(): its own ignore)
            super().connect()  # type: ignore[no-untyped-call, unused-ignore]
        finally:
            self._asking_sentinels = False

    def _connect_retry(self) -> None:
        """One try of `connect()` (redis-py retries it with the connection's backoff): the named master, if it is one."""
        if self._sock is not None:
            return
        super()._connect_retry()  # type: ignore[no-untyped-call, unused-ignore]  # (as in connect above)
        if self.connection_pool.is_master and not self._is_master():
            where = f"{self.host}:{self.port}"
            self.disconnect()
            raise redis.ConnectionError(f"the sentinels named {where} the master, and it is a replica now")

    def check_health(self) -> None:
        """Before a command on a connection idle for `health_check_interval`: its server still a master (ROLE).

        Each process's pool keeps connections to the old master across a switch, and a script
        sent there first meets NOSCRIPT, is loaded there, then meets READONLY, and the new master
        answers NOSCRIPT again: the step failed ("the master forgot the script"). Not redis-py's
        PING with its own retry, which would reconnect in the middle of a WATCH and lose it:
        a ConnectionError here is the command's, and a watched transaction starts again.
        """
        if not (self.health_check_interval and time.monotonic() > self.next_health_check):
            return
        if self.connection_pool.is_master and not self._is_master():
            where = f"{self.host}:{self.port}"
            self.disconnect()
            raise redis.ConnectionError(f"{where}, named the master, is a replica now")

    def _is_master(self) -> bool:
        self.send_command("ROLE", check_health=False)
        role = self.read_response()
        return bool(role) and str_if_bytes(role[0]) == "master"

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            refused = self.refusal(exc)
            if refused is None:
                raise
            raise refused from exc

    def refusal(self, exc: redis.ResponseError) -> redis.ConnectionError | None:
        """The connection error to raise for `exc`, a master's refusal that a failover explains (READONLY, NOREPLICAS),
        this connection closed (and, for NOREPLICAS, backed off) so the retry sends the command again where the
        sentinels say; None for any other error. Also for an error nested in EXEC's reply (a transaction's
        script), which never passes through `read_response` (`store/base.py`'s `_exchange`)."""
        if not self.connection_pool.is_master:
            return None
        where = f"{self.host}:{self.port}"
        if _refused(exc, READONLY):
            # redis-py's own conversion misses a script's: Redis 6.2 wraps it in ERR ("Error running script").
            self.disconnect()
            return redis.ConnectionError(f"{where}, named the master, is a replica now")
        if not _refused(exc, NOREPLICAS):
            return None
        self.disconnect()
        self._back_off()
        return redis.ConnectionError(
            f"the master {where} refuses writes: fewer replicas than its min-replicas-to-write"
        )

    _refusals = 0
    _refused_until = 0.0

    def _back_off(self) -> None:
        """Wait before the refused command is sent again: the failover backoff, over this connection's refusals.

        A transaction's command is not retried by the connection: redis-py makes its ConnectionError a
        WatchError, and the store's transaction tries again at once; without this pause its attempts
        would all be spent in the moment between a switch and the sentinels naming the new master.
        """
        now = time.monotonic()
        if now - self._refused_until > REFUSALS_FORGOTTEN_S:
            self._refusals = 0
        delay_s = min(FAILOVER_BACKOFF_CAP_S, FAILOVER_BACKOFF_BASE_S * 2**self._refusals)
        self._refusals += 1
        self._refused_until = now + delay_s
        time.sleep(delay_s)

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._asking_sentinels or self._sock is not None:
            super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
            return
        # A connection closed under a command reconnects as the command is sent again: one try, asking the
        # sentinels, since the command's own retry is the loop. `connect()` retried too: 35 tries inside each of
        # the command's 35, and a command through an outage failed after 19 minutes of backoff, not 30 s.
        self._asking_sentinels = True
        try:
            self._connect_retry()
        finally:
            self._asking_sentinels = False


def _refused(exc: redis.ResponseError, code: str) -> bool:
    """Redis's error `code`, alone (a command, a transaction's) or inside a script's error (6.2 wraps it in ERR)."""
    message = str(exc)
    return message.startswith(code) or f"-{code}" in message


class FollowingSSLConnection(FollowingConnection, SentinelManagedSSLConnection):
    """`FollowingConnection` over TLS."""


class Sentinels(Sentinel):
    """redis-py's Sentinel, whose "no master" error says why in words a user can act on.

    redis-py's own lists each sentinel client's repr, and not the cause (a refused
    connection, a certificate that failed verification): each sentinel is asked once more
    for it, on this path only.
    """

    def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return cast(tuple[str, int], super().discover_master(service_name))
        except MasterNotFoundError:
            raise MasterNotFoundError(self._why_no_master(service_name)) from None

    def _why_no_master(self, service_name: str) -> str:
        silent = []
        for sentinel in self.sentinels:
            kwargs = sentinel.connection_pool.connection_kwargs
            try:
                sentinel.ping()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                silent.append(f"{_bracketed(str(kwargs.get('host')))}:{kwargs.get('port')}: {exc}")
        if len(silent) == len(self.sentinels):
            return "no sentinel of SUBQ_REDIS_SENTINELS answers: " + "; ".join(silent)
        return (
            f"the sentinels name no master {service_name!r} that is up: a failover under way, "
            "or not the name of SUBQ_REDIS_SENTINEL_MASTER"
        )


class LeanPacker(HiredisRespSerializer):
    """redis-py's hiredis packing of a command, without its Python pass over every argument.

    redis-py splits a command's name at its spaces, then copies each argument through a
    generator that makes a bytearray bytes, before hiredis packs the command: nearly a third
    of the Python calls of a width-1000 delegation's commit were that pass (docs/benchmarks.md).
    hiredis packs str, bytes, int, float and memoryview itself, into the same bytes; a name with
    a space, or an argument it refuses (a bytearray, or what redis-py rejects too), goes
    redis-py's way, with its error.
    """

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if isinstance(name, str) and " " not in name:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return cast(list[bytes], super().pack(*args))


# One for every client: the packer keeps no state. Built without redis-py's fallback and
# encoder (its own packer takes them from redis 8.2 on): an argument hiredis refuses goes
# redis-py's plain way, as before 8.2.
LEAN_PACKER = LeanPacker()


def redis_client(
    settings: Settings,
    *,
    decode_responses: bool = True,
    max_connections: int | None = None,
    pool_timeout_s: float | None = None,
    **options: Any,
) -> redis.Redis:
    """A client of subq's Redis: the one URL's, or the master's the sentinels name.

    `pool_timeout_s` gives a blocking pool of `max_connections` (a thread waits that long
    for a free connection, as a worker's pool threads do); `options` are redis-py's
    connection options (timeouts, `retry`), which win over this module's defaults.
    """
    settings.require_redis()
    options = {"command_packer": LEAN_PACKER, **options}
    pool_options: dict[str, Any] = {}
    if max_connections is not None:
        pool_options["max_connections"] = max_connections
    if settings.redis_sentinels is None:
        url = redis_url(settings)
        if pool_timeout_s is None:
            return redis.Redis.from_url(url, decode_responses=decode_responses, **pool_options, **options)
        pool = redis.BlockingConnectionPool.from_url(
            url, decode_responses=decode_responses, timeout=pool_timeout_s, **pool_options, **options
        )
        return redis.Redis(connection_pool=pool)
    if pool_timeout_s is not None:
        pool_options.update(connection_pool_class=BlockingSentinelConnectionPool, timeout=pool_timeout_s)
    data = {
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "socket_keepalive_options": _keepalive_options(),
        "retry": failover_retry(),
        "health_check_interval": ROLE_CHECK_INTERVAL_S,
        **options,
    }
    if settings.redis_password is not None:
        data["password"] = settings.redis_password.get_secret_value()
    data["connection_class"] = FollowingSSLConnection if settings.redis_tls else FollowingConnection
    if settings.redis_tls:
        data.update(tls_options(settings))
    sentinels = settings.sentinel_addresses()
    sentinel = Sentinels(sentinels, sentinel_kwargs=_sentinel_kwargs(settings, data))
    master = settings.redis_sentinel_master
    assert master is not None  # Settings requires it with the sentinels
    client = sentinel.master_for(master, decode_responses=decode_responses, **pool_options, **data)
    return cast(redis.Redis, client)


# How long a worker's start waits for its Redis to answer the credentials check (`credentials_refused`).
CREDENTIALS_CHECK_S = 5.0
# The schemes of one Redis's URL that name a host (unix:// names a socket's path).
HOST_SCHEMES = ("redis", "rediss")
# What an operator can do about a password that broke the URL apart.
QUOTE_HINT = (
    "percent-encode each character of the password but letters, digits and -._~ (urllib.parse.quote(password, safe=''))"
)


def redis_url(settings: Settings) -> str:
    """SUBQ_REDIS_URL, checked (`check_redis_url`); a ConfigError without it, or under Sentinel."""
    url = settings.require_redis_url()
    check_redis_url(url)
    return url


def check_redis_url(url: str) -> None:
    """A ConfigError naming what is wrong with a redis://, rediss:// or unix:// URL, and never quoting its password:
    another scheme, or none, is refused here (kombu's worker met one with a traceback: no such transport).

    A unix:// URL's path is left to redis-py, whose errors for it quote nothing of the URL.
    """
    parts = urlsplit(url)
    where = "Invalid setting SUBQ_REDIS_URL"
    if parts.scheme not in (*HOST_SCHEMES, "unix"):
        raise ConfigError(
            f"{where}: Redis URL must specify one of the following schemes (redis://, rediss://, unix://)",
            field="SUBQ_REDIS_URL",
        )
    if parts.scheme not in HOST_SCHEMES:
        return
    rest = f"{parts.path}?{parts.query}#{parts.fragment}"
    if parts.fragment or ("@" in rest and "@" not in parts.netloc):
        # A `#`, `?` or `/` in the password ends the host part early: what follows it, the
        # host included, became a fragment, a query or a path.
        raise ConfigError(
            f"{where}: its password holds a '/', '?' or '#', which ends the host part early; {QUOTE_HINT}",
            field="SUBQ_REDIS_URL",
        )
    if not parts.hostname:
        raise ConfigError(f"{where}: no host after the '//'", field="SUBQ_REDIS_URL")
    if not _port_ok(parts):
        raise ConfigError(
            f"{where}: its port is not a number from 1 to 65535; if the password holds ':' or '@', {QUOTE_HINT}",
            field="SUBQ_REDIS_URL",
        )
    if parts.path not in ("", "/") and not ascii_digits(parts.path[1:]):
        raise ConfigError(f"{where}: the database after the host must be a number, as in /0", field="SUBQ_REDIS_URL")


def _port_ok(parts: SplitResult) -> bool:
    try:
        port = parts.port
    except ValueError:  # its message quotes what followed the ':'
        return False
    return port is None or port > 0


def password_warning(settings: Settings) -> str | None:
    """One line when subq's Redis is reached without a password (else None): a worker logs it at its start.

    Without one, any process that can open a connection to Redis (a local user, a sandboxed
    command allowed the network) can read and change every task. A unix socket is no
    exception for a local user (the sandbox hides a `unix://` Redis's socket from commands).
    """
    if settings.redis_sentinels is not None:
        if settings.redis_password is not None and settings.redis_password.get_secret_value():
            return None
        given = "SUBQ_REDIS_PASSWORD is not set"
    else:
        url = redis_url(settings)
        if _url_password(url):
            return None
        given = f"SUBQ_REDIS_URL ({describe(settings)}) carries no password"
    return (
        f"{given}: anything that can connect to that Redis, a sandboxed command allowed the network "
        'included, can read and change every task (docs/deploy.md, "Redis\'s password")'
    )


def credentials_refused(settings: Settings) -> str | None:
    """What subq's Redis said when it refused these settings' credentials (a wrong password, a password it wants
    and was not given, an ACL user it does not know), as one line; None when it took them or was not reached.

    A worker asks once at its start: a refusal is no outage to wait out, and Celery would try its broker again
    forever, one log line a try, running nothing. A Redis out of reach (down, or no sentinel answering) is the
    outage the worker waits out, so it says nothing here.
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis_client(
        settings,
        retry=Retry(NoBackoff(), 0),
        socket_connect_timeout=CREDENTIALS_CHECK_S,
        socket_timeout=CREDENTIALS_CHECK_S,
    )
    try:
        client.ping()
    except redis.AuthenticationError as exc:  # WRONGPASS, NOAUTH (a ConnectionError to redis-py: before those)
        return f"subq's Redis ({describe(settings)}) refused its credentials: {exc}"
    except (redis.RedisError, OSError):
        return None  # out of reach (the outage the worker waits out), or it answered: the credentials were taken
    finally:
        client.close()
    return None


def _url_password(url: str) -> str | None:
    """The password redis-py sends for `url`: in its user part, or its `?password=` query."""
    try:
        password = redis.connection.parse_url(url).get("password")
    except ValueError:  # a URL redis-py cannot read: the client made from it says so
        return None
    return str(password) if password else None


def _keepalive_options() -> dict[int, int]:
    """TCP keepalive timings where the platform has them (Linux does; others keep their defaults)."""
    wanted = {"TCP_KEEPIDLE": KEEPALIVE_IDLE_S, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL_S, "TCP_KEEPCNT": KEEPALIVE_PROBES}
    return {getattr(socket, name): value for name, value in wanted.items() if hasattr(socket, name)}


def _sentinel_kwargs(settings: Settings, data: dict[str, Any]) -> dict[str, Any]:
    """How a client talks to the sentinels themselves: their password, short timeouts, no retry of its own.

    A sentinel that does not answer at once is skipped for the next one (redis-py then asks the
    one that answered first); redis-py's default would try a dead one four times, seconds each.
    """
    own = {name: value for name, value in data.items() if name.startswith("socket_")}
    own["socket_connect_timeout"] = min(
        own.get("socket_connect_timeout", SENTINEL_ASK_TIMEOUT_S), SENTINEL_ASK_TIMEOUT_S
    )
    own["socket_timeout"] = min(own.get("socket_timeout") or SENTINEL_ASK_TIMEOUT_S, SENTINEL_ASK_TIMEOUT_S)
    own["retry"] = Retry(NoBackoff(), 0)
    return {**own, **_sentinel_auth(settings)}


def _sentinel_auth(settings: Settings) -> dict[str, Any]:
    """The sentinels' own password and TLS, as redis-py's, kombu's and Celery's `sentinel_kwargs`."""
    auth: dict[str, Any] = {}
    if settings.redis_sentinel_password is not None:
        auth["password"] = settings.redis_sentinel_password.get_secret_value()
    if settings.sentinels_over_tls:
        auth.update(ssl=True, **tls_options(settings))
    return auth


def tls_options(settings: Settings) -> dict[str, Any]:
    """redis-py's TLS options from the SUBQ_REDIS_TLS_* files: the certificate always verified, host name included.

    The host name checked is the address a sentinel gives for the master (its IP, or its host
    name where the nodes announce one), so the nodes' certificates must name that address.
    """
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    files = {
        "ssl_ca_certs": settings.redis_tls_ca_file,
        "ssl_certfile": settings.redis_tls_cert_file,
        "ssl_keyfile": settings.redis_tls_key_file,
    }
    options.update({name: str(path) for name, path in files.items() if path is not None})
    return options


def celery_tls(settings: Settings) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` and `redis_backend_use_ssl` under Sentinel with SUBQ_REDIS_TLS; else None.

    With one Redis, TLS stays in the URL (rediss://), as kombu and Celery read it there.
    """
    return tls_options(settings) if settings.redis_sentinels is not None and settings.redis_tls else None


def celery_url(settings: Settings) -> str:
    """Celery's broker and result backend URL: the one Redis's, or
    `sentinel://[:password@]host:port;sentinel://[:password@]host:port;...`.

    The data password is in every address: kombu moves to the next address when a
    sentinel fails and takes that address's password, so one given only in the first
    was lost there (its master connection then failed `HELLO`/AUTH until it cycled back).
    """
    settings.require_redis()
    if settings.redis_sentinels is None:
        return redis_url(settings)
    auth = ""
    if settings.redis_password is not None:
        auth = f":{quote(settings.redis_password.get_secret_value(), safe='')}@"
    parts = []
    for host, port in settings.sentinel_addresses():
        parts.append(f"sentinel://{auth}{_bracketed(host)}:{port}")
    return ";".join(parts)


def sentinel_transport_options(settings: Settings) -> dict[str, Any]:
    """What kombu's and Celery's sentinel transports need beside the URL; nothing with one Redis."""
    if settings.redis_sentinels is None:
        return {}
    # The sentinels asked as subq's own clients ask them: a silent one is passed over at once.
    return {"master_name": settings.redis_sentinel_master, "sentinel_kwargs": _sentinel_kwargs(settings, {})}


def describe(settings: Settings) -> str:
    """Where subq's Redis is, without a password: for banners and log lines."""
    if settings.redis_sentinels is None:
        url = settings.redis_url or ""
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url
    addresses = ",".join(f"{_bracketed(host)}:{port}" for host, port in settings.sentinel_addresses())
    tls = " (TLS)" if settings.redis_tls else ""
    return f"master {settings.redis_sentinel_master!r}{tls} of the sentinels {addresses}"


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as a URL and host:port write it."""
    return f"[{host}]" if ":" in host else host

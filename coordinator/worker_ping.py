"""`python -m coordinator.worker_ping celery@<host>`: Celery's ping to one worker node, on subq's broker.

The workers' health check (deploy/kubernetes/base/worker.yaml's startup and liveness
probes, docker-compose.yml's and deploy/docker-compose.sentinel.yml's healthchecks):
it exits 0 once the node answers `pong`, and 1 with one line on stderr saying why
when it does not (no answer in time, a broker it cannot reach, a setting that is
wrong); 2 when what it was given is no node name (`celery@` alone: HOSTNAME unset).

The broker is the workers' own, built from the same `SUBQ_` settings by the same
functions (`celery_url`, `sentinel_transport_options`, `celery_tls`): one Redis
(`SUBQ_REDIS_URL`) or the master Redis Sentinel names (`SUBQ_REDIS_SENTINELS` +
`SUBQ_REDIS_SENTINEL_MASTER`), TLS and passwords included. `celery inspect ping`
with `BROKER_URL="$SUBQ_REDIS_URL"` knew only the first: under Sentinel the URL is
unset, Celery fell back to its default broker and the probe failed (exit 69) on a
healthy worker. `celery -A workers.app inspect ping` knows both, but imports the
execution plane (pydantic-ai and every tool), seconds of CPU a check on a busy
host. This builds a bare Celery app with the broker alone: no result backend, no
tracing, no task module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordinator.errors import BrokerError, SubqError

if TYPE_CHECKING:
    from coordinator.settings import Settings

__all__ = ["CONNECT_TIMEOUT_S", "PING_TIMEOUT_S", "main", "ping"]

# How long the node has to answer: a worker's consumer answers a ping between two messages, at
# once when idle, and the probes give the whole command 20 s (worker.yaml's timeoutSeconds).
PING_TIMEOUT_S = 5.0
# How long connecting to the broker is tried (a sentinel or Redis refusing, a failover under way)
# before the check fails: the next check tries again, and the probes fail the pod only after 3.
CONNECT_TIMEOUT_S = 5.0
CONNECT_INTERVAL_S = 0.5
# The reason a failure gives, cut to this: a probe's message lands in the pod's events.
MAX_REASON_CHARS = 300
# What a live worker answers (Celery's `ping` control command).
PONG = {"ok": "pong"}
# A node name as Celery's `-n` makes it: name@host.
NODE_SEPARATOR = "@"


def ping(settings: Settings, node: str, timeout_s: float = PING_TIMEOUT_S) -> Any:
    """Send Celery's ping to `node` alone on subq's broker: its answer (`{"ok": "pong"}`), or None if silent.

    Waits at most `timeout_s` for the answer, and returns as soon as it comes. A broker
    that cannot be reached within CONNECT_TIMEOUT_S is a `BrokerError` saying why.
    """
    import redis
    from celery import Celery
    from kombu.exceptions import OperationalError

    from coordinator.redis_clients import celery_tls, celery_url, describe, sentinel_transport_options

    settings.require_redis()
    app = Celery("subq-worker-ping", broker=celery_url(settings), set_as_current=False)
    app.conf.update(
        broker_transport_options={
            **sentinel_transport_options(settings),
            # kombu's own connect: tried every CONNECT_INTERVAL_S, for CONNECT_TIMEOUT_S in all.
            "max_retries": int(CONNECT_TIMEOUT_S / CONNECT_INTERVAL_S),
            "interval_start": CONNECT_INTERVAL_S,
            "interval_step": 0,
            "interval_max": CONNECT_INTERVAL_S,
            "connect_retries_timeout": CONNECT_TIMEOUT_S,
        },
        broker_connection_timeout=CONNECT_TIMEOUT_S,
    )
    tls = celery_tls(settings)
    if tls is not None:
        app.conf.broker_use_ssl = tls
    try:
        replies = app.control.ping([node], timeout=timeout_s)
    except (OperationalError, redis.RedisError, OSError) as exc:  # kombu's, redis-py's, the socket's
        raise BrokerError(f"the broker ({describe(settings)}) is unreachable: {_why(settings, exc)}") from None
    finally:
        app.close()
    return next((reply[node] for reply in replies if node in reply), None)


def _why(settings: Settings, exc: Exception) -> str:
    """Why the broker could not be reached, in words a user can act on.

    Under Sentinel, kombu's transport says "No master found" followed by the repr of each
    sentinel's client; subq's own client asks the sentinels once more and says why instead
    (none answers, or none names the master: `redis_clients.Sentinels`).
    """
    if settings.redis_sentinels is not None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from coordinator.redis_clients import redis_client

        client = redis_client(settings, retry=Retry(NoBackoff(), 0))  # asked once: the check is failing already
        try:
            client.ping()
        except redis.RedisError as asked:
            return str(asked)[:MAX_REASON_CHARS]
        finally:
            client.close()
    return f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.worker_ping",
        description=(
            "Ping one subq worker node through subq's broker (SUBQ_REDIS_URL, or SUBQ_REDIS_SENTINELS with "
            "SUBQ_REDIS_SENTINEL_MASTER): exit 0 when it answers, 1 with one line on stderr when it does not."
        ),
    )
    parser.add_argument("node", help="the worker's Celery node name, e.g. celery@$HOSTNAME (a pod's own)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=PING_TIMEOUT_S,
        help=f"seconds to wait for the answer (default {PING_TIMEOUT_S:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check on `argv` (default: the command line); the exit status."""
    args = _parser().parse_args(argv)
    node: str = args.node
    name, separator, host = node.partition(NODE_SEPARATOR)
    if not (name and separator and host):
        # `celery@` alone: $HOSTNAME was empty where the command ran.
        print(f"worker ping: {node!r} is not a Celery node name (name@host, e.g. celery@$HOSTNAME)", file=sys.stderr)
        return 2
    try:
        from coordinator.redis_clients import describe
        from coordinator.settings import load_settings

        settings = load_settings()
        answer = ping(settings, node, args.timeout_s)
    except SubqError as exc:
        return _fails(f"{node}: {exc}")
    if answer is None:
        return _fails(f"{node} did not answer a ping within {args.timeout_s:g} s on the broker ({describe(settings)})")
    if answer != PONG:
        return _fails(f"{node} answered the ping with {answer!r}, not pong")
    print(f"{node}: pong")
    return 0


def _fails(why: str) -> int:
    """The check's one line on stderr, and its exit status."""
    print(f"worker ping: {' '.join(why.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

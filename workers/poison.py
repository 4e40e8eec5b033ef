"""The worker's consumer boundary: a message no worker can decode or validate is dead-lettered, not run.

`make_app` names `PoisonSafeConsumer` as Celery's `worker_consumer`, so only a
worker loads this module; the coordinator plane publishes and never consumes.
Two layers, each where its kind of message first fails:

- kombu's Redis channel (`DeadLetterChannel`, installed on the consumer's own
  broker connection): a list entry that is not UTF-8 JSON, or not a kombu
  message (no `properties`, no `delivery_tag`, a body its `body_encoding` does
  not decode, no `delivery_info`). kombu lets these errors reach the event loop,
  which ends the worker, or (a KeyError) "reconnects", losing the entry.
- Celery's task-message handler (`PoisonSafeConsumer.create_task_handler` and
  Celery's own failure callbacks): a message kombu can read but Celery cannot
  turn into a request (a body that is not [args, kwargs, embed], no `id`
  header, a `timelimit` that is not [hard, soft] seconds, an unknown task
  name, an undecodable or refused body). Celery ends the worker on most of
  these, and the message, restored at shutdown, ends the next one too.

Each is written to the dead-letter list with the reason (`coordinator/deadletters.py`),
then acknowledged, so it is never delivered again, and the consumer goes on. A message
that comes back all the same (its worker died between the two) is kept on the list once. A
valid message costs one try/except and two shape checks (`precheck`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import redis
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Message as KombuMessage
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from vine import promise

from coordinator import Coordinator, Settings, StoreError, dead_letter, load_settings, message_digest
from coordinator.celery_app import FollowingSentinelChannel
from workers.run_acks import RunQoS

__all__ = ["DeadLetterChannel", "DeadLetters", "PoisonSafeConsumer", "UnreadableMessage", "task_problem"]

log = logging.getLogger(__name__)

# How much of an exception's text or a header's value a reason quotes.
QUOTE_CHARS = 200
# A raw message that could not even be dead-lettered is logged, this much of it.
LOG_MESSAGE_CHARS = 4096
# When Redis refuses the dead letter, the consumer reconnects and reads the message again:
# this pause keeps that from spinning while Redis refuses writes.
DEAD_LETTER_RETRY_S = 1.0


class DeadLetters:
    """Where the boundary puts what it cannot run: the dead-letter list, through the Coordinator.

    The Coordinator (and its Redis client) is built on first use: a healthy worker never needs it.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._coord: Coordinator | None = None

    def bury(
        self,
        queue: str,
        reason: str,
        raw: str | bytes,
        *,
        task: object = None,
        task_id: object = None,
        identity: str | None = None,
    ) -> None:
        """Keep the message on the dead-letter list, once (`identity`, `_identity`: its delivery tag, task id and
        body; else its raw text), or raise ConnectionError if Redis refuses it.

        ConnectionError is one of kombu's connection errors: the consumer reconnects, and a
        message kombu had already handed over is restored to its queue rather than lost.
        """
        entry = dead_letter(queue, reason, raw, task=task, task_id=task_id)
        log.error("subq: dead-lettered a message from queue %s (task %s, id %s): %s", queue, entry.task,
                  entry.id, entry.reason)  # fmt: skip
        if self._coord is None:
            self._coord = Coordinator(self.settings)
        try:
            if not self._coord.record_dead_letter(entry, message_digest(raw if identity is None else identity)):
                log.info("subq: that message was on the dead-letter list already: kept once")
        except StoreError as exc:
            log.error("subq: the dead letter could not be kept (%s); the message: %s", exc,
                      entry.message[:LOG_MESSAGE_CHARS])  # fmt: skip
            time.sleep(DEAD_LETTER_RETRY_S)
            raise ConnectionError(f"the dead-letter list could not be written: {exc}") from exc


class UnreadableMessage(ValueError):
    """A list entry that is JSON but not a message kombu can deliver."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CheckedMessage(KombuMessage):
    """kombu's message, whose construction failing raises UnreadableMessage with the reason.

    It also checks what kombu's QoS.append indexes next (the delivery info's exchange and
    routing key, a scalar delivery tag): a KeyError there reaches Celery as a lost connection.
    """

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise UnreadableMessage(f"the queue entry is not a kombu message: {_why(exc)}") from exc
        info, tag = self.delivery_info, self.delivery_tag
        if not isinstance(info, dict) or "exchange" not in info or "routing_key" not in info:
            raise UnreadableMessage("the queue entry is not a kombu message: no delivery_info exchange and routing_key")
        if not isinstance(tag, (str, int)) or isinstance(tag, bool):
            raise UnreadableMessage(f"the queue entry is not a kombu message: delivery_tag {_quote(tag)}")


# -- one broker client per pool ------------------------------------------------------------
# One redis-py client per connection pool for kombu's Redis channel, where kombu builds one per call.
#
# kombu's Redis channel builds a new redis-py client for each ack, each message's
# prefetch bookkeeping and each event publish: about 0.1 ms of CPU each, several
# per task, in the worker's consumer thread. A client is thread-safe (each command
# takes a connection from the pool, a pipeline is an object of its own), so one
# per pool does: a reconnect makes a new pool, and with it a new client.


class OneClientPerPool:
    """Mixed in before kombu's Redis `Channel`: its synchronous client, built once per pool."""

    pool: Any

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's own BRPOP and pub/sub client: kombu builds it once already
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        pool = self.pool
        client = self.__dict__.get("_subq_client")
        if client is None or client.connection_pool is not pool:
            client = super()._create_client()  # type: ignore[misc]
            self.__dict__["_subq_client"] = client
        return client


class DeadLetterChannel(OneClientPerPool, kombu_redis.Channel):
    """kombu's Redis channel, which dead-letters a list entry it cannot turn into a message, and holds a run
    message's delivery in memory, not in kombu's unacked hash (`RunQoS`, workers/run_acks.py)."""

    Message = CheckedMessage
    QoS = RunQoS
    # The queue whose entry is being delivered, for a dead letter written by the Celery layer.
    reading_queue: str | None = None

    def close(self) -> None:
        """kombu's close, minus the crash that a Redis restart turns it into.

        After the broker's socket is lost, kombu's close restores the unacked messages
        through a connection pool it has just torn down, and fails on its missing
        connection info (AttributeError); Celery counts that as unrecoverable and the
        worker exits, so one Redis restart stopped the whole fleet. The messages other than
        runs stay in kombu's unacked hash (the visibility backstop restores them); a run
        message the restore could not push back from memory is lost with the connection, and
        the reconciler publishes its run again. The consumer reconnects.
        """
        try:
            super().close()  # type: ignore[no-untyped-call]
        except AttributeError as exc:
            log.warning("subq: the broker connection was already gone at close (%s); reconnecting", exc)

    def _connparams(self, asynchronous: bool = False) -> Any:
        """kombu's, but a lost connection for a channel whose connection is gone.

        An ack or reject of a message delivered before a Redis restart reaches a channel
        that the reconnect has closed, whose connection info is gone: kombu fails with an
        AttributeError, which stopped the worker's consumer for good (its tasks then sat
        in the queue). As a connection error it is logged and the consumer goes on; the
        message stays unacked, is restored and delivered again, and its task, already
        done, changes nothing. (A run message's ack touches no Redis, workers/run_acks.py,
        unless the close's restore already took it back: then it comes here too.)
        """
        if self.connection is None or getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker channel was closed by a reconnect")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]

    def _brpop_read(self, **options: Any) -> bool:
        # kombu 5.7's Channel._brpop_read, with the entry's decoding and the message's
        # construction guarded (tests/test_poison.py notices a change to kombu's version).
        # Everything else is kombu's: the reply, the fair cycle, the reconnect on a lost socket.
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            key = bytes_to_str(dest)  # type: ignore[no-untyped-call]
            queue = key.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            try:
                payload = loads(bytes_to_str(item))  # type: ignore[no-untyped-call]
            except Exception as exc:  # not UTF-8, not JSON, a bad kombu type tag, nested too deep
                self._dead_letter(queue, key, f"the queue entry is not JSON: {_why(exc)}", item, None)
                return True
            self.reading_queue = queue
            try:
                self.connection._deliver(payload, queue)
            except UnreadableMessage as exc:
                self._dead_letter(queue, key, exc.reason, item, payload)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu types it bool, and sets None
            self._flush_brpop_reauth()  # type: ignore[no-untyped-call]

    def _dead_letter(self, queue: str, key: str, reason: str, item: bytes | str, payload: Any) -> None:
        headers = payload.get("headers") if isinstance(payload, dict) else None
        task, task_id = (headers.get("task"), headers.get("id")) if isinstance(headers, dict) else (None, None)
        dead_letters: DeadLetters | None = getattr(self.connection, "subq_dead_letters", None)
        if dead_letters is None:  # a consumer other than subq's: say so, and drop what cannot be read
            log.error("subq: dropped an unreadable entry of queue %s (%s): %r", queue, reason,
                      item[:LOG_MESSAGE_CHARS])  # fmt: skip
            return
        try:
            dead_letters.bury(queue, reason, item, task=task, task_id=task_id)
        except ConnectionError:
            # BRPOP took the entry off its list and nothing else holds it: put it back where the
            # next read takes it again (the consumer reconnects first), rather than lose it.
            with self.conn_or_acquire() as client:
                client.rpush(key, item)
            raise


class DeadLetterSentinelChannel(DeadLetterChannel, FollowingSentinelChannel):
    """`DeadLetterChannel` on subq's sentinel transport (SUBQ_REDIS_SENTINELS): the master the sentinels name."""


def install_channel(transport: Any, dead_letters: DeadLetters) -> None:
    """Make `transport` (a connection's own, before it opens a channel) dead-letter unreadable entries."""
    transport.subq_dead_letters = dead_letters
    if issubclass(transport.Channel, DeadLetterChannel):  # installed already (a connection's second look)
        return
    if transport.Channel is kombu_redis.Channel:  # redis:// and rediss://; other brokers keep their own
        transport.Channel = DeadLetterChannel
    elif transport.Channel is FollowingSentinelChannel:  # sentinel:// (coordinator/celery_app.py's transport)
        transport.Channel = DeadLetterSentinelChannel
    else:
        log.warning("subq: %s is not kombu's Redis channel: unreadable list entries are not dead-lettered",
                    transport.Channel)  # fmt: skip


def install_on_connection(conn: Any, dead_letters: DeadLetters) -> None:
    """`install_channel` on `conn`'s transport, and on each one it makes later.

    A connection with several addresses (`sentinel://a;sentinel://b`, SUBQ_REDIS_SENTINELS) that
    fails to connect switches to the next one with a new transport: without this, a consumer
    reconnecting through a Redis failover lost its dead-lettering and its close guard.
    """
    create_transport = conn.create_transport

    def create_installed_transport() -> Any:
        transport = create_transport()
        install_channel(transport, dead_letters)
        return transport

    conn.create_transport = create_installed_transport
    install_channel(conn.transport, dead_letters)


class PoisonSafeConsumer(Consumer):  # type: ignore[misc]  # Celery ships no type hints
    """Celery's worker consumer, which dead-letters a task message it cannot run instead of dying on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = getattr(self.app, "subq_settings", None)
        self.dead_letters = DeadLetters(settings if isinstance(settings, Settings) else load_settings())

    def connection_for_read(self, heartbeat: float | None = None) -> Any:
        # Celery's, with the channel installed before ensure_connected opens the first one.
        conn = self.app.connection_for_read(heartbeat=heartbeat)
        install_on_connection(conn, self.dead_letters)
        return self.ensure_connected(conn)

    def connection_for_write(self, url: str | None = None, heartbeat: float | None = None) -> Any:
        # Celery's (the task events' connection), with subq's channel: it publishes with one client.
        conn = self.app.connection_for_write(url=url, heartbeat=heartbeat)
        install_on_connection(conn, self.dead_letters)
        return self.ensure_connected(conn)

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], None]:
        handle = super().create_task_handler(promise)
        # A real broker failure must still reach Celery (it reconnects and restores the message);
        # kombu's Redis transport counts KeyError as one, but here a KeyError is a missing header.
        broker_errors = tuple(e for e in self.connection_errors if not issubclass(e, KeyError))

        def on_task_received(message: Any) -> None:
            problem = precheck(message)
            if problem is not None:
                return self.reject_poison(message, problem)
            try:
                handle(message)
            except broker_errors:
                raise
            except Exception as exc:
                if message.acknowledged:  # Celery had dealt with the message before it failed
                    log.exception("subq: a task message failed after it was handled")
                    return None
                self.reject_poison(message, task_problem(message) or f"Celery could not accept it: {_why(exc)}")
            return None

        return on_task_received

    def reject_poison(self, message: Any, reason: str) -> None:
        """Dead-letter the message, forget any request Celery made of it, and take it off the queue."""
        headers = message.headers if isinstance(message.headers, dict) else {}
        task_id = headers.get("id")
        self.dead_letters.bury(_queue_of(message), reason, _raw_text(message), task=headers.get("task"),
                               task_id=task_id, identity=_identity(message))  # fmt: skip
        if isinstance(task_id, str):
            self._forget_request(task_id, message)
        if not message.acknowledged:
            message.reject_log_error(log, self.connection_errors, requeue=False)

    def _forget_request(self, task_id: str, message: Any) -> None:
        """A request Celery reserved before failing would show as reserved forever (`inspect reserved`)."""
        request = worker_state.requests.get(task_id)
        if request is None or request.message is not message:
            return
        worker_state.task_ready(request)
        if self.event_dispatcher is not None and self.event_dispatcher.enabled:
            try:  # Flower saw it received: show it rejected, not pending forever
                self.event_dispatcher.send("task-rejected", uuid=task_id, requeue=False)
            except Exception as exc:  # monitoring must not stop the consumer
                log.warning("subq: could not send a task-rejected event: %s", exc)

    # -- Celery's own failure callbacks: each also keeps the message on the dead-letter list --

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self.reject_poison(message, "not a Celery task message: no 'task' header, and the body is not one either")

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        name = headers.get("task")
        self.dead_letters.bury(_queue_of(message), f"unknown task name {_quote(name)}: no worker registers it",
                               _raw_text(message), task=name, task_id=headers.get("id"),
                               identity=_identity(message))  # fmt: skip
        if isinstance(headers.get("id"), str):  # Celery marks its result failed (NotRegistered) and rejects it
            super().on_unknown_task(body, message, exc)
        else:
            message.reject_log_error(log, self.connection_errors, requeue=False)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self.reject_poison(message, f"invalid task message: {_why(exc)}")

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self.reject_poison(message, f"the body cannot be decoded: {_why(exc)}")


# -- why a message cannot be run ------------------------------------------------------------


def precheck(message: Any) -> str | None:
    """The two things Celery accepts and then fails on out of the consumer's sight, checked first.

    A timelimit is read only when the request goes to the pool, after Celery reserved it
    (and, in prefork, took a pool slot). A 3-item body of the wrong shapes (a 3-letter
    string, [1, 2, 3], an embed that is not an object) fails in the pool before the task
    runs, where nothing acknowledges it: the message stays unacknowledged, holding a
    prefetch slot for good (a run message, held in the worker's memory), or until the
    visibility timeout brings it back to do it again (any other). The body
    is decoded here once; kombu caches it for Celery's request.
    """
    return _time_limit_problem(message.headers) or _body_problem(message)


def _time_limit_problem(headers: Any) -> str | None:
    limits = headers.get("timelimit") if isinstance(headers, dict) else None
    if limits is None or (isinstance(limits, (list, tuple)) and len(limits) == 2 and all(map(_seconds, limits))):
        return None
    return f"header 'timelimit' must be [hard, soft] seconds (numbers or null), not {_quote(limits)}"


def _seconds(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0)


def task_problem(message: Any) -> str | None:
    """What makes the message something Celery cannot run, or None if nothing is seen."""
    headers = message.headers
    if not isinstance(headers, dict):
        return f"the headers must be an object, not {_shape(headers)}"
    for name in ("id", "task"):
        if name not in headers:
            return f"header {name!r} is missing"
        if not isinstance(headers[name], str) or not headers[name]:
            return f"header {name!r} must be a non-empty string, not {_quote(headers[name])}"
    try:
        message.decode()  # cached: the same decode Celery's request uses
    except Exception as exc:
        return f"the body cannot be decoded: {_why(exc)}"
    return _body_problem(message)


def _body_problem(message: Any) -> str | None:
    try:
        body = message.payload  # decoded once, and cached by kombu
    except Exception:  # Celery reports it, through on_decode_error or on_invalid_task
        return None
    if isinstance(body, dict):  # Celery's protocol 1, or a hybrid: Celery checks those itself
        return None
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return f"the body must be Celery's [args, kwargs, embed], not {_shape(body)}"
    args, kwargs, embed = body
    if isinstance(args, (list, tuple)) and isinstance(kwargs, dict) and (embed is None or isinstance(embed, dict)):
        return None
    return f"the body must be Celery's [args, kwargs, embed], not [{', '.join(map(_shape, body))}]"


def _shape(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    names = {str: "a string", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _quote(value: Any) -> str:
    return repr(value)[:QUOTE_CHARS]


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:QUOTE_CHARS]


def _queue_of(message: Any) -> str:
    """The queue the message was read from (the channel says), else where it was routed."""
    queue = getattr(message.channel, "reading_queue", None)
    info = message.delivery_info if isinstance(message.delivery_info, dict) else {}
    return str(queue or info.get("routing_key") or "?")


def _identity(message: Any) -> str | None:
    """What the message stays when kombu gives it back (which adds `redelivered` to its text): its delivery tag,
    task id and body, if it has a tag. kombu makes a tag a publish; a producer that pushes copies of one message
    of its own onto the list may give them all one, so the id and the body tell such copies apart."""
    tag = getattr(message, "delivery_tag", None)
    if not isinstance(tag, (str, int)) or isinstance(tag, bool) or tag == "":
        return None
    headers = message.headers if isinstance(message.headers, dict) else {}
    body = getattr(message, "body", None)
    return f"delivery_tag {tag}\nid {headers.get('id')!r}\nbody {body!r}"


def _raw_text(message: Any) -> str:
    """The message as it was on the queue: kombu keeps the decoded entry as `_raw` (virtual transports)."""
    raw = getattr(message, "_raw", None)
    if raw is None:
        raw = {"headers": message.headers, "properties": message.properties, "body": message.body}
    try:
        return str(dumps(raw))  # type: ignore[no-untyped-call]
    except Exception:  # anything kombu decoded is JSON again; this is for a stranger message class
        return repr(raw)

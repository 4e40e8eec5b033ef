"""A run message is acknowledged in the worker's memory, not in kombu's unacked hash.

kombu's Redis transport emulates a broker's acknowledgements: each message it
delivers is written to the `unacked` hash and its index (one MULTI), and each
ack deletes it there (another), so that a message whose worker died is
delivered again once the visibility timeout has passed. For a run message
(`subq.run_task`) subq already does that job itself, sooner and with a fence:
its task is on the due list before the message is sent, a run holds a lease
while it runs, and the reconciler publishes the run again when the message is
in no queue and with no live worker, or when the run's lease lapsed
(docs/architecture.md, "Convergence"). The broker's copy was a second,
7-hour backstop for the same loss, and cost every child two requests to the
Redis server and two pipelines in the worker (docs/benchmarks.md, "A run
message acknowledged in the worker").

So `RunQoS` keeps a run message's delivery in the worker's memory only, as
kombu's Redis transport does with its ack emulation off (`virtual.QoS`):
prefetch counts it, an ack forgets it, and a message put back (a reject with
requeue, and every message still held when the channel closes at a warm
shutdown) is pushed onto its queue again from memory, as kombu would from the
hash. A worker killed outright loses the run messages it held; their tasks are
on the due list, and the reconciler publishes them again. Every other message
(`subq.submit` sent by name by another service, whose task may not exist yet;
an `advance` an older version published) keeps kombu's emulation and its
backstop.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as MemoryQoS

from coordinator.celery_app import RUN_TASK

__all__ = ["RunQoS", "is_run_message"]


def is_run_message(message: Any) -> bool:
    """Whether `message` is a run of subq's (Celery's task name header), whose loss the reconciler repairs."""
    headers = getattr(message, "headers", None)
    return isinstance(headers, dict) and headers.get("task") == RUN_TASK


class RunQoS(kombu_redis.QoS):
    """kombu's Redis QoS, with run messages held in memory only (the module's docstring says why)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # The delivery tags of the run messages held, not in Redis: a set's add and discard are atomic under the
        # GIL, and an ack comes from a pool thread while the consumer thread delivers.
        self._in_memory: set[Any] = set()

    def append(self, message: Any, delivery_tag: Any) -> None:
        if is_run_message(message):
            self._in_memory.add(delivery_tag)
            MemoryQoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
        else:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]

    def ack(self, delivery_tag: Any) -> None:
        if self._claim(delivery_tag):
            MemoryQoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
        else:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if self._claim(delivery_tag):
            if requeue:
                self._put_back(delivery_tag, leftmost=True)
            MemoryQoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # (kombu's reject forgets it so)
        else:
            super().reject(delivery_tag, requeue=requeue)  # type: ignore[no-untyped-call]

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """Put one held message back on its queue: from memory for a run (a warm shutdown's restore of every
        message still held calls this for each), from the unacked hash for any other."""
        if self._claim(tag):
            self._put_back(tag, client=client, leftmost=leftmost)
        else:
            super().restore_by_tag(tag, client=client, leftmost=leftmost)  # type: ignore[no-untyped-call]

    def _claim(self, tag: Any) -> bool:
        """Whether `tag` is a run message held here, taken off the set so that one caller alone puts it back: a
        pool thread's reject and the consumer thread's restore at close may come at once."""
        try:
            self._in_memory.remove(tag)
        except KeyError:
            return False
        return True

    def _put_back(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """Push the claimed run message `tag` back onto its queue. If Redis refuses, the claim is given back, so
        that the restore at the channel's close tries again from memory, as kombu would from its hash."""
        message = self._delivered.get(tag)
        # Acked meanwhile by a pool thread: nothing to put back. (Not atomic with the push, as kombu's WATCH on its
        # hash is: an ack between the two sends a finished run back, whose start then finds it ended.)
        if message is None or tag in self._dirty:
            return
        delivery = message.delivery_info
        try:
            with self.channel.conn_or_acquire(client) as conn:
                # kombu's own restore, given the message it kept in the hash: marked redelivered, onto the
                # queues its exchange and routing key name, at its priority. (It marks the message's own
                # headers here, where kombu marks a copy read back from the hash: this one is not used again.)
                self.channel._do_restore_message(message._raw, delivery["exchange"], delivery["routing_key"],
                                                 conn, leftmost)  # fmt: skip
        except BaseException:
            self._in_memory.add(tag)
            raise

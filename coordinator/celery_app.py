"""The Celery app factory and subq's task names (the contract producers send by name).

Both planes build their app here from the same `Settings`: the coordinator
to publish work by task name, `workers.app` to run it. JSON only; late acks
with prefetch 1 so a task lost with its worker is delivered again; the Redis
visibility timeout above the task time limit so a slow task is not delivered
twice; events on so Flower sees every task.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.redis import RedisBackend

from coordinator.settings import Settings

__all__ = ["ADVANCE", "EXPIRE_APPROVAL", "GATHER", "RUN_TASK", "SUBMIT", "PublishOnlyRedisBackend", "make_app"]

# The task names: the coordinator publishes by these names and never imports `workers`.
RUN_TASK = "subq.run_task"
GATHER = "subq.gather"
ADVANCE = "subq.advance"
EXPIRE_APPROVAL = "subq.expire_approval"
SUBMIT = "subq.submit"


class PublishOnlyRedisBackend(RedisBackend):  # type: ignore[misc]
    """The Redis result backend, minus a subscription per published task.

    Celery's Redis backend subscribes the publisher to every task's result
    channel so that `AsyncResult.get()` can return fast. subq never waits on an
    AsyncResult (no task blocks on another's result; `Coordinator.wait` reads
    subq's own state), so those subscriptions were pure cost: one pub/sub
    channel per child, and errors from their cleanup at interpreter exit.
    Chord joins do not use them (they count results in Redis).
    """

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None

    def on_result_fulfilled(self, result: Any) -> None:
        # Nothing was subscribed, so there is nothing to unsubscribe (this ran from
        # AsyncResult.__del__, reconnecting to Redis at interpreter exit).
        return None


def make_app(settings: Settings) -> Celery:
    redis_url = settings.require_redis_url()
    backend = f"{__name__}:{PublishOnlyRedisBackend.__name__}+{redis_url}"
    app = Celery("subq", broker=redis_url, backend=backend, set_as_current=False)
    transport = {"visibility_timeout": settings.visibility_timeout_s}
    broker_transport = {
        **transport,
        # Sweep for lost tasks every restore_interval_s (throttle 1: each sweep scans).
        "unacked_restore_interval": settings.restore_interval_s,
        "unacked_restore_throttle": 1,
    }
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        # A task whose worker process died is delivered again (bounded: runner counts deliveries).
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=broker_transport,
        result_backend_transport_options=transport,
        task_time_limit=settings.task_time_limit_s,
        task_default_queue=settings.queue,
        task_routes={"subq.*": {"queue": settings.queue}},
        result_expires=settings.result_retention_s,
        result_extended=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        worker_pool=settings.worker_pool,
        worker_concurrency=settings.worker_concurrency,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app

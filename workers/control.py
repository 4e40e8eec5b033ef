"""The worker's answer to Celery's `inspect stats` (Flower's worker page, `celery inspect stats`), fit to send.

Celery's own reply carries the broker connection's `transport_options` as they are. On Sentinel they hold
the sentinels' client options (coordinator/redis_clients.py): a redis-py `Retry`, which no JSON encoder
takes, so the worker logged "Control command error" and answered nothing; and the sentinels' password,
which Celery does not drop as it drops the broker's own. Registering `stats` again replaces Celery's in
the worker's control panel; this module is imported by workers/app.py, before the worker starts.
"""

from __future__ import annotations

from typing import Any

from celery.app.utils import filter_hidden_settings
from celery.utils.saferepr import saferepr
from celery.utils.serialization import jsonify
from celery.worker.control import inspect_command

__all__ = ["shown_options", "stats"]


def shown_options(options: dict[str, Any]) -> Any:
    """Transport options as a reply may show them: secrets masked as `conf` masks them, any object as its repr."""
    return jsonify(filter_hidden_settings(options), unknown_type_filter=saferepr)


def stats(state: Any, **kwargs: Any) -> Any:
    """Request worker statistics/information."""  # Celery's own help line, which `celery inspect --help` shows
    reply = state.consumer.controller.stats()
    broker = reply.get("broker")
    if isinstance(broker, dict) and isinstance(broker.get("transport_options"), dict):
        # A new dict in the reply's own copy of the connection's info: the connection keeps its options.
        broker["transport_options"] = shown_options(broker["transport_options"])
    return reply


# Registered by call, not decorator: Celery's decorators are untyped (mypy --strict).
inspect_command()(stats)

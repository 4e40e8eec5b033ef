"""A plain Celery app, not subq's, for the `on_complete` test: its one task keeps what it was sent.

`celery -A tests.webhook_celery_app worker -Q <WEBHOOK_APP_QUEUE>` with `WEBHOOK_APP_BROKER` (a Redis
URL) set; `tree_done(record)` pushes `{"task_id": <its own id>, "record": record}` onto the Redis list
`WEBHOOK_APP_LIST`. It knows nothing of subq: the callback is sent to it by name.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery

BROKER = os.environ.get("WEBHOOK_APP_BROKER", "redis://127.0.0.1:6379/0")
LIST = os.environ.get("WEBHOOK_APP_LIST", "webhook-app:got")

app = Celery("webhook-app", broker=BROKER)
app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)


@app.task(name="webhookapp.tree_done", bind=True)
def tree_done(self: Any, record: dict[str, Any]) -> None:
    client = redis.Redis.from_url(BROKER)
    client.rpush(LIST, json.dumps({"task_id": self.request.id, "record": record}))
    client.close()

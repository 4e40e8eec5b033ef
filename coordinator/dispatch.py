"""Publishing work by task name: the coordinator never imports `workers`.

A parallel delegation is a chord of `subq.run_task` headers with `subq.gather`
as its callback; a sequential one is a chain of `subq.run_task` steps each
followed by `subq.advance`, its own write-back. The Celery task id of a
child's run is the child's id, so a publish retried after a failure names the
same tasks, and the runner's idempotence makes the second delivery a no-op.
"""

from __future__ import annotations

from celery import Celery, chain, chord
from celery.canvas import Signature

from coordinator.models import Batch, TaskRecord

__all__ = ["RUN_TASK", "GATHER", "ADVANCE", "publish_batch", "run_signature"]

RUN_TASK = "subq.run_task"
GATHER = "subq.gather"
ADVANCE = "subq.advance"
# Flower shows argsrepr; keep it readable and short, never the prompt itself.
DESCRIPTION_REPR_CHARS = 60


def run_signature(app: Celery, task: TaskRecord) -> Signature:
    argsrepr = (
        f"task={task.id} parent={task.parent_id or '-'} todo={task.todo_id or '-'} "
        f"desc={task.description[:DESCRIPTION_REPR_CHARS]!r}"
    )
    return app.signature(RUN_TASK, args=(task.id,), task_id=task.id, immutable=True, argsrepr=argsrepr)


def publish_batch(app: Celery, batch: Batch, children: list[TaskRecord]) -> None:
    runs = [run_signature(app, child) for child in children]
    note = f"batch={batch.id} parent={batch.parent_id} children={len(children)}"
    if batch.mode == "parallel":
        callback = app.signature(GATHER, kwargs={"batch_id": batch.id}, task_id=f"{batch.id}-gather", kwargsrepr=note)
        chord(runs, callback).apply_async()
    else:
        steps: list[Signature] = []
        for index, run in enumerate(runs):
            steps.append(run)
            steps.append(
                app.signature(
                    ADVANCE, kwargs={"batch_id": batch.id}, task_id=f"{batch.id}-step{index}", kwargsrepr=note
                )
            )
        chain(*steps).apply_async()

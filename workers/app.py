"""The worker's Celery app: `celery -A workers.app worker` (or `python -m workers`) starts a subq worker.

It reads the same `SUBQ_` settings as everything else (workers/application.py
builds the app); importing this module also registers the `subq.*` tasks and
the worker's signal handlers on it.

`python -m workers [options]` (what `subq worker` and the local fleet run) is
`celery -A workers.app worker [options]` with Celery's own `worker` command, its
options, defaults and checks, called without the `celery` umbrella command: that
command imports every subcommand of Celery's and each installed plugin's (Flower's
web app, the AMQP shell's prompt toolkit) before it reads its arguments, about 1 s
of CPU of each worker's 3 to 4 s start on 2 cores (issue 43, point 5), none of
which a worker uses.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.loading import loading

# The cyclic collector stays off while the worker's modules load (coordinator/loading.py); the worker
# freezes what is loaded at its start (agent_loop.tune_gc), so later collections skip it.
with loading():
    from workers import control, maintenance, outbound, tasks  # noqa: F401  (registers the subq.* tasks, signals, stats)
    from workers.application import app, settings

__all__ = ["app", "main", "settings"]

# How `python -m workers --help` names itself: the command a user types for it.
PROG_NAME = "subq worker"
# click reads an option's environment variable under this prefix, as under `celery worker`
# (`celery` runs with auto_envvar_prefix CELERY, and click adds the subcommand's name).
ENV_PREFIX = "CELERY_WORKER"


def main(argv: Sequence[str]) -> None:
    """Run Celery's `worker` command on this app with `argv` (its options); exits with the worker's status.

    As `celery -A workers.app worker` does it (celery/bin/celery.py): the command's context holds
    the app, and the app's user options for `worker` join the command's own.
    """
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker

    worker.params.extend(app.user_options.get("worker", []))
    context = CLIContext(app=app, no_color=None, workdir=None, quiet=False)
    worker.main(args=list(argv), prog_name=PROG_NAME, obj=context, auto_envvar_prefix=ENV_PREFIX)

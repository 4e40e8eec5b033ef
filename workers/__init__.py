"""subq's execution plane: the Celery tasks and the subagent runtime.

`celery -A workers.app worker` runs a worker. This package imports
`coordinator`; `coordinator` never imports it.
"""

__all__: list[str] = []

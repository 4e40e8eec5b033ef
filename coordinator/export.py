"""Exporting a task tree as folders, in the layout AI coding tools use for a task.

    <dir>/<task_id>/api_conversation_history.json   the model conversation
    <dir>/<task_id>/ui_messages.json                the UI messages
    <dir>/<task_id>/history_item.json               the task's summary line

One folder per task of the subtree, so a run can be opened elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

from coordinator.errors import ValidationError
from coordinator.models import HistoryItem, TaskRecord, TodoItem

__all__ = ["TaskReader", "export_tree"]


class TaskReader(Protocol):
    """What an export reads: the Coordinator on Redis, or the CLI's API backend."""

    def get_task(self, task_id: str) -> TaskRecord: ...
    def get_todos(self, task_id: str) -> list[TodoItem]: ...
    def messages(self, task_id: str, kind: Literal["ui", "api"]) -> list[dict[str, Any]]: ...


def export_tree(coord: TaskReader, task_id: str, directory: Path) -> list[Path]:
    """Write every task of `task_id`'s subtree; returns the files written."""
    if directory.exists() and not directory.is_dir():
        raise ValidationError(f"{directory} exists and is not a folder", field="directory")
    written: list[Path] = []
    pending = [task_id]
    while pending:
        record = coord.get_task(pending.pop(0))
        pending.extend(record.child_ids)
        folder = directory / record.id
        folder.mkdir(parents=True, exist_ok=True)
        files: dict[str, Any] = {
            "api_conversation_history.json": coord.messages(record.id, kind="api"),
            "ui_messages.json": coord.messages(record.id, kind="ui"),
            "history_item.json": HistoryItem.of(record).model_dump(mode="json"),
            # The plan with each row's child and figures, and the spend no row carries.
            "todos.json": {
                "items": [item.model_dump(mode="json") for item in coord.get_todos(record.id)],
                "unlinked_tokens": record.unlinked_tokens,
                "unlinked_cost_micros": record.unlinked_cost_micros,
            },
        }
        for name, content in files.items():
            path = folder / name
            path.write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")
            written.append(path)
    return written

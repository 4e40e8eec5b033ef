"""Exporting a task tree as folders, in the layout AI coding tools use for a task.

    <dir>/<task_id>/api_conversation_history.json   the model conversation
    <dir>/<task_id>/ui_messages.json                the UI messages
    <dir>/<task_id>/history_item.json               the task's summary line, with its tree's metadata
    <dir>/<task_id>/todos.json                      the plan, with each row's child and figures
    <dir>/<task_id>/timeline.json                   where its time went: the marks, intervals and figures
    <dir>/<task_id>/output.json                     its typed result: the schema, the validated data, the
                                                    invalid answers before it (nulls and 0 for a task without)

One folder per task of the subtree, so a run can be opened elsewhere.

Every folder name is a task id that came from the reader, and the reader may be
the CLI's API backend talking to a server nobody vouches for. So the export is
confined to `<dir>`: the whole subtree is read and checked first (each id is a
subq task id of the same tree, seen once, and its folder resolves to a direct
child of `<dir>`), and only then is anything written: each task's files into a
folder of the export's own inside `<dir>`, moved into place once every task was
read. A bad id, a read that fails or a write that fails is one error, and
nothing is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, Literal, Protocol

from coordinator.errors import ValidationError
from coordinator.ids import TASK_ID_RE, root_of
from coordinator.models import HistoryItem, TaskRecord, TodoItem

__all__ = ["FILE_NAMES", "TaskReader", "export_tree"]

# The files of each task's folder, in the order they are written.
FILE_NAMES = (
    "api_conversation_history.json", "ui_messages.json", "history_item.json", "todos.json", "timeline.json",
    "output.json",
)  # fmt: skip


class TaskReader(Protocol):
    """What an export reads: the Coordinator on Redis, or the CLI's API backend."""

    def get_task(self, task_id: str) -> TaskRecord: ...
    def get_todos(self, task_id: str) -> list[TodoItem]: ...
    def messages(self, task_id: str, kind: Literal["ui", "api"]) -> list[dict[str, Any]]: ...


def export_tree(coord: TaskReader, task_id: str, directory: Path) -> list[Path]:
    """Write every task of `task_id`'s subtree; returns the files written.

    Raises ValidationError, before writing anything, when the subtree names a task
    id that is not one (a path, `..`, a cycle) or whose folder would not be inside
    `directory`.
    """
    if directory.exists() and not directory.is_dir():
        raise ValidationError(f"{directory} exists and is not a folder", field="directory")
    # A malformed argument gets the same "Unknown id" line as every other command.
    root = root_of(task_id)
    records = _read_subtree(coord, task_id, root)
    target = directory.resolve()
    for record in records:
        _check_inside(directory / record.id, target)
    return _write_all(coord, records, directory)


def _write_all(coord: TaskReader, records: list[TaskRecord], directory: Path) -> list[Path]:
    """Each task's files written into a folder of the export's own inside `directory`, and moved into place once
    every task was read and written: a read that fails (a corrupt entry, a task that expired meanwhile, an API's
    5xx) leaves nothing behind, and one task's content is held at a time (a tree's conversations are not)."""
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".subq-export-", dir=directory))
    except OSError as exc:
        raise ValidationError(f"cannot write {exc.filename or directory}: {exc.strerror}", field="directory") from None
    try:
        for record in records:
            _write(staging / record.id, _contents(coord, record))
        written: list[Path] = []
        for record in records:
            folder = directory / record.id
            folder.mkdir(exist_ok=True)
            for name in FILE_NAMES:
                os.replace(staging / record.id / name, folder / name)
                written.append(folder / name)
        return written
    except OSError as exc:  # a file where a folder must be, no permission, a full disk: one line, not a traceback
        raise ValidationError(f"cannot write {exc.filename or directory}: {exc.strerror}", field="directory") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(directory.iterdir()):
            directory.rmdir()  # made for this export, which wrote nothing


def _write(folder: Path, contents: dict[str, Any]) -> None:
    folder.mkdir()
    for name in FILE_NAMES:
        (folder / name).write_text(json.dumps(contents[name], indent=2, ensure_ascii=False), encoding="utf-8")


def _contents(coord: TaskReader, record: TaskRecord) -> dict[str, Any]:
    """A task's files by name, as they are written."""
    return {
        "api_conversation_history.json": coord.messages(record.id, kind="api"),
        "ui_messages.json": coord.messages(record.id, kind="ui"),
        "history_item.json": HistoryItem.of(record).model_dump(mode="json"),
        # The plan with each row's child and figures, and the spend no row carries.
        "todos.json": {
            "items": [item.model_dump(mode="json") for item in coord.get_todos(record.id)],
            "unlinked_tokens": record.unlinked_tokens,
            "unlinked_cost_micros": record.unlinked_cost_micros,
        },
        # The marks as stored (coordinator/timeline.py) and what they say, as the API's record has them.
        "timeline.json": {
            "marks": record.timeline.model_dump(mode="json"),
            "times": record.times.model_dump(mode="json"),
        },
        # What a program reads of a typed task (docs/agents.md, "Typed results").
        "output.json": {
            "output_schema": record.output_schema,
            "output": record.output,
            "invalid_outputs": record.invalid_outputs,
        },
    }


def _read_subtree(coord: TaskReader, task_id: str, root: str) -> list[TaskRecord]:
    """Every record of the subtree, breadth first, each id checked before it is asked for.

    An id seen twice is refused: a real tree has each task once, and a server that
    answers with a cycle would otherwise keep the export reading forever.
    """
    records: list[TaskRecord] = []
    seen = {task_id}
    pending = deque([task_id])
    while pending:
        wanted = pending.popleft()
        record = coord.get_task(wanted)
        # The folder is named after the record's id: it must be the id that was asked for.
        if record.id != wanted:
            raise _refused(record.id, f"the answer for task {wanted}", "is not the task asked for", "id")
        _check_id(record.id, root, f"the record of task {wanted}", "id")
        where = f"the child_ids of task {record.id}"
        for child in record.child_ids:
            _check_id(child, root, where, "child_ids")
            if child in seen:
                raise _refused(child, where, "appears twice in the subtree (a cycle or a repeated child)", "child_ids")
            seen.add(child)
            pending.append(child)
        records.append(record)
    return records


def _check_id(value: str, root: str, where: str, field: str) -> None:
    """Refuse anything but a task id of this tree, naming what is wrong with it."""
    # fullmatch: the whole value is the id, with nothing after it (not even a final new line).
    match = TASK_ID_RE.fullmatch(value)
    if match is None:
        raise _refused(value, where, f"is not a subq task id ({_why_not(value)})", field)
    if match.group(1) != root:
        raise _refused(value, where, f"belongs to another tree than {root}", field)


def _why_not(value: str) -> str:
    """The plainest reason a name is not a task id, for the error line."""
    if "\x00" in value:
        return "it contains a NUL"
    if value.startswith(("/", "\\")) or Path(value).is_absolute():
        return "it is an absolute path"
    if "/" in value or "\\" in value:
        return "it contains a path separator"
    if value in {".", ".."}:
        return "it names the export folder or the one above it"
    return "16 hex digits, or 16 hex digits, '-' and 12 hex digits, expected"


def _check_inside(folder: Path, target: Path) -> None:
    """The folder, and each file in it, resolve to where they are named: inside `target`.

    A valid id cannot name another place, but a link already in the folder could
    (`<dir>/<id>` or one of its files pointing elsewhere), so the resolved paths are checked.
    """
    resolved = folder.resolve()
    if resolved.parent != target or resolved.name != folder.name:
        raise ValidationError(
            f"Refusing to export: {folder} resolves to {resolved}, outside {target}; nothing was written",
            field="directory",
        )
    for name in FILE_NAMES:
        file = (folder / name).resolve()
        if file.parent != resolved or file.name != name:
            raise ValidationError(
                f"Refusing to export: {folder / name} resolves to {file}, outside {resolved}; nothing was written",
                field="directory",
            )


def _refused(value: str, where: str, problem: str, field: str) -> ValidationError:
    # repr() keeps the line one line whatever the id holds (a newline, a NUL, escapes).
    return ValidationError(
        f"Refusing to export: the task id {value!r} in {where} {problem}; nothing was written", field=field
    )

"""`subq export` writes inside its folder only, whatever the API server answers.

A real HTTP server (uvicorn, tests/helpers.py `ApiServer`) imitates the three
routes the CLI's API backend reads for an export (a task, its todos, its
messages) and answers with a tree of its own making: task ids that are paths
(`../x`, absolute, `a/b`), ids of another tree, a cycle. The real `subq export`
runs against it (in this process, through `run_cli`, as tests/test_cli.py runs
every command) and must refuse with one line naming the bad id, exit 1, and
write nothing: every hostile id sits below a good child, so an export that wrote
as it read would leave files behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from coordinator.export import FILE_NAMES
from coordinator.models import TaskRecord, TaskStatus, TodoItem
from tests.helpers import TOKEN, ApiServer
from tests.test_cli import cli

ROOT = "5eed5eed5eed5eed"
CHILD = f"{ROOT}-0000000000c1"
GRANDCHILD = f"{ROOT}-0000000000c2"
OTHER_TREE = "0123456789abcdef-0000000000c3"


def record(task_id: str, child_ids: list[str]) -> dict[str, Any]:
    """A task as GET /v1/tasks/{id} answers it; the model does not check ids, so any id goes through."""
    return TaskRecord(
        id=task_id, root_id=ROOT, parent_id=None if task_id == ROOT else ROOT, status=TaskStatus.COMPLETED,
        prompt=f"task {task_id}", profile="offline", child_ids=child_ids, created_at=1.0, updated_at=2.0,
    ).model_dump(mode="json")  # fmt: skip


class FakeApi:
    """A subq API serving `tree` (asked-for id -> the record it answers with); it records what it is asked.

    Hostile as the finding's server was: it answers any id at all, a path included,
    with a task of that id, so an export that asked for `../x` would get a record
    to write there.
    """

    def __init__(self, tree: dict[str, dict[str, Any]], gone: frozenset[str] = frozenset()) -> None:
        self.tree = tree
        self.gone = gone  # tasks whose messages answer 404, as a task whose retention ran out meanwhile
        self.asked: list[str] = []
        self.app = FastAPI()
        # One route for every task path: the id is read from the raw path, where the
        # client percent-encodes it, so `..%2Fx` arrives as the id `../x`.
        self.app.get("/v1/tasks/{rest:path}")(self.task_route)

    def task_route(self, request: Request, kind: str = "ui") -> Any:
        segments = [unquote(s) for s in request.scope["raw_path"].decode().split("/")[3:]]
        task_id, what = segments[0], "/".join(segments[1:])
        self.asked.append(task_id)
        if what == "todos":
            item = TodoItem(id="t1", content="Collect the figures").model_dump(mode="json")
            return {"task_id": task_id, "todos": [item]}
        if what == "messages" and task_id in self.gone:
            return JSONResponse({"code": "not_found", "message": f"Unknown task: {task_id}", "field": None}, 404)
        if what == "messages":
            message = {"ts": 1.0, "type": "say", "text": f"{kind} message of {task_id}"}
            return {"task_id": task_id, "kind": kind, "messages": [message]}
        return self.tree.get(task_id) or record(task_id, [])


@pytest.fixture
def serve() -> Iterator[Any]:
    """Starts a FakeApi on a real port; yields a function from a tree to (FakeApi, its SUBQ_ env)."""
    servers: list[ApiServer] = []

    def start(tree: dict[str, dict[str, Any]], gone: frozenset[str] = frozenset()) -> tuple[FakeApi, dict[str, str]]:
        api = FakeApi(tree, gone)
        server = ApiServer(api.app).__enter__()
        servers.append(server)
        return api, {"SUBQ_API_URL": server.url, "SUBQ_API_TOKEN": TOKEN}

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def every_path(top: Path) -> list[str]:
    """Everything under `top`, folders included, as relative paths."""
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


def hostile_trees(outside: Path) -> dict[str, tuple[dict[str, dict[str, Any]], str]]:
    """Case name -> (the server's tree, the id the error must name)."""
    absolute = str(outside / "abs-evil")

    def below_child(bad: str) -> dict[str, dict[str, Any]]:
        # root -> CHILD (fine) -> bad: the bad id is only seen after two good records.
        return {ROOT: record(ROOT, [CHILD]), CHILD: record(CHILD, [bad])}

    return {
        "parent-dir": (below_child("../x"), "../x"),
        "parent-dir-in-id": (below_child(f"../{ROOT}"), f"../{ROOT}"),
        "absolute": (below_child(absolute), absolute),
        "separator": (below_child("a/b"), "a/b"),
        "backslash": (below_child("a\\b"), "a\\b"),
        "dot": (below_child("."), "."),
        "nul": (below_child(f"{GRANDCHILD}\x00"), f"{GRANDCHILD}\x00"),
        "newline": (below_child(f"{GRANDCHILD}\n"), f"{GRANDCHILD}\n"),
        "other-tree": (below_child(OTHER_TREE), OTHER_TREE),
        # The server answers the root with a record whose own id is a path.
        "record-id": ({ROOT: record("../x", [])}, "../x"),
        "cycle": ({ROOT: record(ROOT, [CHILD]), CHILD: record(CHILD, [ROOT])}, ROOT),
        "self-cycle": ({ROOT: record(ROOT, [CHILD]), CHILD: record(CHILD, [CHILD])}, CHILD),
        "repeated-child": ({ROOT: record(ROOT, [CHILD, CHILD]), CHILD: record(CHILD, [])}, CHILD),
    }


CASES = sorted(hostile_trees(Path("/unused")))


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_server_cannot_make_export_write_anywhere(serve: Any, tmp_path: Path, case: str) -> None:
    outside = tmp_path / "outside"
    tree, bad_id = hostile_trees(outside)[case]
    api, env = serve(tree)
    target = tmp_path / "out" / "export"
    proc = cli("export", ROOT, str(target), env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("subq: Refusing to export: the task id ") and repr(bad_id) in lines[0], lines[0]
    assert lines[0].endswith("nothing was written"), lines[0]
    assert proc.stdout == ""
    # Nothing at all was created: not the target, not its parent's neighbour `../x`, not the absolute path.
    assert every_path(tmp_path) == [], every_path(tmp_path)
    assert not os.path.lexists(target / bad_id.replace("\x00", ""))
    # A bad id is refused from the record naming it: only the tree's own ids were asked for.
    assert set(api.asked) <= set(tree), api.asked


def test_a_link_in_the_folder_pointing_elsewhere_is_refused(serve: Any, tmp_path: Path) -> None:
    _, env = serve({ROOT: record(ROOT, [CHILD]), CHILD: record(CHILD, [])})
    target, outside = tmp_path / "export", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (target / CHILD).symlink_to(outside, target_is_directory=True)
    proc = cli("export", ROOT, str(target), env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and f"{target / CHILD} resolves to {outside}" in proc.stderr, proc.stderr
    assert every_path(tmp_path) == ["export", f"export/{CHILD}", "outside"]


def test_a_well_formed_tree_from_the_same_server_is_exported(serve: Any, tmp_path: Path) -> None:
    """The fake server speaks the API: the refusals above are for the ids, not for the answers' shape."""
    sibling = f"{ROOT}-0000000000c9"
    tree = {
        ROOT: record(ROOT, [CHILD, sibling]),
        CHILD: record(CHILD, [GRANDCHILD]),
        sibling: record(sibling, []),
        GRANDCHILD: record(GRANDCHILD, []),
    }
    _, env = serve(tree)
    target = tmp_path / "export"
    proc = cli("export", ROOT, str(target), env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"Exported 4 tasks ({4 * len(FILE_NAMES)} files) to {target}"
    assert {p.name for p in target.iterdir()} == set(tree)
    for task_id in tree:
        item = json.loads((target / task_id / "history_item.json").read_text())
        ui = json.loads((target / task_id / "ui_messages.json").read_text())
        assert item["id"] == task_id and ui[0]["text"] == f"ui message of {task_id}"
    assert {p.parent for p in target.rglob("*.json")} == {target / t for t in tree}


def test_a_task_that_cannot_be_read_midway_leaves_nothing_written(serve: Any, tmp_path: Path) -> None:
    """The last task's messages are gone (its retention ran out during the export): each folder before it was on
    disk, against what the export says (nothing is written unless the whole subtree was read)."""
    sibling = f"{ROOT}-0000000000c9"
    tree = {ROOT: record(ROOT, [CHILD, sibling]), CHILD: record(CHILD, []), sibling: record(sibling, [])}
    _, env = serve(tree, frozenset({sibling}))
    target = tmp_path / "export"
    proc = cli("export", ROOT, str(target), env=env)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr == f"subq: Unknown task: {sibling}\n"
    assert every_path(tmp_path) == []


def test_a_malformed_argument_is_refused_before_any_request(serve: Any, tmp_path: Path) -> None:
    api, env = serve({ROOT: record(ROOT, [])})
    proc = cli("export", "../x", str(tmp_path / "export"), env=env)
    assert proc.returncode == 1
    assert proc.stderr == "subq: Unknown id: '../x' is not a subq task or batch id\n"
    assert api.asked == [] and every_path(tmp_path) == []


def test_a_hostile_servers_error_message_stays_one_plain_line(tmp_path: Path) -> None:
    """Not only export: any command prints a server's refusal as one line, a terminal escape as text."""
    app = FastAPI()

    @app.get("/v1/tasks/{task_id}")
    def refuse(task_id: str) -> JSONResponse:
        message = "gone\nsubq: all good, approved\r\x1b[2J\x1b]0;pwned\x07"
        return JSONResponse({"code": "not_found", "message": message, "field": None}, status_code=404)

    with ApiServer(app) as server:
        proc = cli("status", ROOT, env={"SUBQ_API_URL": server.url, "SUBQ_API_TOKEN": TOKEN})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr and "\x07" not in proc.stderr
    assert "gone subq: all good, approved \\x1b[2J\\x1b]0;pwned\\x07" in proc.stderr, proc.stderr


def test_a_hostile_servers_ids_reach_the_terminal_as_text() -> None:
    """Ids a server answers with (a retry's, a new task's) were printed as they came: an OSC 52 in one wrote the
    terminal's clipboard. They are shown as text, as every other server's or model's text is."""
    evil = "\x1b]52;c;aGk=\x07"
    app = FastAPI()

    @app.post("/v1/tasks/{task_id}/retry")
    def retry(task_id: str) -> dict[str, Any]:
        return {"task": record(ROOT, []), "retried": [f"{ROOT}{evil}"], "reopened": [f"{CHILD}{evil}"], "skipped": []}

    @app.post("/v1/tasks")
    def create() -> JSONResponse:
        return JSONResponse(record(f"{ROOT}{evil}", []), status_code=201)

    with ApiServer(app) as server:
        env = {"SUBQ_API_URL": server.url, "SUBQ_API_TOKEN": TOKEN}
        retried = cli("retry", ROOT, env=env)
        ran = cli("run", "hello", env=env)
    for proc in (retried, ran):
        assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stdout + proc.stderr, proc
    assert f"Retried {ROOT}\\x1b]52;c;aGk=\\x07: it runs again" in retried.stdout, retried.stdout
    assert ran.stdout == f"{ROOT}\\x1b]52;c;aGk=\\x07\n", ran.stdout

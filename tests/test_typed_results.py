"""Typed results: a task's `output_schema`, its model held to it, and the validated object on the record.

The runs go through real `celery worker` processes whose models are OpenAI-compatible servers on
loopback (tests/model_server.py), or the offline model playing a script. The bad schemas go in
through every face (the HTTP API, the Python client, `subq run`, `subq.submit`, a delegation tool,
a profile), each refused with the path of the problem and nothing written.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from coordinator import Coordinator, Profile, Settings, TaskStatus
from coordinator.api import create_app
from coordinator.client import SubqClient
from coordinator.errors import ValidationError
from coordinator.local.fleet import WorkerFleet, settings_env
from coordinator.output_schema import (
    MAX_OUTPUT_BYTES,
    MAX_SCHEMA_BYTES,
    check_schema,
    completion_parameters,
    output_errors,
)
from coordinator.writeback import COMBINED_RESULT_BYTES, OUTPUT_IN_LINE_BYTES
from tests import helpers
from tests.agents import call as script_call
from tests.conftest import dedicated_fleet
from tests.helpers import TOKEN, ApiServer, api_settings, script, state
from tests.model_server import ModelServer, Turn, call
from tests.test_bad_input import NO_TREE
from tests.test_cli import cli
from workers.submit import submit

WAIT_S = 90

# What a program reads of a count: the total and one row per item.
COUNT = {
    "type": "object",
    "properties": {
        "total": {"type": "integer", "minimum": 0},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/Row"}},
    },
    "required": ["total", "rows"],
    "additionalProperties": False,
    "$defs": {"Row": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
}
VALID = {"total": 2, "rows": [{"name": "a"}, {"name": "b"}]}
# Breaks it twice: a total that is no integer, a row without its name.
INVALID = {"total": "two", "rows": [{"nom": "a"}]}
# attempt_completion's arguments as a JSON list, not the object of its named arguments.
NOT_AN_OBJECT = {"name": "attempt_completion", "arguments": ["counted", VALID]}
INVALID_ERRORS = ["data.rows.0: 'name' is a required property", "data.total: 'two' is not of type 'integer'"]


class Row(BaseModel):
    name: str


class CountModel(BaseModel):
    """A profile's schema named as a pydantic model (`tests.test_typed_results:CountModel`)."""

    total: int
    rows: list[Row]


def _nested(levels: int) -> dict[str, Any]:
    """A schema `levels` objects deep."""
    schema: dict[str, Any] = {}
    for _ in range(levels):
        schema = {"not": schema}
    return schema


_LARGE = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
# Schemas no face may take, each with what its error says (the path into the schema first).
BAD_SCHEMAS: list[tuple[str, object, str]] = [
    ("not an object", ["type", "object"], "output_schema: must be a JSON Schema object, not list"),
    ("a bad type", {"type": "object", "properties": {"total": {"type": "integr"}}},
     "output_schema.properties.total.type: 'integr' is not valid under any of the given schemas"),
    ("a remote ref", {"type": "object", "properties": {"x": {"$ref": "https://example.invalid/s.json"}}},
     "output_schema.properties.x.$ref: only local references ('#/...') are allowed"),
    ("a dangling ref", {"$ref": "#/$defs/Missing"}, "output_schema.$ref: '#/$defs/Missing' names nothing in the schema"),
    ("too deep", _nested(40), "output_schema" + ".not" * 32 + ": nested deeper than 32 levels"),
    ("too large", _LARGE, f"output_schema: {len(json.dumps(_LARGE, separators=(',', ':')))} bytes as compact JSON; "
     f"the limit is {MAX_SCHEMA_BYTES}"),
]  # fmt: skip


class Typed(NamedTuple):
    coord: Coordinator
    api: ApiServer
    retrying: ModelServer  # invalid data, then valid data
    refusing: ModelServer  # invalid data every time
    parent: ModelServer  # delegates one typed child, then completes
    child: ModelServer  # the child: valid data at once
    mixed: ModelServer  # an invalid answer of each kind: plain text, arguments that are no object, bad data
    recovering: ModelServer  # plain text, arguments that are no object, then valid data
    anything: ModelServer  # plain text, then any JSON as data (for the schema `{}`)


@pytest.fixture(scope="module")
def typed(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Typed]:
    servers = {
        "retrying": ModelServer([
            Turn(calls=[call("attempt_completion", result="counted (wrong)", data=INVALID)]),
            Turn(calls=[call("attempt_completion", result="counted two", data=VALID)]),
        ]),
        "refusing": ModelServer([Turn(calls=[call("attempt_completion", result="counted", data=INVALID)])]),
        "parent": ModelServer([
            Turn(calls=[call("run_subagents", tasks=[
                {"description": "count the rows", "message": "Count the rows.", "profile": "child",
                 "output_schema": COUNT},
            ])]),
            Turn(calls=[call("attempt_completion", result="the child counted")]),
        ]),
        "child": ModelServer([Turn(calls=[call("attempt_completion", result="two rows", data=VALID)])]),
        "mixed": ModelServer([
            Turn(text="There are two rows."),
            Turn(calls=[NOT_AN_OBJECT]),
            Turn(calls=[call("attempt_completion", result="counted", data=INVALID)]),
            Turn(calls=[call("attempt_completion", result="counted two", data=VALID)]),  # never asked for
        ]),
        "recovering": ModelServer([
            Turn(text="There are two rows."),
            Turn(calls=[{"name": "attempt_completion", "arguments": '{"result": "counted"}'}]),  # a JSON string
            Turn(calls=[call("attempt_completion", result="counted two", data=VALID)]),
        ]),
        "anything": ModelServer([
            Turn(text="Done."),
            Turn(calls=[call("attempt_completion", result="said it", data=["any", {"json": None}])]),
        ]),
    }  # fmt: skip
    for server in servers.values():
        server.start()

    def hosted(server: ModelServer, **more: Any) -> Profile:
        return Profile(model="openai:test-model", base_url=server.base_url, api_key=server.key, **more)

    profiles = {name: hosted(server) for name, server in servers.items()}
    profiles["offline-typed"] = Profile(output_schema=COUNT)  # the offline model, the schema the profile's
    profiles["offline-pydantic"] = Profile(output_schema="tests.test_typed_results:CountModel")
    own = settings.model_copy(update={"profiles": {**settings.profiles, **profiles}})
    try:
        with dedicated_fleet(own, tmp_path_factory.mktemp("typed"), 1, queue="subq-typed") as (coord, _):
            api_coord = Coordinator(api_settings(coord.settings))
            try:
                with ApiServer(create_app(coordinator=api_coord)) as api:
                    yield Typed(coord, api, **servers)
            finally:
                api_coord.close()
    finally:
        for server in servers.values():
            server.stop()


def _requests_of(server: ModelServer) -> list[list[dict[str, Any]]]:
    """The messages of each request the server answered, in order."""
    return [seen.body.get("messages", []) for seen in server.answered()]


def _tool_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [str(m.get("content")) for m in messages if m.get("role") == "tool"]


def _last_request_text(messages: list[dict[str, Any]]) -> str:
    """What the model read last in a request: its last message's text."""
    return str(messages[-1].get("content"))


def _subq(coord: Coordinator, *args: str) -> subprocess.CompletedProcess[str]:
    """`subq <args>` on this coordinator's settings, run in this process (tests/test_cli.py's `cli`: each
    command's own process cost 1.5 s of CPU on 2 cores, and tests/test_cli.py runs `subq` as a process)."""
    env = {k: v for k, v in settings_env(coord.settings).items() if k.startswith("SUBQ_")}
    return cli(*args, env=env)


def _says(coord: Coordinator, task_id: str, kind: str) -> list[str]:
    return [m["text"] for m in coord.messages(task_id) if m.get("say") == kind]


# -- the schema's checks and the tool's parameters (pure) ------------------------------------------


# More that only the check itself is given (each face runs the same check on BAD_SCHEMAS above).
MORE_BAD_SCHEMAS: list[tuple[str, object, str]] = [
    ("a bad pattern", {"type": "string", "pattern": "("}, "output_schema.pattern: '(' is not a 'regex'"),
    ("an unknown draft", {"$schema": "https://example.invalid/draft"}, "output_schema.$schema: 'https://example.invalid/draft' names no JSON Schema draft"),
    ("a loop", {"$ref": "#"}, "output_schema: its references lead back to themselves without reading into the data"),
    ("a value JSON cannot carry", {"type": "number", "maximum": float("nan")}, "output_schema: not JSON"),
]  # fmt: skip
ALL_BAD = [*BAD_SCHEMAS, *MORE_BAD_SCHEMAS]


@pytest.mark.parametrize(("schema", "message"), [c[1:] for c in ALL_BAD], ids=[c[0] for c in ALL_BAD])
def test_a_bad_schema_is_refused_naming_the_path(schema: object, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        check_schema(schema)
    assert message in refused.value.message


def test_every_error_of_an_output_is_named_by_its_path() -> None:
    assert output_errors(COUNT, INVALID) == INVALID_ERRORS
    assert output_errors(COUNT, VALID) == []


def test_the_completion_tool_is_given_the_schema_with_its_references_rebased() -> None:
    parameters = completion_parameters(COUNT)
    assert parameters["required"] == ["result", "data"]
    data = parameters["properties"]["data"]
    assert data["properties"]["rows"]["items"] == {"$ref": "#/$defs/Row"}  # $defs moved to the tool's root
    assert parameters["$defs"]["Row"] == COUNT["$defs"]["Row"]  # type: ignore[index]
    rooted = completion_parameters({"type": "object", "properties": {"self": {"$ref": "#"}}})
    assert rooted["properties"]["data"]["properties"]["self"] == {"$ref": "#/properties/data"}


@pytest.mark.parametrize("ref", ["#/$defs/X", "#/%24defs/X", "#/definitions/X"])
def test_every_spelling_of_a_local_definition_still_resolves_in_the_completion_tool(ref: str) -> None:
    """The tool's schema, as the model is given it, holds data to the task's schema: a reference to a
    definition that moved to the tool's root (percent-encoded, or draft 7's `definitions`) follows it."""
    defs = "definitions" if "definitions" in ref else "$defs"
    schema = {"type": "object", "properties": {"x": {"$ref": ref}}, defs: {"X": {"type": "integer"}}}
    check_schema(schema)
    tool = jsonschema.Draft202012Validator(completion_parameters(schema))
    assert [e.message for e in tool.iter_errors({"result": "r", "data": {"x": "no"}})] == [
        "'no' is not of type 'integer'"
    ]
    assert list(tool.iter_errors({"result": "r", "data": {"x": 1}})) == []


# -- acceptance: against an OpenAI-compatible server on loopback -----------------------------------


def test_invalid_data_goes_back_with_its_errors_and_the_valid_object_is_the_output(
    typed: Typed, tmp_path: Path
) -> None:
    coord = typed.coord
    root = coord.create_task("Count the rows.", profile="retrying", run=True, output_schema=COUNT)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output == VALID
    assert done.summary == "counted two"
    assert done.output_schema == COUNT
    assert done.invalid_outputs == 1
    requests = _requests_of(typed.retrying)
    assert len(requests) == 2, "the model was asked once more after its invalid data"
    # The request after the invalid answer carries every validation error, by path.
    answer = _tool_texts(requests[1])[-1]
    assert "Invalid data: " in answer
    assert all(error in answer for error in INVALID_ERRORS), answer
    # The tool the model was given holds `data` to the schema, and no plain text ends the task.
    sent = typed.retrying.answered()[0].body
    tool = next(t for t in sent["tools"] if t["function"]["name"] == "attempt_completion")
    assert tool["function"]["parameters"]["properties"]["data"]["required"] == ["total", "rows"]
    assert sent.get("tool_choice") == "required"
    invalid = _says(coord, root.id, "output_invalid")
    assert len(invalid) == 1 and "data.total" in invalid[0]
    # Seen the same on every face: the API's record, `subq result` (its words, then the JSON), the export.
    with typed.api.client() as http:
        assert http.get(f"/v1/tasks/{root.id}").json()["output"] == VALID
        tree = http.get(f"/v1/tasks/{root.id}/tree").json()
        assert tree["output"] == VALID and tree["invalid_outputs"] == 1
    shown = _subq(coord, "result", root.id)
    words, _, data = shown.stdout.partition("\n")
    assert shown.returncode == 0 and words == "counted two" and json.loads(data) == VALID, shown
    shown = _subq(coord, "result", root.id, "--json")
    assert json.loads(shown.stdout)["output"] == VALID
    (written,) = [p for p in coord.export_tree(root.id, tmp_path) if p.name == "output.json"]
    assert json.loads(written.read_text()) == {"output_schema": COUNT, "output": VALID, "invalid_outputs": 1}


def test_a_model_that_never_gives_valid_data_fails_with_the_last_errors(typed: Typed) -> None:
    coord = typed.coord
    root = coord.create_task("Count the rows.", profile="refusing", run=True, output_schema=COUNT)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.FAILED
    assert done.error_class == "OutputInvalid"
    assert all(error in done.error for error in INVALID_ERRORS), done.error
    assert done.output is None
    bound = coord.settings.profile("refusing").max_invalid_outputs
    assert done.invalid_outputs == bound == 3
    assert len(typed.refusing.answered()) == bound, "one request per invalid answer, and none after the last"
    assert len(_says(coord, root.id, "output_invalid")) == bound


def test_every_kind_of_invalid_answer_counts_once_against_one_bound(typed: Typed) -> None:
    # Plain text, arguments that are no object, data that breaks the schema: answers 1, 2 and 3 of at most 3,
    # and the third fails the task; the fourth turn (valid) is never asked for.
    coord = typed.coord
    root = coord.create_task("Count the rows.", profile="mixed", run=True, output_schema=COUNT)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.FAILED and done.error_class == "OutputInvalid", (done.error_class, done.error)
    assert done.invalid_outputs == 3
    assert done.error.startswith("3 invalid answers; the last: ") and INVALID_ERRORS[1] in done.error, done.error
    assert len(typed.mixed.answered()) == 3
    lines = _says(coord, root.id, "output_invalid")
    assert [line.split(":")[0] for line in lines] == [f"answer {n} of at most 3" for n in (1, 2, 3)]
    assert "no attempt_completion call" in lines[0]
    assert "attempt_completion's arguments are no JSON object" in lines[1]
    assert INVALID_ERRORS[0] in lines[2]
    # What the model read after each invalid answer: what was wrong, and how many more fail the task.
    after_text, after_list = (_last_request_text(r) for r in _requests_of(typed.mixed)[1:])
    assert "Invalid answer: no attempt_completion call" in after_text and "(2 more invalid answers fail" in after_text
    assert "no JSON object" in after_list and "(1 more invalid answer fails the task)" in after_list


def test_a_task_recovers_from_invalid_answers_of_every_kind_within_the_bound(typed: Typed) -> None:
    coord = typed.coord
    root = coord.create_task("Count the rows.", profile="recovering", run=True, output_schema=COUNT)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output == VALID and done.invalid_outputs == 2
    assert len(typed.recovering.answered()) == 3
    lines = _says(coord, root.id, "output_invalid")
    assert len(lines) == 2 and "Input should be an object" in lines[1], lines


def test_an_empty_schema_types_the_task(typed: Typed) -> None:
    # `{}` holds any JSON: the task is typed all the same (plain text does not end it; its data is its output).
    coord = typed.coord
    root = coord.create_task("Say anything.", profile="anything", run=True, output_schema={})
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output_schema == {}
    assert done.output == ["any", {"json": None}] and done.summary == "said it"
    assert done.invalid_outputs == 1 and len(typed.anything.answered()) == 2
    sent = typed.anything.answered()[0].body
    tool = next(t for t in sent["tools"] if t["function"]["name"] == "attempt_completion")
    assert tool["function"]["parameters"]["required"] == ["result", "data"]


def test_a_parent_reads_its_typed_childs_object_as_json(typed: Typed) -> None:
    coord = typed.coord
    root = coord.create_task("Have the rows counted.", profile="parent", run=True)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    (child,) = coord.get_children(root.id)
    assert child.output_schema == COUNT
    assert child.output == VALID
    # The parent's resumed request answers its delegation with the child's line, the object as compact JSON.
    resumed = _requests_of(typed.parent)[-1]
    line = next(text for text in _tool_texts(resumed) if child.id in text)
    assert 'Output (JSON): {"total":2,"rows":[{"name":"a"},{"name":"b"}]}' in line
    # The tree and the parent's stored conversation hold it too.
    contents = [str(p.get("content")) for m in coord.messages(root.id, "api") for p in m.get("parts", [])]
    assert any(json.dumps(VALID, separators=(",", ":")) in content for content in contents)
    with typed.api.client() as http:
        tree = http.get(f"/v1/tasks/{root.id}/tree").json()
    assert tree["children"][0]["id"] == child.id


def test_a_wide_fan_out_of_large_outputs_is_bounded_as_one_result(typed: Typed) -> None:
    """Twenty children of 15 KB outputs: the combined result the parent reads stays within its bound, the
    first lines whole, the later ones cut to their head and naming the child whose record has the rest."""
    coord = typed.coord
    big = {"total": 1, "rows": [{"name": "x" * 15_000}]}
    steps = [script_call("attempt_completion", result="one long row", data=big)]
    specs = [
        {"description": f"row {n}", "message": script(*steps, text=f"Row {n}."), "output_schema": COUNT}
        for n in range(20)
    ]
    root = coord.create_task("Collect the rows.", todos="\n".join(f"[ ] row {n}" for n in range(20)))
    batch = coord.delegate(root.id, specs)
    coord.wait(root.id, timeout_s=WAIT_S)
    result = coord.get_batch(batch.id).result
    assert len(result.encode()) <= COMBINED_RESULT_BYTES + 20 * 400  # each cut line's note included
    lines = result.splitlines()[1:]
    assert len(lines) == 20
    whole = [line for line in lines if json.dumps(big, separators=(",", ":")) in line]
    cut = [line for line in lines if "[cut: this combined result reached its limit of 262144 bytes" in line]
    assert len(whole) + len(cut) == 20 and 10 <= len(whole) < 20, (len(whole), len(cut))
    assert all(line.startswith(f"{n + 1}. ") for n, line in enumerate(lines))
    for line, child_id in zip(lines[len(whole) :], batch.child_ids[len(whole) :], strict=True):
        assert line.endswith(f"the whole result is the record of task {child_id}]")
    assert all(coord.get_task(child_id).output == big for child_id in batch.child_ids)


def test_the_lua_bounds_of_a_childs_line_equal_pythons() -> None:
    assert MAX_OUTPUT_BYTES == OUTPUT_IN_LINE_BYTES  # every valid output fits its line whole
    lua = Path(__file__).resolve().parent.parent / "coordinator" / "store" / "lua"
    assert f"local OUTPUT_IN_LINE = {OUTPUT_IN_LINE_BYTES}\n" in (lua / "hashes.lua").read_text()
    assert f"local COMBINED_RESULT_BYTES = {COMBINED_RESULT_BYTES}\n" in (lua / "close_batch.lua").read_text()


def test_the_offline_model_completes_a_task_with_its_profiles_schema(typed: Typed) -> None:
    coord = typed.coord
    prompt = script(script_call("attempt_completion", result="two rows", data=VALID), text="Count the rows.")
    root = coord.create_task(prompt, profile="offline-typed", run=True)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output == VALID and done.output_schema is None  # the profile's schema held it


def test_a_profiles_schema_named_as_a_pydantic_model_holds_its_tasks(typed: Typed) -> None:
    coord = typed.coord
    assert coord.settings.profile("offline-pydantic").output_schema == CountModel.model_json_schema()
    broken = {"total": "two", "rows": [{"name": "a"}]}
    steps = [
        script_call("attempt_completion", result="wrong", data=broken),
        script_call("attempt_completion", result="two rows", data=VALID),
    ]
    root = coord.create_task(script(*steps, text="Count the rows."), profile="offline-pydantic", run=True)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output == VALID and done.invalid_outputs == 1
    assert CountModel.model_validate(done.output).total == 2


# -- bad schemas on every input path: a clear error, and nothing written -----------------------------


@pytest.mark.parametrize(("schema", "message"), [c[1:] for c in BAD_SCHEMAS], ids=[c[0] for c in BAD_SCHEMAS])
def test_a_bad_schema_is_refused_on_every_face_and_nothing_is_written(
    typed: Typed, tmp_path: Path, schema: object, message: str
) -> None:
    coord = typed.coord
    parent = coord.create_task("Hold the children.", run=False)  # for the API's subtasks
    before = state(coord, NO_TREE)
    # The service, as a Python caller uses it.
    with pytest.raises(ValidationError) as refused:
        coord.create_task("Count.", run=True, output_schema=schema)  # type: ignore[arg-type]
    assert message in refused.value.message
    # The HTTP API: 422, naming the path.
    with typed.api.client() as http:
        answer = http.post("/v1/tasks", json={"prompt": "Count.", "run": True, "output_schema": schema})
        assert answer.status_code == 422, answer.text
        assert message in answer.json()["message"], answer.json()
        before_parent = state(coord, parent.root_id)
        spec = {"description": "count", "message": "Count.", "output_schema": schema}
        answer = http.post(f"/v1/tasks/{parent.id}/subtasks", json={"subtasks": [spec]})
        assert answer.status_code == 422, answer.text
        assert answer.json()["message"].startswith("subtasks.0." + message), answer.json()
        assert state(coord, parent.root_id) == before_parent
    # The Python client refuses before it sends anything.
    with SubqClient(typed.api.url, TOKEN) as client, pytest.raises(ValidationError) as refused:
        client.create_task("Count.", run=True, output_schema=schema)  # type: ignore[arg-type]
    assert message in refused.value.message
    # `subq run --output-schema FILE`: one line, exit 1.
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    ran = _subq(coord, "run", "Count.", "--output-schema", str(path))
    assert ran.returncode != 0 and message in ran.stderr, ran.stderr
    # `subq.submit`, the function the Celery task runs.
    result = submit(coord, (), {"prompt": "Count.", "output_schema": schema})
    assert result["error"]["code"] == "invalid_input" and message in result["error"]["message"], result
    assert state(coord, NO_TREE) == before


def test_a_schema_on_a_caller_owned_task_is_refused(typed: Typed) -> None:
    before = state(typed.coord, NO_TREE)
    with pytest.raises(ValidationError, match="output_schema applies to an agent task"):
        typed.coord.create_task("Hold.", run=False, output_schema=COUNT)
    with typed.api.client() as http:
        answer = http.post("/v1/tasks", json={"prompt": "Hold.", "output_schema": COUNT})
    assert answer.status_code == 422 and "run=true" in answer.json()["message"]
    assert state(typed.coord, NO_TREE) == before


def test_a_profile_whose_schema_does_not_import_is_refused_when_settings_load() -> None:
    with pytest.raises(ValueError, match="output_schema 'tests.nowhere:Count' does not import"):
        Profile(output_schema="tests.nowhere:Count")
    with pytest.raises(ValueError, match=r"output_schema\.properties\.total\.type"):
        Profile(output_schema={"type": "object", "properties": {"total": {"type": "integr"}}})
    schema = Profile(output_schema="coordinator.models:Usage").output_schema
    assert schema is not None and schema["properties"]["tokens_in"]["type"] == "integer"


def test_a_delegation_tool_with_a_bad_schema_creates_no_child(typed: Typed) -> None:
    coord = typed.coord
    bad = {"type": "object", "properties": {"total": {"type": "integr"}}}
    child = {"description": "count", "message": "Count.", "output_schema": bad}
    prompt = script(script_call("run_subagents", tasks=[child]), text="Delegate a count.")
    root = coord.create_task(prompt, run=True)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED and done.child_ids == []
    parts = [p for m in coord.messages(root.id, "api") for p in m.get("parts", []) if p.get("tool_name")]
    answer = next(p["content"] for p in parts if p["tool_name"] == "run_subagents" and "content" in p)
    assert "tasks.0.output_schema.properties.total.type: 'integr' is not valid" in answer, answer
    assert "no subtask was created" in answer


def test_a_typed_output_is_shown_escaped_in_the_web_view(typed: Typed) -> None:
    coord = typed.coord
    hostile = {"total": 1, "rows": [{"name": "<script>alert(1)</script>"}]}
    prompt = script(script_call("attempt_completion", result="one", data=hostile), text="Count the rows.")
    root = coord.create_task(prompt, profile="offline-typed", run=True)
    assert coord.wait(root.id, timeout_s=WAIT_S).output == hostile
    with httpx.Client(base_url=typed.api.url, timeout=30) as http:
        assert http.post("/ui/login", data={"token": TOKEN, "next": "/ui/"}).status_code == 303
        page = http.get(f"/ui/tasks/{root.id}/fragment").text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert 'data-field="output"' in page


def test_a_typed_output_is_printed_as_valid_json_with_no_raw_control_character(typed: Typed) -> None:
    # A C1 CSI, a soft hyphen, a tag character, a bidi override, an ESC sequence, a DEL: each reaches the
    # terminal only as a JSON escape, and what is printed reads back as the output.
    coord = typed.coord
    name = "\u009b2J soft\u00adhyphen tag\U000e0041 rtl\u202eabc esc\x1b[2J del\x7f"
    hostile = {"total": 1, "rows": [{"name": name}]}
    prompt = script(script_call("attempt_completion", result="one", data=hostile), text="Count the rows.")
    root = coord.create_task(prompt, profile="offline-typed", run=True)
    assert coord.wait(root.id, timeout_s=WAIT_S).output == hostile

    def printed(*args: str) -> str:
        shown = _subq(coord, *args)
        assert shown.returncode == 0, shown
        assert all(ch == "\n" or " " <= ch <= "~" for ch in shown.stdout), ascii(shown.stdout)
        return shown.stdout

    words, _, data = printed("result", root.id).partition("\n")
    assert words == "one" and json.loads(data) == hostile
    assert json.loads(printed("result", root.id, "--json"))["output"] == hostile
    assert json.loads(printed("status", root.id, "--json"))["output"] == hostile
    assert json.loads(printed("tree", root.id, "--json"))["output"] == hostile


def test_the_offline_models_typed_child_example_runs_as_written(typed: Typed) -> None:
    """docs/offline-model.md's "A typed child", as a task's message: the child's object, and the root reads it."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "offline-model.md").read_text()
    section = doc[doc.index("## A typed child") : doc.index("## A task that ends with a tool call")]
    message = section.split("````markdown\n", 1)[1].split("\n````", 1)[0]
    coord = typed.coord
    root = coord.create_task(message, run=True)
    done = coord.wait(root.id, timeout_s=WAIT_S)
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    (child,) = coord.get_children(root.id)
    assert child.output == {"open": 3, "labels": ["bug", "bug", "docs"]}
    promised = 'Output (JSON): {"open":3,"labels":["bug","bug","docs"]}'
    assert promised in section
    contents = [str(p.get("content")) for m in coord.messages(root.id, "api") for p in m.get("parts", [])]
    assert any(promised in content for content in contents)


# -- a worker killed while its model is asked again ---------------------------------------------------------

LAPSE_S = 3
# A rescuer takes the run over when its worker's lease lapses (the reconciler, not the broker's redelivery).
FAULT_SETTINGS = {
    "heartbeat_lapse_s": LAPSE_S, "reconcile_interval_s": 0.5, "reconcile_grace_s": 3, "task_time_limit_s": 60,
    "visibility_timeout_s": 300,
}  # fmt: skip
# Each answer takes this long: the worker is killed while the request that asks again waits for its answer.
ANSWER_S = 4.0


# The invalid first answers a run can die after: data that breaks the schema, and words with no call.
FIRST_ANSWERS = {
    "bad data": (Turn(calls=[call("attempt_completion", result="counted (wrong)", data=INVALID)]), INVALID_ERRORS),
    "no call": (Turn(text="There are two rows."), ["no attempt_completion call"]),
}


@pytest.mark.parametrize("first", list(FIRST_ANSWERS))
def test_a_worker_killed_while_its_model_is_asked_again_leaves_a_run_that_asks_again(
    settings: Settings, tmp_path: Path, first: str
) -> None:
    """The invalid answer is the journal's last message (the request asking again is saved with its own
    answer): the run that goes on asks the model again, counts the answer once, and completes."""
    assert settings.redis_url
    invalid, errors = FIRST_ANSWERS[first]
    turns = [invalid, Turn(calls=[call("attempt_completion", result="counted two", data=VALID)])]
    with ModelServer(turns, latency_s=ANSWER_S) as server:
        hosted = Profile(model="openai:test-model", base_url=server.base_url, api_key=server.key, output_schema=COUNT)
        own = settings.model_copy(update={
            **FAULT_SETTINGS, "redis_url": settings.redis_url.rsplit("/", 1)[0] + "/4", "queue": "subq-tfault",
            "profiles": {**settings.profiles, "typed": hosted},
        })  # fmt: skip
        dying = WorkerFleet(own, 1, tmp_path, name="dying")
        coord = Coordinator(own)
        try:
            dying.wait_ready()
            task = coord.create_task("Count the rows.", profile="typed", run=True)

            def answered_once() -> bool:
                kept = [m for m in coord.messages(task.id, "api") if m.get("kind") == "response"]
                return len(kept) == 1 and len(server.seen) == 1

            helpers.eventually(answered_once, "the invalid answer answered and kept", timeout_s=60)
            time.sleep(ANSWER_S / 4)  # its run is asking again now: the request waits on its answer
            assert len(server.seen) == 1
            dying.procs[0].kill()
            dying.procs[0].wait(timeout=30)
            with dedicated_fleet(own, tmp_path / "rescuer", 1, queue="subq-trescue"):
                done = coord.wait(task.id, 90)
        finally:
            dying.stop()
            coord.close()
    assert done.status == TaskStatus.COMPLETED, (done.error_class, done.error)
    assert done.output == VALID and done.invalid_outputs == 1
    assert len(_says(coord, task.id, "output_invalid")) >= 1
    # The rescuer's request carries the errors of the answer the dead worker's run never answered.
    resumed = json.dumps(server.answered()[-1].body["messages"])
    assert all(json.dumps(error)[1:-1] in resumed for error in errors), resumed
    # And its journal keeps the request that asked again, with its answer: counted as the bound's, and never a
    # call without its result, which a later resume would send (a provider answers that with a 400).
    kept = coord.messages(task.id, "api")
    kinds = [m.get("kind") for m in kept]
    assert kinds[:4] == ["request", "response", "request", "response"], kinds  # then the completion's return
    assert any(json.dumps(error)[1:-1] in json.dumps(kept[2]) for error in errors), kept[2]


def test_a_models_key_with_a_line_break_cannot_make_a_line_of_its_own_in_an_error() -> None:
    """An output's keys are the model's: one with a line break, named in an error's path, would forge a line
    where the error is shown (`subq status`, `subq tree`); it is written as its JSON string."""
    schema = {"type": "object", "patternProperties": {".*": {"type": "integer"}}}
    (error,) = output_errors(schema, {"k\n  total: 0 tokens  $0.00": "s"})
    assert "\n" not in error and error.startswith('data."k\\n  total: 0 tokens  $0.00": '), error

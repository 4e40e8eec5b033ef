"""One input model per operation (coordinator/inputs.py), shared by the HTTP API, `subq.submit` and the CLI.

The API reads its request bodies with the models; a malformed input sent over the
API, to `subq.submit` by name (a plain Celery producer, a real worker) and on the
command line (over Redis and through the API) is refused with the same code,
message and field, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from celery import Celery

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.inputs import (
    CancelInput,
    CreateTaskInput,
    DecisionInput,
    DelegateInput,
    RetryInput,
    SubmitInput,
    TodosInput,
)
from tests.helpers import Transport, api_settings, state
from tests.test_bad_input import NO_TREE
from tests.test_cli import cli

RESULT_TIMEOUT_S = 30


def test_the_api_reads_its_bodies_with_the_operations_inputs(settings: Settings) -> None:
    document = create_app(coordinator=Coordinator(api_settings(settings))).openapi()

    def model_of(schema: dict[str, Any]) -> str:
        # An optional body (retry's: none retries the task alone) is `anyOf` its model and null.
        return str(schema.get("$ref") or next(s["$ref"] for s in schema["anyOf"] if "$ref" in s))

    bodies = {
        (method.upper(), path): model_of(operation["requestBody"]["content"]["application/json"]["schema"])
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
        if "requestBody" in operation
    }
    assert bodies == {
        ("POST", "/v1/tasks"): f"#/components/schemas/{CreateTaskInput.__name__}",
        ("POST", "/v1/tasks/{task_id}/subtasks"): f"#/components/schemas/{DelegateInput.__name__}",
        ("PUT", "/v1/tasks/{task_id}/todos"): f"#/components/schemas/{TodosInput.__name__}",
        ("POST", "/v1/tasks/{task_id}/cancel"): f"#/components/schemas/{CancelInput.__name__}",
        ("POST", "/v1/tasks/{task_id}/retry"): f"#/components/schemas/{RetryInput.__name__}",
        ("POST", "/v1/approvals/{approval_id}"): f"#/components/schemas/{DecisionInput.__name__}",
    }
    # subq.submit's root is the API's root: the same fields, the same schema.
    create, submit = (model.model_json_schema()["properties"] for model in (CreateTaskInput, SubmitInput))
    for name in ("prompt", "todos", "profile", "idempotency_key"):
        assert submit[name] == create[name], name


@pytest.fixture(scope="module")
def producer(settings: Settings) -> Iterator[Celery]:
    """A Celery client that knows only the task name, as a producer in any language would."""
    client = Celery("any-producer", broker=settings.redis_url, backend=settings.redis_url)
    yield client
    client.close()


# (input, message, field, the `subq` command that sends it, if one can)
MALFORMED: list[tuple[dict[str, Any], str, str, list[str] | None]] = [
    # The service's words: the model runs its check (the API used to say "String should have at least 1 character").
    ({"prompt": ""}, "prompt must be a non-empty string", "prompt", ["run", ""]),
    # pydantic's words, as the API has always said them (subq.submit used to word these its own way).
    ({"prompt": "p", "colour": "red"}, "colour: Extra inputs are not permitted", "colour", None),
    ({"prompt": "p", "run": "yes"}, "run: Input should be a valid boolean", "run", None),
    ({"prompt": ["p"]}, "prompt: Input should be a valid string", "prompt", None),
]


@pytest.mark.parametrize(("given", "message", "field", "command"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_one_malformed_input_gets_one_error_over_the_api_subq_submit_and_the_cli(
    settings: Settings,
    coordinator: Coordinator,
    live_http: httpx.Client,
    producer: Celery,
    transport: Transport,
    given: dict[str, Any],
    message: str,
    field: str,
    command: list[str] | None,
) -> None:
    error = {"code": "invalid_input", "message": message, "field": field}
    before = state(coordinator, NO_TREE)[0]  # no root created, nothing else of subq's touched

    over_http = live_http.post("/v1/tasks", json=given)
    assert (over_http.status_code, over_http.json()) == (422, error)

    sent = producer.send_task("subq.submit", kwargs=given, queue=settings.queue)
    try:
        assert sent.get(timeout=RESULT_TIMEOUT_S) == {"error": error}
    finally:
        sent.forget()

    if command is not None:
        proc = cli(*command, env=transport.env(settings))
        assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (1, f"subq: {message}", "")

    assert state(coordinator, NO_TREE)[0] == before, "a refused input changed Redis"


def test_a_fan_out_past_any_limit_is_refused_before_its_specs_are_read() -> None:
    """SUBQ_MAX_FANOUT's own bound is counted as the list is read: 20,000 specs, each with an output schema whose
    patterns RE2 compiles, were all checked before the service's count refused them (`subq.submit` has no body
    limit)."""
    from coordinator import ValidationError
    from coordinator.inputs import MAX_SUBTASKS, SubmitInput

    spec = {"description": "d", "message": "m", "output_schema": {"type": "object", "properties": {}}}
    with pytest.raises(ValidationError) as refused:
        SubmitInput.parse({"prompt": "p", "subtasks": [spec] * (2 * MAX_SUBTASKS)})
    assert refused.value.field == "subtasks"
    assert f"at most {MAX_SUBTASKS} items" in str(refused.value)

"""Schema fuzzing: schemathesis generates requests from the served OpenAPI document.

A real uvicorn server on 127.0.0.1 with real Redis; its Coordinator publishes
to a queue nobody consumes (`run: true` and delegations are only queued) and
keeps its keys under a prefix of its own, removed afterwards. Every generated
request, valid or not, must get no 5xx and an answer that the document
declares: its status, content type and body schema; invalid input must be
refused with a 4xx, and every /v1 operation must refuse a request without
the token.

Each operation is fuzzed with schema-valid and schema-invalid data, on made-up
ids and (for the /v1/tasks/{task_id} operations) on a real task, so the body
validators behind the id lookup are reached too. Bounded for CI: a few dozen
examples per case, each request with a deadline.

(schemathesis's own pytest loader, `schemathesis.pytest.from_fixture`, fails
under pytest 9 in schemathesis 4.32: it reads `request.node._nodeid`. The
operations are driven with `operation.as_strategy()` and Hypothesis instead.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from tests.helpers import AUTH, ApiServer, api_settings

# Examples per case: enough to reach each field and validator, few enough for the
# whole file to stay within a minute on a CI machine.
MAX_EXAMPLES = 25
# A request's bound, hypothesis's deadline and the client's timeout: what is checked is each answer, not its speed;
# 5 s was missed once on a 2-core host beside two busy loops and the rest of the suite (a ReadTimeout).
REQUEST_DEADLINE_MS = 30_000
FUZZ_PREFIX = "subqfuzz"
FUZZ_QUEUE = "subq-fuzz"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]
OPERATIONS = [
    "POST /v1/tasks",
    "GET /v1/tasks",
    "GET /v1/tasks/{task_id}",
    "POST /v1/tasks/{task_id}/subtasks",
    "GET /v1/tasks/{task_id}/todos",
    "PUT /v1/tasks/{task_id}/todos",
    "GET /v1/tasks/{task_id}/tree",
    "GET /v1/tasks/{task_id}/finishing",
    "GET /v1/tasks/{task_id}/messages",
    "GET /v1/tasks/{task_id}/events",
    "POST /v1/tasks/{task_id}/cancel",
    "POST /v1/tasks/{task_id}/retry",
    "GET /v1/tasks/{task_id}/snapshot",
    "GET /v1/tasks/{task_id}/deliveries",
    "POST /v1/tasks/{task_id}/deliveries/{delivery_id}/redeliver",
    "GET /v1/approvals",
    "POST /v1/approvals/{approval_id}",
    "GET /v1/dead-letters",
    "DELETE /v1/dead-letters",
    "GET /v1/audit",
    "GET /v1/tenants",
    "GET /healthz",
    "GET /livez",
    "GET /readyz",
    "GET /metrics",
]
ON_A_TASK = [label for label in OPERATIONS if "{task_id}" in label]
WITHOUT_INPUT = {
    "GET /healthz",
    "GET /livez",
    "GET /readyz",
    "GET /metrics",
    "DELETE /v1/dead-letters",
    "GET /v1/tenants",
}  # nothing to make invalid
MODES = {"valid": GenerationMode.POSITIVE, "invalid": GenerationMode.NEGATIVE}
MADE_UP = [
    (label, mode) for label in OPERATIONS for mode in MODES if not (mode == "invalid" and label in WITHOUT_INPUT)
]


@pytest.fixture(scope="module")
def fuzzed(settings: Settings) -> Iterator[tuple[Coordinator, ApiServer]]:
    coord = Coordinator(api_settings(settings, key_prefix=FUZZ_PREFIX, queue=FUZZ_QUEUE))
    with ApiServer(create_app(coordinator=coord)) as server:
        yield coord, server
    for key in [*coord.client.scan_iter(f"{FUZZ_PREFIX}:*"), FUZZ_QUEUE]:
        coord.client.delete(key)
    coord.close()


@pytest.fixture(scope="module")
def api_schema(fuzzed: tuple[Coordinator, ApiServer]) -> schemathesis.BaseSchema:
    _, server = fuzzed
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url)
    # A body over SUBQ_API_MAX_BODY_BYTES is refused with a 413 before it is parsed: invalid data refused too (a
    # string past its maxLength, a subtask's message of 200,001 characters, is over the 1 MiB once escaped).
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return schema


def _fuzz(schema: schemathesis.BaseSchema, label: str, mode: GenerationMode, task_id: str | None = None) -> None:
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    fixed = {"task_id": task_id} if task_id else None
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed)

    @given(case=strategy)
    @hypothesis_settings(
        max_examples=MAX_EXAMPLES,
        deadline=REQUEST_DEADLINE_MS,
        derandomize=True,  # the same examples on every run: a CI failure reproduces locally
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
    )
    def run(case: Case[Any]) -> None:
        case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=REQUEST_DEADLINE_MS / 1000)

    run()


def test_the_document_lists_every_fuzzed_operation(api_schema: schemathesis.BaseSchema) -> None:
    served = {result.ok().label for result in api_schema.get_all_operations() if isinstance(result, Ok)}
    assert all(isinstance(result, Ok) for result in api_schema.get_all_operations()), "the document is valid"
    assert served == set(OPERATIONS), "fuzz every operation the API serves"


@pytest.mark.parametrize(("label", "mode"), MADE_UP)
def test_made_up_ids(api_schema: schemathesis.BaseSchema, label: str, mode: str) -> None:
    _fuzz(api_schema, label, MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("label", ON_A_TASK)
def test_a_real_task(
    fuzzed: tuple[Coordinator, ApiServer], api_schema: schemathesis.BaseSchema, label: str, mode: str
) -> None:
    coord, _ = fuzzed
    # A fresh caller-owned task per case: its event stream ends at once, since
    # only this case could delegate from it (and then nothing runs the children).
    task = coord.create_task("a task to fuzz", todos="[ ] one\n[-] two")
    _fuzz(api_schema, label, MODES[mode], task.id)

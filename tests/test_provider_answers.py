"""What a real provider answers with a 200 that is not a whole answer, and a model that keeps calling wrongly.

Each test runs a task in this process against `tests/model_server.py` on loopback, through pydantic-ai's OpenAI
model, as a hosted endpoint or a gateway in front of one would answer:

- a 200 holding no answer (`choices: []`), a gateway's error object, or a body that is no JSON: waited out and
  sent again as a 5xx is, and to the next profile of the chain when it goes on (it failed the task at once);
- a final answer the provider cut (`finish_reason` "length" or "content_filter"): the task fails saying so,
  with the cut text kept (it ended `completed` with half an answer);
- an answer that reports no usage: priced by subq's estimate, the source saying so (it cost $0, unseen by
  every budget);
- a model whose calls of one tool fail several times in a row: the profile's `max_tool_retries` (default 3)
  before the task fails `ToolRetries` (pydantic-ai's default of 1 failed it at the second typo).
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.celery_app import make_app
from coordinator.models import TaskRecord
from coordinator.settings import Price, Profile
from tests.model_server import USAGE, ModelServer, Turn, call
from workers.runtime.context import build_runtime
from workers.runtime.runner import run_child

PRICE = Price(input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))
PRIMARY_MODEL, BACKUP_MODEL = "primary-model", "backup-model"
# What a gateway (OpenRouter's way) answers with a 200 when the model behind it failed.
GATEWAY_ERROR = {"error": {"message": "Upstream error from the provider", "code": 502}}
# A completion with no choices at all.
NO_CHOICES = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []}


def profile(server: ModelServer, model: str = PRIMARY_MODEL, **fields: object) -> Profile:
    return Profile.model_validate(
        {"model": f"openai:{model}", "base_url": server.base_url, "api_key": server.key, "price": PRICE, **fields}
    )


def run_task(
    settings: Settings, profiles: dict[str, Profile], prefix: str, prompt: str = "Look and report."
) -> tuple[TaskRecord, list[str]]:
    """One task of profile `main` run to its end in this process; its record, and its `wait_out` UI lines."""
    local = settings.model_copy(
        update={
            "queue": "subq-nobody",
            "key_prefix": f"subqanswers{prefix}",
            "profiles": {**settings.profiles, **profiles},
        }
    )
    coord = Coordinator(local)
    try:
        coord.client.delete("subq-nobody")
        task = coord.create_task(prompt, profile="main", run=True)
        run_child(build_runtime(local, make_app(local)), task.id)
        return coord.get_task(task.id), [m["text"] for m in coord.messages(task.id) if m.get("say") == "wait_out"]
    finally:
        coord.close()


def micros(responses: int) -> int:
    prompt, completion = USAGE
    return int(responses * (prompt * PRICE.input_per_mtok + completion * PRICE.output_per_mtok))


@pytest.mark.parametrize(
    ("body", "line"),
    [
        (
            {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []},
            "ModelEmptyResponseError",
        ),
        (GATEWAY_ERROR, "HTTP 502: Upstream error from the provider"),
        (b"<html>502 Bad Gateway</html>", "ModelInvalidResponseError: Failed to decode response as JSON"),
    ],
    ids=["no-choices", "gateway-error", "not-json"],
)
def test_a_200_without_a_usable_answer_is_waited_out_and_sent_again(
    settings: Settings, body: dict[str, object] | bytes, line: str
) -> None:
    with ModelServer([Turn(text="all done")]) as server:
        server.fail(200, times=2, body=body)
        done, waits = run_task(settings, {"main": profile(server, model_wait_out_s=60)}, "again")

    assert done.status == TaskStatus.COMPLETED and done.summary == "all done", done.error
    assert done.transient_errors == 2, "each unusable answer is a failed attempt, counted"
    assert len(waits) == 2 and all(w.startswith(line) and f"127.0.0.1:{server.port}" in w for w in waits), waits
    assert [s.status for s in server.seen] == [200, 200, 200] and len(server.answered()) == 1
    assert done.cost_micros == micros(1), "only the answer that came is billed"


def test_a_model_that_keeps_answering_unusable_200s_falls_back_to_the_next_profile(settings: Settings) -> None:
    with ModelServer([Turn(text="all done")]) as server:
        server.fail(200, body=GATEWAY_ERROR, model=PRIMARY_MODEL)  # for good
        done, waits = run_task(
            settings,
            {
                "main": profile(server, fallback_profiles=["backup"], model_wait_out_s=60),
                "backup": profile(server, BACKUP_MODEL),
            },
            "fallback",
        )
    assert done.status == TaskStatus.COMPLETED and done.summary == "all done", done.error
    assert [s.model for s in server.answered()] == [BACKUP_MODEL]
    assert done.cost_source == f"profile price (fallback: profile 'backup', openai:{BACKUP_MODEL})"


def test_a_gateways_refusal_sent_with_a_200_fails_at_once_as_the_4xx_it_is(settings: Settings) -> None:
    """A gateway's error object with a 4xx `code` (a moderation refusal, a prompt past the window) in a 200: taken
    for a transient error, it was sent again for the whole wait-out and its model marked down for the fleet."""
    refusal = {"error": {"message": "Input flagged by moderation", "code": 403, "type": "moderation"}}
    with ModelServer([Turn(text="all done")]) as server:
        server.fail(200, body=refusal)  # for good
        done, waits = run_task(settings, {"main": profile(server, model_wait_out_s=60)}, "refused")
    assert done.status == TaskStatus.FAILED and done.transient_errors == 0 and waits == [], done
    assert done.error is not None and done.error.startswith("HTTP 403 moderation: Input flagged by moderation")
    assert len(server.seen) == 1, "sent once"


def test_unusable_200s_past_the_wait_out_fail_with_one_line_that_says_where(settings: Settings) -> None:
    with ModelServer([Turn(text="all done")]) as server:
        server.fail(200, body=NO_CHOICES)  # for good
        done, waits = run_task(settings, {"main": profile(server, model_wait_out_s=1)}, "giveup")
    assert done.status == TaskStatus.FAILED and done.error_class == "ModelEmptyResponseError"
    assert done.error is not None and "\n" not in done.error
    assert done.error.startswith("ModelEmptyResponseError: Empty response from openai chat completions endpoint")
    assert f"endpoint 127.0.0.1:{server.port}" in done.error and "gave up after" in done.error


@pytest.mark.parametrize(
    ("finish", "error_class", "says"),
    [
        ("length", "OutputTruncated", "cut at its output token limit (finish_reason 'length')"),
        ("content_filter", "ContentFilter", "content filter cut the model's answer"),
    ],
)
def test_a_final_answer_its_provider_cut_fails_the_task_keeping_the_text(
    settings: Settings, finish: str, error_class: str, says: str
) -> None:
    turns = [
        Turn(calls=[call("update_todo_list", todos="[-] look")]),
        Turn(text="The first half of a rep", finish_reason=finish),
    ]
    with ModelServer(turns) as server:
        done, waits = run_task(settings, {"main": profile(server)}, f"cut{finish}")
    assert done.status == TaskStatus.FAILED and done.error_class == error_class, done
    assert done.error is not None and says in done.error
    assert done.summary == "The first half of a rep", "the cut text is kept on the record"
    assert done.cost_micros == micros(2), "both answers are billed"


def test_an_answer_without_usage_is_priced_by_an_estimate_that_says_so(settings: Settings) -> None:
    with ModelServer([Turn(text="all done", usage=False)]) as server:
        done, waits = run_task(
            settings, {"main": profile(server)}, "nousage", prompt="Look at the data and report. " * 40
        )
    assert done.status == TaskStatus.COMPLETED, done.error
    assert done.tokens_in > 300 // 4, "the prompt's estimate, at most four characters a token"
    assert done.tokens_out > 0
    expected = int(done.tokens_in * PRICE.input_per_mtok + done.tokens_out * PRICE.output_per_mtok)
    assert done.cost_micros == expected > 0
    assert done.cost_source == "profile price (estimated: the answer reported no usage)"


def test_a_tools_failed_calls_are_answered_up_to_max_tool_retries_in_a_row(settings: Settings) -> None:
    """Three calls of a tool the task does not have, each answered with the error, then the answer: completed.
    pydantic-ai's own default (one retry) failed the task at the second."""
    typo = Turn(calls=[call("read_fiel", path="x")])
    with ModelServer([typo, typo, typo, Turn(text="all done")]) as server:
        done, waits = run_task(settings, {"main": profile(server)}, "typos")
    assert done.status == TaskStatus.COMPLETED and done.summary == "all done", done.error
    assert len(server.answered()) == 4


def test_a_tool_failing_more_often_in_a_row_than_the_profile_allows_fails_the_task_saying_why(
    settings: Settings,
) -> None:
    typo = Turn(calls=[call("read_fiel", path="x")])
    with ModelServer([typo, typo, typo, Turn(text="all done")]) as server:
        done, waits = run_task(settings, {"main": profile(server, max_tool_retries=1)}, "typosout")
    assert done.status == TaskStatus.FAILED and done.error_class == "ToolRetries", done
    assert done.error is not None
    assert done.error.startswith(
        "the model's calls of tool 'read_fiel' failed 2 times in a row (the profile's max_tool_retries is 1); the last: "
    ), done.error
    assert "read_fiel" in done.error.split("the last: ")[1], "the last error names what went wrong"
    assert len(server.answered()) == 2


def test_max_tool_retries_out_of_range_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"max_tool_retries\n  Input should be less than or equal to 100"):
        Profile.model_validate({"model": "offline", "max_tool_retries": 101})
    with pytest.raises(ValueError, match=r"max_tool_retries\n  Input should be greater than or equal to 0"):
        Profile.model_validate({"model": "offline", "max_tool_retries": -1})

"""The offline model, driven through real pydantic-ai Agent runs (they are local)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import (
    ModelConnectionError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelRequestTimeout,
    ModelServerError,
    ModelUnavailableError,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)

from coordinator.errors import ScriptError
from coordinator.settings import Profile
from workers.runtime.offline import (
    MAX_SUMMARY_CHARS,
    OfflineModel,
    Script,
    offline_model,
    parse_script,
    text_tokens,
)
from workers.runtime.providers import build_model


def scripted(steps: list[Any], task: str = "Check the build") -> str:
    """A task message whose subq-script block holds `steps`."""
    return f"{task}\n\n```subq-script\n{json.dumps({'steps': steps}, indent=2)}\n```\n"


def make_agent(calls: list[dict[str, Any]] | None = None) -> Agent[None, str]:
    """An agent on the offline model with two tools that record how they were called."""
    agent = Agent(offline_model(), system_prompt="You are a focused subagent.")
    seen = calls if calls is not None else []

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        seen.append({"tool": "add", "a": a, "b": b})
        return a + b

    @agent.tool_plain
    def lookup(q: str) -> str:
        """Look something up."""
        seen.append({"tool": "lookup", "q": q})
        return f"result for {q}"

    return agent


def responses(messages: list[ModelMessage]) -> list[ModelResponse]:
    return [m for m in messages if isinstance(m, ModelResponse)]


# --- step kinds ------------------------------------------------------------


def test_reply_step_is_the_output() -> None:
    result = make_agent().run_sync(scripted([{"reply": "All green."}]))
    assert result.output == "All green."
    (response,) = responses(result.all_messages())
    assert response.parts == [TextPart(content="All green.")]
    assert response.model_name == "offline"
    assert response.finish_reason == "stop"


def test_tool_call_step_calls_registered_tools_then_reply_step() -> None:
    calls: list[dict[str, Any]] = []
    steps = [
        {"tool_calls": [{"name": "add", "args": {"a": 2, "b": 3}}, {"name": "lookup", "args": {"q": "ci"}}]},
        {"reply": "Sum is 5."},
    ]
    result = make_agent(calls).run_sync(scripted(steps))

    # pydantic-ai runs the tool calls of one response concurrently, so they may run in
    # either order; each ran exactly once with its arguments. The order that is kept
    # (the calls in the response, their results sent back) is checked below.
    assert sorted(calls, key=lambda c: str(c["tool"])) == [
        {"tool": "add", "a": 2, "b": 3},
        {"tool": "lookup", "q": "ci"},
    ]
    assert result.output == "Sum is 5."
    first, second = responses(result.all_messages())
    assert [(p.tool_name, p.args, p.tool_call_id) for p in first.parts if isinstance(p, ToolCallPart)] == [
        ("add", {"a": 2, "b": 3}, "call_0_0"),
        ("lookup", {"q": "ci"}, "call_0_1"),
    ]
    assert first.finish_reason == "tool_call"
    assert second.parts == [TextPart(content="Sum is 5.")]
    # The tool results went back to the model under the ids it gave.
    returned = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [(p.tool_call_id, p.content) for p in returned] == [("call_0_0", 5), ("call_0_1", "result for ci")]


def test_fail_step_raises_a_non_transient_model_error_with_its_message() -> None:
    agent = make_agent()
    with pytest.raises(ModelRequestRejectedError) as caught:
        agent.run_sync(scripted([{"fail": "quota for the demo is used up"}]))
    assert str(caught.value) == "quota for the demo is used up"
    assert caught.value.model_name == "offline"
    # The runtime waits these out; a scripted failure must not be one of them.
    transient = (
        ModelRateLimitError,
        ModelUnavailableError,
        ModelServerError,
        ModelConnectionError,
        ModelRequestTimeout,
    )
    assert not isinstance(caught.value, transient)


def test_fail_after_a_tool_call_fails_on_the_second_request() -> None:
    calls: list[dict[str, Any]] = []
    with pytest.raises(ModelRequestRejectedError, match="second request fails"):
        make_agent(calls).run_sync(
            scripted([{"tool_calls": [{"name": "add", "args": {"a": 1, "b": 1}}]}, {"fail": "second request fails"}])
        )
    assert calls == [{"tool": "add", "a": 1, "b": 1}]


# --- usage -----------------------------------------------------------------


def test_script_usage_is_reported_with_cache_tokens_inside_input_tokens() -> None:
    steps = [
        {
            "tool_calls": [{"name": "add", "args": {"a": 1, "b": 2}}],
            "usage": {"input": 1000, "output": 500, "cache_write": 2000, "cache_read": 10000},
        },
        {"reply": "3", "usage": {"input": 7, "output": 1}},
    ]
    result = make_agent().run_sync(scripted(steps))
    first, second = responses(result.all_messages())

    assert first.usage.input_tokens == 13000
    assert first.usage.output_tokens == 500
    assert first.usage.cache_write_tokens == 2000
    assert first.usage.cache_read_tokens == 10000
    assert (second.usage.input_tokens, second.usage.output_tokens) == (7, 1)
    assert (second.usage.cache_read_tokens, second.usage.cache_write_tokens) == (0, 0)
    run = result.usage
    assert (run.input_tokens, run.output_tokens, run.requests) == (13007, 501, 2)


def test_estimated_usage_is_deterministic_and_grows_with_the_text() -> None:
    short = make_agent().run_sync("Summarise the log")
    again = make_agent().run_sync("Summarise the log")
    longer = make_agent().run_sync("Summarise the log\n" + "with a lot more context " * 40)

    (a,), (b,), (c,) = (responses(r.all_messages()) for r in (short, again, longer))
    assert (a.usage.input_tokens, a.usage.output_tokens) == (b.usage.input_tokens, b.usage.output_tokens)
    assert a.usage.input_tokens >= 1
    assert a.usage.output_tokens == text_tokens("Done: Summarise the log")
    assert c.usage.input_tokens > a.usage.input_tokens + 200
    assert a.usage.cache_read_tokens == a.usage.cache_write_tokens == 0


def test_a_step_without_usage_gets_an_estimate() -> None:
    result = make_agent().run_sync(scripted([{"tool_calls": [{"name": "lookup", "args": {"q": "x"}}]}]))
    first, _final = responses(result.all_messages())
    assert first.usage.input_tokens >= 1
    assert first.usage.output_tokens == text_tokens('lookup{"q":"x"}')


def test_estimate_tokens() -> None:
    assert text_tokens("") == 1
    assert text_tokens("abcd") == 1
    assert text_tokens("abcde") == 2
    assert text_tokens("x" * 400) == 100


# --- latency ---------------------------------------------------------------


def test_latency_is_awaited_so_runs_overlap() -> None:
    # Long enough that a loaded host's delays (well under a second) cannot pass for a second sleep.
    latency_ms = 1000
    message = scripted([{"reply": "slow", "latency_ms": latency_ms}])

    async def two_runs() -> list[str]:
        outputs = await asyncio.gather(make_agent().run(message), make_agent().run(message))
        return [r.output for r in outputs]

    asyncio.run(make_agent().run(scripted([{"reply": "warm"}])))  # the first run's one-off setup is not timed
    started = time.perf_counter()
    assert asyncio.run(two_runs()) == ["slow", "slow"]
    elapsed = time.perf_counter() - started
    assert elapsed >= latency_ms / 1000
    # Two blocking sleeps would take twice the latency.
    assert elapsed < 2 * latency_ms / 1000


# --- without a script, and after it -----------------------------------------


def test_without_a_script_the_reply_names_the_task() -> None:
    result = make_agent().run_sync("Write the release notes\nfor version 2")
    assert result.output == "Done: Write the release notes"


def test_a_long_first_line_is_shortened() -> None:
    result = make_agent().run_sync("word " * 100)
    assert result.output.startswith("Done: word word")
    assert result.output.endswith("…")
    assert len(result.output) == len("Done: ") + MAX_SUMMARY_CHARS


def test_after_the_last_step_the_model_gives_the_final_reply() -> None:
    result = make_agent().run_sync(scripted([{"tool_calls": [{"name": "lookup", "args": {"q": "a"}}]}], task="Find a"))
    assert result.output == "Done: Find a"
    assert len(responses(result.all_messages())) == 2


def test_script_only_message_says_done() -> None:
    result = make_agent().run_sync(scripted([], task=""))
    assert result.output == "Done."


# --- carrying the script across resumptions ---------------------------------


def test_the_script_continues_in_a_run_with_message_history() -> None:
    steps = [
        {"reply": "first"},
        {"tool_calls": [{"name": "add", "args": {"a": 4, "b": 4}}]},
        {"reply": "third"},
    ]
    calls: list[dict[str, Any]] = []
    first = make_agent(calls).run_sync(scripted(steps, task="Long job"))
    assert first.output == "first"

    # Persist and reload the history as the runtime does, and resume on a fresh model:
    # the step comes from the history, not from state kept in the model object.
    stored = ModelMessagesTypeAdapter.dump_json(first.all_messages())
    history = ModelMessagesTypeAdapter.validate_json(stored)
    second = make_agent(calls).run_sync("continue", message_history=history)
    assert second.output == "third"
    assert calls == [{"tool": "add", "a": 4, "b": 4}]

    third = make_agent(calls).run_sync("and again", message_history=second.all_messages())
    assert third.output == "Done: Long job"


def test_one_model_instance_serves_two_tasks_independently() -> None:
    model = OfflineModel()
    a = Agent(model).run_sync(scripted([{"reply": "a1"}, {"reply": "a2"}]))
    b = Agent(model).run_sync(scripted([{"reply": "b1"}]))
    assert (a.output, b.output) == ("a1", "b1")
    assert Agent(model).run_sync("next", message_history=a.all_messages()).output == "a2"


def test_a_streamed_run_plays_the_same_script() -> None:
    agent = make_agent()
    message = scripted([{"tool_calls": [{"name": "add", "args": {"a": 1, "b": 1}}]}, {"reply": "two"}])

    async def stream() -> str:
        async with agent.run_stream(message) as run:
            return await run.get_output()

    assert asyncio.run(stream()) == "two"


# --- parsing ---------------------------------------------------------------


def test_parse_script_returns_none_without_a_script_block() -> None:
    assert parse_script("Just do it") is None
    assert parse_script('```json\n{"steps": []}\n```') is None


def test_parse_script_reads_every_field() -> None:
    script = parse_script(
        scripted(
            [
                {"tool_calls": [{"name": "t", "args": {"k": [1, 2]}}], "usage": {"input": 1}, "latency_ms": 5},
                {"reply": ""},
                {"fail": "no"},
            ]
        ).replace("\n", "\r\n")
    )
    assert isinstance(script, Script)
    kinds = [step.kind for step in script.steps]
    assert kinds == ["tool_calls", "reply", "fail"]
    assert script.steps[0].tool_calls is not None and script.steps[0].tool_calls[0].args == {"k": [1, 2]}
    assert script.steps[0].usage is not None and script.steps[0].usage.output == 0
    assert script.steps[0].latency_ms == 5


@pytest.mark.parametrize(
    ("steps", "field", "message"),
    [
        (
            [{"reply": "x"}, {"reply": "y", "usage": {"input": -1}}],
            "script.steps.1.usage.input",
            "greater than or equal to 0",
        ),
        ([{"reply": "x", "usage": {"output": 1.5}}], "script.steps.0.usage.output", "valid integer"),
        ([{"reply": "x", "usage": {"output": "7"}}], "script.steps.0.usage.output", "valid integer"),
        (
            [{"reply": "x", "usage": {"tokens": 1}}],
            "script.steps.0.usage.tokens",
            "unknown key 'tokens' (allowed: input, output, cache_write, cache_read)",
        ),
        ([{"replyy": "x"}], "script.steps.0.replyy", "unknown key 'replyy'"),
        (
            [{"reply": "x", "fail": "y"}],
            "script.steps.0",
            "exactly one of reply, tool_calls or fail (got reply and fail)",
        ),
        ([{"usage": {"input": 1}}], "script.steps.0", "(got none)"),
        ([{"fail": "x", "usage": {"input": 1}}], "script.steps.0", "a fail step reports no usage"),
        ([{"tool_calls": []}], "script.steps.0.tool_calls", "at least 1 item"),
        ([{"tool_calls": [{"args": {}}]}], "script.steps.0.tool_calls.0.name", "Field required"),
        (
            [{"tool_calls": [{"name": "t", "arg": {}}]}],
            "script.steps.0.tool_calls.0.arg",
            "unknown key 'arg' (allowed: name, args)",
        ),
        ([{"reply": "x", "latency_ms": -5}], "script.steps.0.latency_ms", "greater than or equal to 0"),
        ([{"reply": "x", "latency_ms": 10**9}], "script.steps.0.latency_ms", "less than or equal to 600000"),
        (["reply"], "script.steps.0", "valid dictionary"),
    ],
)
def test_parse_errors_name_the_field(steps: list[Any], field: str, message: str) -> None:
    with pytest.raises(ScriptError) as caught:
        parse_script(scripted(steps))
    assert caught.value.field == field
    assert message in caught.value.message
    assert caught.value.message.startswith(f"invalid subq-script at {field}: ")


def test_unknown_top_level_key_and_missing_steps() -> None:
    with pytest.raises(ScriptError) as caught:
        parse_script('```subq-script\n{"steps": [], "stepz": []}\n```')
    assert caught.value.field == "script.stepz"
    with pytest.raises(ScriptError) as caught:
        parse_script("```subq-script\n{}\n```")
    assert caught.value.field == "script.steps"
    assert "Field required" in caught.value.message


def test_bad_json_names_the_line_of_the_block() -> None:
    with pytest.raises(ScriptError) as caught:
        parse_script('Task\n```subq-script\n{"steps": [\n  {"reply": "x"}\n  {"reply": "y"}\n]}\n```')
    assert caught.value.field == "script"
    assert caught.value.message == "subq-script block is not valid JSON: Expecting ',' delimiter (line 3)"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ('```subq-script\n{"steps": []}\n', "not closed"),
        ('```subq-script\n{"steps": []}\n```\n```subq-script\n{"steps": []}\n```', "2 subq-script blocks"),
        ("```subq-script\n```", "not valid JSON"),
    ],
)
def test_malformed_blocks(message: str, expected: str) -> None:
    with pytest.raises(ScriptError, match=expected) as caught:
        parse_script(message)
    assert caught.value.field == "script"


def test_a_malformed_script_fails_the_run_with_the_script_error() -> None:
    with pytest.raises(ScriptError) as caught:
        make_agent().run_sync(scripted([{"reply": "x", "usage": {"input": -1}}]))
    assert caught.value.field == "script.steps.0.usage.input"


def test_the_offline_profile_builds_the_offline_model() -> None:
    model = build_model(Profile())
    assert isinstance(model, OfflineModel)
    assert model.model_name == "offline"

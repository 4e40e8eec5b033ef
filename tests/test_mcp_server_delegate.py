"""Agents delegating to a subq fleet through /mcp (issue 41, point 5): a pydantic-ai agent given the endpoint as
an MCP toolset, and a subq agent on another fleet whose profile's `mcp_servers` entry points at this stack's /mcp.

Both run on the offline model, whose convention carries out a message that ends with `tool(key=value)` by that
call (docs/offline-model.md), against a real API, Redis and `celery worker` processes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import anyio
import pytest
from pydantic_ai import Agent

from coordinator import Coordinator, McpServer, Profile, Settings, TaskStatus
from coordinator.api import create_app
from coordinator.local.fleet import WorkerFleet
from tests.conftest import dedicated_fleet
from tests.helpers import ApiServer, api_settings
from tests.test_mcp_server import TOKENS, keys
from workers.runtime.offline import OfflineModel

# A task's id in a tool's answer: 16 hex digits for a root.
ROOT_ID = re.compile(r'"id": ?"([0-9a-f]{16})"')


@pytest.fixture(scope="module")
def stack(settings: Settings, workers: WorkerFleet) -> Iterator[tuple[Coordinator, ApiServer]]:
    coord = Coordinator(api_settings(settings, api_keys=keys()))
    with ApiServer(create_app(coordinator=coord)) as api:
        yield coord, api
    coord.close()


def delegated(coord: Coordinator, answer: str) -> str:
    """The root a run_task answer names, once it completed on this stack's fleet as the key `team`'s."""
    found = ROOT_ID.search(answer)
    assert found, answer
    record = coord.wait(found.group(1), 60)
    assert record.status == TaskStatus.COMPLETED and record.owner == "team", record
    return record.id


def test_a_pydantic_ai_agent_delegates_through_the_endpoint(stack: tuple[Coordinator, ApiServer]) -> None:
    # Imported here: pydantic_ai.mcp (with fastmcp's client) costs 1.3 s of CPU to import, paid by every
    # pytest-xdist worker that collects this file otherwise (issue 43).
    from pydantic_ai.mcp import MCPToolset

    coord, api = stack
    fleet = MCPToolset(f"{api.url}/mcp", headers={"Authorization": f"Bearer {TOKENS['team']}"})
    agent = Agent(OfflineModel(), toolsets=[fleet])

    async def main() -> str:
        async with agent:
            result = await agent.run('Hand the haiku to the fleet: run_task(prompt="Write a haiku about queues")')
        return str(result.output)

    answer = anyio.run(main)
    assert answer.startswith("Done: run_task returned"), answer
    root = delegated(coord, answer)
    assert coord.get_task(root).prompt == "Write a haiku about queues"


def test_a_subq_agent_delegates_to_another_fleet(
    stack: tuple[Coordinator, ApiServer], settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Fleet B's profile `delegator` offers fleet A's tools (its /mcp, prefixed `fleet`): a task there hands work on."""
    coord, api = stack
    entry = McpServer(
        name="fleet", url=f"{api.url}/mcp", headers={"Authorization": f"Bearer {TOKENS['team']}"}, prefix="fleet"
    )
    profiles = {**settings.profiles, "delegator": Profile(mcp_servers=[entry])}
    with dedicated_fleet(
        settings, tmp_path_factory.mktemp("fleet-b"), 1, queue="subq-mcp-fleet-b", profiles=profiles
    ) as (fleet_b, _workers):
        prompt = 'Hand the summary to fleet A: fleet_run_task(prompt="Summarise the Q3 feedback")'
        task = fleet_b.create_task(prompt, profile="delegator", run=True)
        done = fleet_b.wait(task.id, 60)
        assert done.status == TaskStatus.COMPLETED, done.error
        assert done.summary.startswith("Done: fleet_run_task returned"), done.summary
        root = delegated(coord, done.summary)
    assert coord.get_task(root).prompt == "Summarise the Q3 feedback"

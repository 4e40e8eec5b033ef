"""A run's agent holds the capabilities a bare pydantic-ai agent holds, no more (workers/runtime/runner.py,
`_RunChecks`): pydantic-ai copies the run's context for each capability at each of some 30 hook points a step,
so subq's three hooks ride on the pending-message drain every agent is given, not on a capability of their own.
Pure logic: the hooks' effects are tested where they act (tests/test_typed_results.py, tests/test_batched_calls.py).
"""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.capabilities._ordering import collect_leaves
from pydantic_ai.capabilities._pending_messages import PendingMessageDrainCapability
from pydantic_ai.models.test import TestModel

from coordinator import Settings
from workers.runtime.profile_tools import load_profile
from workers.runtime.runner import _RunChecks, build_agent


def leaf_types(agent: object) -> list[type[object]]:
    root = getattr(agent, "_root_capability")  # noqa: B009 (pydantic-ai's own, not typed as public)
    return [type(leaf) for leaf in collect_leaves(root)]


def test_subqs_agent_holds_as_many_capabilities_as_a_bare_one_and_its_drain_is_subqs() -> None:
    settings = Settings()
    ours = leaf_types(build_agent(load_profile(settings.default_profile, settings), False))
    bare = leaf_types(Agent(TestModel()))
    assert len(ours) == len(bare)
    assert ours.count(_RunChecks) == 1
    assert sum(issubclass(kind, PendingMessageDrainCapability) for kind in ours) == 1

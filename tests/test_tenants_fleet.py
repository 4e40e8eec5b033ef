"""A tenant's day of spend on real `celery worker` processes (issue 42, point 4's acceptance).

Keys a1 and a2 of tenant `acme` and key b (its own tenant) in a keys file; acme's
`max_cost_usd_per_day` is $0.05. A running acme tree whose spend crosses it stops as a budget
stop does, naming the tenant's quota; acme's next submit is then a 429 naming the tenant, the
quota and when it resets, and b's is accepted. Each step of the offline model costs $0.021
(tests/agents.py), so the third response crosses $0.05.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from coordinator import Coordinator, Settings, TaskStatus
from coordinator.access import token_sha256
from coordinator.api import create_app
from coordinator.client import SubqClient
from coordinator.errors import QuotaExceeded
from coordinator.tenants import TenantPolicy
from tests.agents import STEP_COST_MICROS, agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import REQUEST_TIMEOUT_S, ApiServer

PREFIX = "subqtenantfleet"
TOKEN_A1, TOKEN_A2, TOKEN_B = "fleet-a1-" + "y" * 20, "fleet-a2-" + "y" * 20, "fleet-b-" + "y" * 20
QUOTA_MICROS = 50_000
WAIT_S = 120


@pytest.fixture(scope="module")
def fleet(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    folder = tmp_path_factory.mktemp("tenant-fleet")
    keys = folder / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "a1": {"token_sha256": token_sha256(TOKEN_A1), "scopes": ["submit", "read"], "tenant": "acme"},
                "a2": {"token_sha256": token_sha256(TOKEN_A2), "scopes": ["submit", "read"], "tenant": "acme"},
                "b": {"token_sha256": token_sha256(TOKEN_B), "scopes": ["submit", "read"]},
            }
        )
    )
    with dedicated_fleet(
        settings,
        folder,
        1,
        key_prefix=PREFIX,
        queue="subq-tenant-fleet",
        api_keys_file=keys,
        tenants={"acme": TenantPolicy(max_cost_micros_per_day=QUOTA_MICROS)},
    ) as (coord, _workers):
        yield coord
        for key in coord.client.scan_iter(f"{PREFIX}:*"):
            coord.client.delete(key)


def test_a_running_tree_crossing_its_tenants_day_stops_and_the_next_submit_is_a_429(
    fleet: Coordinator,
) -> None:
    spender = agent(*[call("update_todo_list", todos=f"[-] step {n}") for n in range(6)], reply("spent it all"))
    with ApiServer(create_app(fleet.settings, coordinator=fleet)) as api:
        with SubqClient(api.url, token=TOKEN_A1) as a1:
            root = a1.create_task("acme's tree", todos="[ ] spend")
            assert root.tenant == "acme"
            (child,) = a1.delegate(root.id, [{"description": "spender", "message": spender}]).child_ids
        done = fleet.wait(root.id, WAIT_S)
        assert done.status == TaskStatus.FAILED and done.error_class == "TenantQuotaExceeded", done.error
        assert "tenant 'acme' quota max_cost_usd_per_day of $0.050000 reached" in done.error
        spent = fleet.get_task(child)
        assert spent.status == TaskStatus.CANCELLED and "max_cost_usd_per_day" in spent.error
        assert QUOTA_MICROS <= done.total_cost_micros <= QUOTA_MICROS + STEP_COST_MICROS, "one request past it"

        # acme's next submit, from its other key, is refused naming the tenant's quota; b's is accepted.
        refused = httpx.post(
            f"{api.url}/v1/tasks",
            json={"prompt": "more"},
            headers={"Authorization": f"Bearer {TOKEN_A2}"},
            timeout=REQUEST_TIMEOUT_S,
        )
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert body["code"] == "quota_exceeded" and body["field"] == "max_cost_usd_per_day"
        assert "tenant 'acme' spent $0.063000 in the last 24 h" in body["message"]
        assert int(refused.headers["Retry-After"]) > 3600 * 23
        with SubqClient(api.url, token=TOKEN_A2) as a2, pytest.raises(QuotaExceeded) as caught:
            a2.create_task("more")
        same = caught.value.message.split("; it resets")[0]
        assert same == body["message"].split("; it resets")[0], "the same text on every face (the reset moves on)"
        assert caught.value.retry_after_s > 3600 * 23
        with SubqClient(api.url, token=TOKEN_B) as b:
            assert b.create_task("b's", run=True).tenant == "b"

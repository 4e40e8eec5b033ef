"""What a caller's delegation commit costs: wall time on the caller, and the Redis server's CPU, per delegation.

    python bench/caller_delegation.py [--delegations 300] [--children 2]

A caller's task (one an external service holds, not an agent's run) delegating is one WATCH/MULTI
transaction (store/delegation.py); its `wait:children` mark is the one timeline mark a Python transaction
writes, sent as mark_timeline.lua by its text inside the MULTI (docs/architecture.md, "Where the time
went"). This makes `--delegations` caller parents on a private Redis, each delegating `--children`
children to a queue no worker reads, and prints the median and the 90th percentile of `delegate()`'s
wall time, the server's CPU (INFO cpu, user + sys) per delegation, and the server's own time for each
EVAL (INFO commandstats: only the mark is sent so). It also prints the medians of `delegate()`'s two
parts, its commit (the transaction) and its publish: a wide delegation's first child starts only after
the commit and its first messages (docs/architecture.md, Known gaps). Run it from two checkouts to
compare them; docs/benchmarks.md has figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import Coordinator, Settings, delegation  # noqa: E402
from coordinator.local.embedded_redis import local_redis  # noqa: E402

# Enough delegations that the server's CPU counters (ms resolution) move by hundreds of ms.
DEFAULT_DELEGATIONS = 300
DEFAULT_CHILDREN = 2
# Delegations made first and not counted: the scripts' first calls, the pools' first connections.
WARM_UP = 20


def _server_cpu_s(coord: Coordinator) -> float:
    info = coord.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delegations", type=int, default=DEFAULT_DELEGATIONS)
    parser.add_argument("--children", type=int, default=DEFAULT_CHILDREN)
    given = parser.parse_args()
    with local_redis() as url:
        coord = Coordinator(Settings(redis_url=url, key_prefix="subqbench", queue="subq-bench-nobody"))
        specs = [{"description": f"child {n}", "message": "hello"} for n in range(given.children)]
        parents = [coord.create_task(f"parent {n}", todos="[ ] x") for n in range(WARM_UP + given.delegations)]
        for parent in parents[:WARM_UP]:
            coord.delegate(parent.id, specs)
        walls_ms: list[float] = []
        commits_ms: list[float] = []
        cpu_before = _server_cpu_s(coord)
        for parent in parents[WARM_UP:]:
            # delegate() as Coordinator.delegate runs it, its commit timed apart from its publish.
            started = time.perf_counter()
            batch, children = delegation.commit(coord.plane, parent.id, specs)
            committed = time.perf_counter()
            delegation.publish(coord.plane, batch, children)
            walls_ms.append((time.perf_counter() - started) * 1000)
            commits_ms.append((committed - started) * 1000)
        cpu_ms = (_server_cpu_s(coord) - cpu_before) * 1000 / given.delegations
        # The mark's script (EVAL: nothing else a caller's delegation sends is one), in the server's own time.
        evals = coord.client.info("commandstats").get("cmdstat_eval", {"calls": 0, "usec_per_call": 0.0})
        coord.close()
    publishes_ms = [wall - commit for wall, commit in zip(walls_ms, commits_ms, strict=True)]  # before the sort
    walls_ms.sort()
    p90 = walls_ms[int(0.9 * (len(walls_ms) - 1))]
    print(
        f"{given.delegations} caller delegations of {given.children} children: delegate() median "
        f"{statistics.median(walls_ms):.2f} ms, p90 {p90:.2f} ms; Redis CPU {cpu_ms:.3f} ms a delegation; "
        f"EVAL {evals['calls']} calls, {float(evals['usec_per_call']):.1f} us a call"
    )
    print(
        f"of which: commit median {statistics.median(commits_ms):.2f} ms, publish {statistics.median(publishes_ms):.2f} ms"
    )


if __name__ == "__main__":
    main()

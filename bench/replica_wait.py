"""What `WAIT` costs a step a caller sees: submits and cancels with SUBQ_REDIS_MIN_REPLICAS 0 and 1.

    .venv/bin/python -m bench.replica_wait [--submits 400] [--cancels 200] [--rounds 3]

Starts a Redis Sentinel set on 127.0.0.1 (a master, two replicas, three sentinels: the
tests' `tests/sentinel_kit.py`), then times, on the same set and alternately, submits (a
transaction: WAIT after its EXEC) and cancels (a script: WAIT in its round trip) of a
Coordinator without WAIT and one with WAIT 1. Prints the median over the rounds of each
figure (docs/deploy.md, "Acknowledged means replicated").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from coordinator import Coordinator, Settings
from tests.sentinel_kit import sentinel_set

WARM_UP = 20


def _step_ms(coord: Coordinator, submits: int, cancels: int) -> tuple[float, float]:
    for _ in range(WARM_UP):
        coord.create_task("warm-up")
    started = time.perf_counter()
    for _ in range(submits):
        coord.create_task("a submit")
    submit_ms = (time.perf_counter() - started) / submits * 1000
    roots = [coord.create_task("to cancel").id for _ in range(cancels)]
    started = time.perf_counter()
    for root in roots:
        coord.cancel(root, "bench")
    return submit_ms, (time.perf_counter() - started) / cancels * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--submits", type=int, default=400)
    parser.add_argument("--cancels", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    figures: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="subq-bench-") as workdir, sentinel_set(Path(workdir)) as kit:
        for _ in range(options.rounds):
            for replicas in figures:
                settings = kit.settings(
                    Settings(), key_prefix=f"benchwait{replicas}", queue="bench-nobody", redis_min_replicas=replicas
                )
                coord = Coordinator(settings)
                try:
                    figures[replicas].append(_step_ms(coord, options.submits, options.cancels))
                finally:
                    coord.close()
    for replicas, rounds in figures.items():
        submit = statistics.median(s for s, _ in rounds)
        cancel = statistics.median(c for _, c in rounds)
        print(
            f"SUBQ_REDIS_MIN_REPLICAS={replicas}: submit {submit:.3f} ms, cancel {cancel:.3f} ms (median of {len(rounds)})"
        )


if __name__ == "__main__":
    main()

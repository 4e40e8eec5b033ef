"""One sandboxed command with a given network, start to end: what a sandbox's network costs a command.

    python bench/sandbox_start.py none|public|hosts

Runs `true` through `commands.run` (the path a worker's run_command takes) in a temporary folder, with
`network = false`, `true` or `["packages.example.net"]`, and fails if it did not exit 0. Time it as a whole process,
paired against `none`, e.g. `hyperfine -N 'python bench/sandbox_start.py none' 'python bench/sandbox_start.py
public'`; docs/architecture.md ("A sandbox's network") gives the figures.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator import RunCommand  # noqa: E402
from workers.runtime import commands  # noqa: E402

NETWORKS: dict[str, bool | list[str]] = {"none": False, "public": True, "hosts": ["packages.example.net"]}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in NETWORKS:
        print(f"usage: sandbox_start.py {'|'.join(NETWORKS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        config = RunCommand(cwd=Path(folder), network=NETWORKS[sys.argv[1]])
        result = asyncio.run(commands.run("true", config))
    if result.exit_code != 0:
        print(result.text(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What tests/test_mcp.py's profiles use beside a real MCP server (mcp-server-git).

`server` is the command line of mcp-server-git started through `sh`, which
first appends the server's pid to a file (`exec` keeps the pid), so a test
counts the server processes a worker started and kills one. `kill_server` is a
profile tool that kills the newest of them from inside a run: the run's next
call finds its server gone.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from pathlib import Path

# How long a test's mcp-server-git may take to start, answer `initialize` and list its tools (its
# `timeout_s`): it imports for 3 to 12 s beside two busy loops on 2 cores (issue 43), past the
# product's 10-s default, which measures a server's own start on a host that is not this loaded.
START_S = 60.0


def server(pids: Path, repository: Path) -> tuple[str, list[str]]:
    """(command, args) that start mcp-server-git on `repository`, its pid appended to `pids` (give its
    McpServer `timeout_s=START_S`)."""
    line = f"echo $$ >> {shlex.quote(str(pids))}; exec {shlex.quote(sys.executable)} -m mcp_server_git"
    return "sh", ["-c", f"{line} --repository {shlex.quote(str(repository))}"]


def started(pids: Path) -> list[int]:
    """The pids of the servers started so far, oldest first."""
    return [int(line) for line in pids.read_text().split()] if pids.exists() else []


async def kill_server() -> str:
    """Kill the newest MCP server process of the file MCP_KIT_PIDS names (SIGKILL), and give its end a moment."""
    pid = started(Path(os.environ["MCP_KIT_PIDS"]))[-1]
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    return f"killed {pid}"

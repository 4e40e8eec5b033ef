"""Running one command line for the `run_command` tool, as a profile's `run_command` says (docs/control.md).

- **No shell.** The line is split into argv the way a POSIX shell splits words
  (`shlex.split`: quotes group, a backslash escapes, nothing is expanded) and the
  program is started with that list: `;`, `|`, `&&`, `>`, `$(...)` and `*` are plain
  arguments, never operators.
- **Where and how long.** It runs in the profile's `cwd`, with stdin empty, in a
  process group of its own (a new session). When it exits, the group is killed
  (whatever it left running in the background); after `timeout_s`, or when the run is
  cancelled, the whole group is killed at once.
- **Environment.** The worker's own, without any `SUBQ_*` variable (settings, the
  Redis URL, the profiles and their keys) and without the providers' key variables;
  PATH, HOME, LANG and the rest are kept.
- **Output.** stdout and stderr interleaved, as one pipe, decoded as UTF-8; the model
  reads at most `max_output_chars` of it: the beginning and the end, with how many
  characters were cut in between.
- **Confined.** Unless the profile says `sandbox = false`, it runs in the OS sandbox
  (workers/runtime/sandbox.py): only `cwd` and a private /tmp writable, subq's files
  hidden, no network unless `network = true`, processes, memory and CPU time capped. A
  program killed by a signal inside it reads as killed by that signal: the sandbox
  reports it as a shell does, exit 128 + the signal's number.

`run` is a coroutine for the worker's agent event loop: it never blocks the loop. A
program that cannot be started, an unbalanced quote or an empty line is a short error
result, not an exception; cancelling the coroutine kills the process group and re-raises.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from coordinator import STANDARD_KEYS, RunCommand
from workers.runtime import egress
from workers.runtime.sandbox import Sandbox

__all__ = ["MAX_COMMAND_CHARS", "CommandResult", "command_env", "parse", "run"]

# A command line longer than this is refused before anything else: commands a model writes
# are far shorter, and reading one (here and in the approval policy) happens on the agents'
# loop, in pure Python (shlex): 32 KiB is read in about a tenth of a second.
MAX_COMMAND_CHARS = 32_768
# After the program exits (or is killed), how long what it wrote may take to be read:
# the pipe closes when its group is gone; a process that left the group can hold it open.
DRAIN_S = 1.0
READ_CHUNK = 64 * 1024
# The command's UI message shows the end of its output (where errors usually are).
EXCERPT_CHARS = 300
# The sandbox exits 128 + N when its command was killed by signal N, as a shell reports it.
SIGNALLED_MIN = 128
MAX_SIGNAL = 64
# The providers' key variables: never passed to a command.
PROVIDER_KEYS = frozenset({"OPENAI_API_KEY", "ANTHROPIC_API_KEY", *STANDARD_KEYS.values()})
# Nor subq's settings, nor the trace exporter's (its headers carry the backend's key, its endpoint is internal).
WITHHELD_PREFIXES = ("SUBQ_", "OTEL_EXPORTER_OTLP_")


def parse(command: str) -> list[str]:
    """The argv of a command line; ValueError with a short reason when it has none."""
    if len(command) > MAX_COMMAND_CHARS:
        raise ValueError(f"the command is longer than {MAX_COMMAND_CHARS} characters")
    if "\0" in command:
        raise ValueError("the command contains a NUL character")
    try:
        argv = shlex.split(command)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise ValueError(f"cannot parse the command: {str(exc).lower()}") from None
    if not argv:
        raise ValueError("empty command")
    return argv


def command_env(environ: Mapping[str, str] | None = None, secrets: Iterable[str] = ()) -> dict[str, str]:
    """The environment a command runs with: this process's, less what holds a secret of subq's: SUBQ_*, the
    provider keys, the trace exporter's (`OTEL_EXPORTER_OTLP_HEADERS` carries a backend's key) and `secrets` (the
    variables a profile's MCP server reads). Names compared in any case, as the settings read them."""
    source = os.environ if environ is None else environ
    withheld = PROVIDER_KEYS | {name.upper() for name in secrets}
    return {
        k: v for k, v in source.items()
        if not k.upper().startswith(WITHHELD_PREFIXES) and k.upper() not in withheld
    }  # fmt: skip


@dataclass(frozen=True)
class CommandResult:
    """What became of one command line."""

    command: str
    exit_code: int | None = None  # None: it did not start, or it was killed at its timeout
    output: str = ""  # already capped; `cut` characters were left out in the middle
    cut: int = 0
    timed_out_after_s: float | None = None
    error: str | None = None  # it did not start: why
    refused: tuple[str, ...] = ()  # `host:port` of each connection the sandbox's proxy refused, in order

    @property
    def status(self) -> str:
        if self.error is not None:
            return f"Error: {self.error}"
        if self.timed_out_after_s is not None:
            return f"timed out after {self.timed_out_after_s:g}s (its process group was killed)"
        assert self.exit_code is not None
        if self.exit_code < 0:
            return f"killed by {_signal_name(-self.exit_code)}"
        return f"exit {self.exit_code}"

    def text(self) -> str:
        """The tool's result for the model: the status line, then the output."""
        return self.status if self.error is not None else f"{self.status}\n{self.output}"

    def excerpt(self) -> str:
        """The UI message: the status line and the end of the output."""
        tail = self.output if len(self.output) <= EXCERPT_CHARS else "…" + self.output[-EXCERPT_CHARS:]
        return f"{self.status}\n{tail}" if tail else self.status


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Capped:
    """Output kept within `limit` characters: its beginning and its end, and how much fell between."""

    def __init__(self, limit: int) -> None:
        self._tail_limit = limit // 2
        self._head_limit = limit - self._tail_limit
        self._head: list[str] = []
        self._head_len = 0
        self._tail = ""
        self._total = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        self._total += len(text)
        room = self._head_limit - self._head_len
        if room > 0 and text:
            self._head.append(text[:room])
            self._head_len += min(room, len(text))
            text = text[room:]
        if text and self._tail_limit:
            self._tail = (self._tail + text)[-self._tail_limit :]

    @property
    def cut(self) -> int:
        return self._total - self._head_len - len(self._tail)

    def text(self) -> str:
        middle = f"\n[... {self.cut} characters cut ...]\n" if self.cut else ""
        return "".join(self._head) + middle + self._tail


async def _drain(stream: asyncio.StreamReader, out: _Capped) -> None:
    while chunk := await stream.read(READ_CHUNK):
        out.feed(chunk)
    out.feed(b"", final=True)


async def _settle(proc: asyncio.subprocess.Process, reader: asyncio.Task[None]) -> None:
    """After the kill: reap the program and read what is left, for at most DRAIN_S (a process
    that left the group may hold the pipe open)."""
    try:
        await asyncio.wait_for(asyncio.gather(proc.wait(), reader), DRAIN_S)
    except TimeoutError:
        reader.cancel()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _cannot_start(program: str, cwd: Path, env: Mapping[str, str]) -> str | None:
    """Why `program` cannot start, looked up as the sandbox would (its PATH, or a path from cwd); None if it can."""
    if "/" not in program:
        return None if shutil.which(program, path=env.get("PATH", os.defpath)) else "program not found"
    path = cwd / program
    if not path.exists():
        return "program not found"
    return None if path.is_file() and os.access(path, os.X_OK) else "permission denied"


async def run(
    command: str, config: RunCommand, environ: Mapping[str, str] | None = None, sandbox: Sandbox | None = None
) -> CommandResult:
    """Run one command line as `config` says (see the module's docstring); `sandbox` names what it may not see."""
    try:
        argv = parse(command)
    except ValueError as exc:
        return CommandResult(command, error=str(exc))
    cwd = Path(config.cwd)
    if not cwd.is_dir():
        return CommandResult(command, error=f"the working directory {cwd} does not exist")
    env = command_env(environ, sandbox.secrets if sandbox is not None else ())
    confined = config.sandbox
    # Inside the sandbox a program that cannot start is the sandbox's own error: say it as unconfined.
    if confined and (why := _cannot_start(argv[0], cwd, env)):
        return CommandResult(command, error=f"{argv[0]}: {why}")
    # A proxied sandbox's refusals land in a folder of the worker's (the command's /tmp is its own).
    folder = Path(tempfile.mkdtemp(prefix="subq-command-")) if confined and isinstance(config.network, list) else None
    refusals = folder / "refused" if folder is not None else None
    try:
        if confined:
            argv = (sandbox or Sandbox()).wrap(argv, cwd, network=config.network, limits=config, refusals=refusals)
        result = await _run(command, argv, cwd, env, config, confined)
        if refusals is not None and refusals.exists():
            with refusals.open("rb") as written:  # bounded: the proxy writes at most egress.MAX_REFUSALS lines
                refused = tuple(
                    line for line in written.read(egress.MAX_REFUSALS_BYTES).decode(errors="replace").splitlines()
                )
            result = dataclasses.replace(result, refused=tuple(line for line in refused if line))
        return result
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


async def _run(
    command: str, argv: list[str], cwd: Path, env: Mapping[str, str], config: RunCommand, confined: bool
) -> CommandResult:
    """Start `argv` (the command, perhaps wrapped by the sandbox) and see it to its end."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            # Confined, the sandbox starts from / (bwrap's --chdir sets the command's own): what it starts on the host
            # (egress.py, pasta) then finds nothing the command could have written in its folder.
            cwd=Path("/") if confined else cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one
        )
    except FileNotFoundError:
        return CommandResult(command, error=f"{argv[0]}: program not found")
    except PermissionError:
        return CommandResult(command, error=f"{argv[0]}: permission denied")
    except OSError as exc:
        return CommandResult(command, error=f"{argv[0]}: cannot run it ({exc.strerror or exc})")
    assert proc.stdout is not None
    out = _Capped(config.max_output_chars)
    reader = asyncio.create_task(_drain(proc.stdout, out))
    timed_out = False
    try:
        try:
            async with asyncio.timeout(config.timeout_s):
                await proc.wait()
        except TimeoutError:
            timed_out = True
    except asyncio.CancelledError:  # the run was cancelled: the group goes with it
        _kill_group(proc.pid)
        await _settle(proc, reader)
        raise
    except BaseException:
        _kill_group(proc.pid)
        reader.cancel()
        raise
    _kill_group(proc.pid)  # on a timeout: all of it; else what it left running
    await _settle(proc, reader)
    code = proc.returncode
    if confined and code is not None and SIGNALLED_MIN < code <= SIGNALLED_MIN + MAX_SIGNAL:
        code = -(code - SIGNALLED_MIN)  # the sandbox's 128 + N: killed by signal N
    return CommandResult(
        command,
        exit_code=None if timed_out else code,
        output=out.text(),
        cut=out.cut,
        timed_out_after_s=config.timeout_s if timed_out else None,
    )

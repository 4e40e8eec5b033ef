"""subq's scripts as one Redis function library, on a server that has functions (Redis 7 and later).

A script sent by EVALSHA runs its whole text at every call: hashes.lua's helpers and every script
it uses are defined again (closures made, constant tables built) before its first line decides
anything. A library is run once, when it is loaded (`FUNCTION LOAD`), and keeps them: each of
subq's scripts is then one function of it, called by `FCALL`. That takes 6% off the instructions
of a child's two steps on Redis 7.0 (docs/benchmarks.md, "The steps as a function library").

The library is made of the same files as the scripts (`library_text`): hashes.lua, then every file
of lua/ as a local function of its name, in an order that keeps each script's `uses` before it,
then one registered function a standalone script, which empties hashes.lua's cache (its locals
outlive a call here), runs the script and sends its held writes (`hash_flush`), as the EVALSHA
form's last lines do. Its name is `subq_` and the first 16 hex digits of the text's SHA-1, and each
function's is the library's and the script's: two releases' libraries never clash, so a rolling
upgrade runs both.

`Library` loads it once a process, at the first step that asks, and says which function to call.
A server without functions (Redis 6.2: the embedded server, a replica of an older release), or
one that refuses FUNCTION to subq's user, answers so once, and the steps keep to EVALSHA. A
server that does not know the function (restarted from an old file, a replica promoted before the
load reached it, `FUNCTION FLUSH`) answers "Function not found": that call is sent again by its text
(EVAL), as a NOSCRIPT is, and the next step loads the library again.

Each load notes the library's name and time in the deployment's `<p>:libraries` hash; a load removes the
libraries that hash noted more than LIBRARY_KEEP_S ago (another release's, loaded by no process since).
A worker of that release still running loads its own again at its next step.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources

import redis

log = logging.getLogger(__name__)

# How long a library no process has loaded stays on the server: a week covers any rolling upgrade.
LIBRARY_KEEP_S = 7 * 24 * 3600
# What the server answers an FCALL it cannot run: a library it does not hold, or no FCALL at all (Redis 6.2).
_MISSING = ("Function not found", "unknown command 'FCALL'", "unknown command `FCALL`")


def lua_file(name: str) -> str:
    """One file of lua/, as written."""
    return resources.files("coordinator.store").joinpath("lua", name).read_text(encoding="utf-8")


def definition_order(uses: Mapping[str, Sequence[str]]) -> list[str]:
    """Every script named in `uses` (script -> the scripts it uses, in the order it defines them) once, each after
    every script it uses and after the ones defined before it there: one order every script's text agrees with."""
    after: dict[str, set[str]] = {}
    for script, used in uses.items():
        chain = [*used, script]
        for name in chain:
            after.setdefault(name, set())
        for earlier, later in itertools.pairwise(chain):
            after[later].add(earlier)
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(after):
        ready = sorted(name for name, before in after.items() if name not in placed and before <= placed)
        if not ready:
            raise ValueError(f"the scripts' uses order each other in a circle: {sorted(set(after) - placed)}")
        order += ready
        placed.update(ready)
    return order


def library_text(prelude: str, uses: Mapping[str, Sequence[str]], read: Callable[[str], str] = lua_file) -> tuple[
    str, dict[str, str]]:  # fmt: skip
    """The library of the standalone scripts `uses` names (script -> the scripts it uses), on `prelude`
    (hashes.lua as the EVALSHA form has it), and each script's function name. `read` gives a file's text."""
    body = "".join(
        f"local function {script}(KEYS, ARGV)\n{read(f'{script}.lua')}end\n" for script in definition_order(uses)
    )
    digest = hashlib.sha1((prelude + body + "".join(sorted(uses))).encode()).hexdigest()[:16]
    name = f"subq_{digest}"
    functions = {script: f"{name}_{script}" for script in uses}
    registered = "".join(
        f"redis.register_function('{function}', function(KEYS, ARGV)\n  hash_reset()\n"
        f"  local reply = {script}(KEYS, ARGV)\n  hash_flush()\n  return reply\nend)\n"
        for script, function in functions.items()
    )
    return f"#!lua name={name}\n{prelude}{body}{registered}", functions


def missing_function(error: redis.ResponseError) -> bool:
    """Whether the server could not run an FCALL (it holds no such library, or has no functions)."""
    return str(error).startswith(_MISSING)


class Library:
    """The scripts' library on one client's server: loaded at the first `function` asked, forgotten when the
    server says it does not hold it (`forget`), loaded again at the next ask."""

    def __init__(self, client: redis.Redis, text: str, functions: dict[str, str], noted_in: str) -> None:
        self.client = client
        self.text = text
        self.name = text.split("name=", 1)[1].split("\n", 1)[0]
        self.functions = functions
        self.noted_in = noted_in
        self._lock = threading.Lock()
        self._loaded: bool | None = None  # None: not asked yet, or forgotten; False: the server has no functions

    def function(self, script: str) -> str | None:
        """The function to FCALL for `script`, or None to send it by EVALSHA (no functions here, or the load
        could not reach the server: the call's own retry meets that)."""
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._load()
        return self.functions.get(script) if self._loaded else None

    def forget(self) -> None:
        """The server said it does not hold the library: the next `function` loads it again."""
        self._loaded = None

    def _load(self) -> bool | None:
        try:
            self.client.function_load(self.text)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.info("subq: the scripts' library was not loaded (%s); this step goes by EVALSHA", exc)
            return None
        except redis.ResponseError as exc:
            if isinstance(exc, redis.exceptions.NoPermissionError) or str(exc).startswith("unknown command"):
                # No functions (Redis 6.2), or not subq's user's to load: for good, in this process.
                log.info("subq: the server runs no functions for subq (%s); the steps go by EVALSHA", exc)
                return False
            if "already exists" not in str(exc):
                # A replica mid-failover (READONLY), a server still loading, out of memory: the next step tries again.
                log.warning("subq: the scripts' library was not loaded (%s); this step goes by EVALSHA", exc)
                return None
        self._tidy()
        return True

    def _tidy(self) -> None:
        """Note this library's load; remove the ones noted more than LIBRARY_KEEP_S ago. Best effort: a
        library left is memory, not state, and one removed early is loaded again by its next step."""
        now_s = time.time()
        try:
            self.client.hset(self.noted_in, self.name, int(now_s))
            noted = self.client.hgetall(self.noted_in)
            for name in stale(noted, now_s, self.name):
                try:
                    self.client.function_delete(name)
                except redis.ResponseError as exc:
                    if "not exist" not in str(exc):
                        raise
                self.client.hdel(self.noted_in, name)
                log.info("subq: removed the scripts' library %s, loaded by no process for a week", name)
        except redis.RedisError as exc:
            log.warning("subq: the scripts' old libraries were not tidied (%s)", exc)


def stale(noted: Mapping[bytes | str, bytes | str], now_s: float, own: str) -> Iterable[str]:
    """The libraries of `noted` (name -> the epoch second it was last loaded) older than LIBRARY_KEEP_S, not `own`."""
    for raw_name, raw_at in noted.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
        at = raw_at.decode() if isinstance(raw_at, bytes) else raw_at
        if name != own and name.startswith("subq_") and (not at.isdigit() or now_s - int(at) > LIBRARY_KEEP_S):
            yield name  # (a time that is not one was not written here: the library is removed)

"""subq's scripts as one Redis function library, on a server that has functions (Redis 7 and later).

A script sent by EVALSHA runs its whole text at every call: hashes.lua's helpers and every script
it uses are defined again (closures made, constant tables built) before its first line decides
anything. A library is run once, when it is loaded (`FUNCTION LOAD`), and keeps them: each of
subq's scripts is then one function of it, called by `FCALL`. That takes 5.5% off the instructions
of a child's two steps on Redis 7.0 (docs/benchmarks.md, "The steps as a function library").

The library is made of the same files as the scripts (`library_text`): hashes.lua, then every file
of lua/ as a local function of its name, in an order that keeps each script's `uses` before it,
then one registered function a standalone script, which empties hashes.lua's cache (`RESET_CACHE`:
its locals outlive a call here), runs the script and sends its held writes, as the EVALSHA form's
last lines do (`run_and_flush`). Its name is `subq_` and the first 16 hex digits of the SHA-1 of its
text (with the name left out), and each function's is the library's and the script's: two releases'
libraries never clash, so a rolling upgrade runs both.

`Library` loads it once a process, at the first step that asks, and says which function to call
(`function`), or None to send the script by EVALSHA:

- a server without functions (Redis 6.2: the embedded server), or one that refuses FUNCTION or FCALL to
  subq's user, or a library it will not compile: EVALSHA for good, in this process;
- a load refused for now (a replica mid-failover, out of memory, no replica to write to, a server
  loading its data) or one that could not reach the server: EVALSHA for LOAD_AGAIN_S, then a load again;
  one thread loads while the others' steps go by EVALSHA;
- an FCALL the server answers "Function not found" (restarted from an old file, a replica promoted before
  the load reached it, `FUNCTION FLUSH`) or refuses (out of memory, where a script by its text is checked
  only at its first write): nothing of that call ran, so it is sent again by its text (EVAL), as a
  NOSCRIPT is (`refused`), and a library not found is loaded again by the next step.

Each load notes the library's name and time in the deployment's `<p>:libraries` hash, and a process notes
it again every NOTE_EVERY_S; a load removes the libraries that hash noted more than LIBRARY_KEEP_S ago
(another release's, which no process noted since). A worker of that release still running (another
deployment's on the same server, say) loads its own again at its next step.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

import redis

log = logging.getLogger(__name__)

# How long a library no process has noted stays on the server: a week covers any rolling upgrade.
LIBRARY_KEEP_S = 7 * 24 * 3600
# How often a running process notes its library again, so that a fleet up for weeks keeps it.
NOTE_EVERY_S = 24 * 3600
# After a load refused for now, how long the steps go by EVALSHA before the next load.
LOAD_AGAIN_S = 5.0
# hashes.lua's cache, emptied at the start of each function: EVALSHA's form makes it anew at every call.
RESET_CACHE = "  hash_cache, hash_dirty, hash_order, hash_expire = {}, {}, {}, {}\n"
# What stands for the library's name in its text while the text is hashed.
_NAME = "@library@"
# An FCALL refused with nothing of it run, which the same script by its text may pass: no such library (loaded
# again), no right to FCALL or no FCALL at all (EVALSHA for good: `refused`), or out of memory (a function is
# refused before it runs; a script by its text only at its first write, so one that frees memory still runs).
_NOT_FOUND = ("Function not found",)
_NOT_ALLOWED = (redis.exceptions.NoPermissionError,)
_OUT_OF_MEMORY = (redis.exceptions.OutOfMemoryError,)
# A load refused for now: the next one, LOAD_AGAIN_S later, may pass.
_FOR_NOW = (
    redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError, redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError, redis.exceptions.MasterDownError,
)  # fmt: skip
_FOR_NOW_CODES = ("NOREPLICAS", "BUSY")  # (redis-py has no class for these)


def lua_file(name: str) -> str:
    """One file of lua/, as written."""
    return resources.files("coordinator.store").joinpath("lua", name).read_text(encoding="utf-8")


def as_function(name: str, text: str) -> str:
    """A script's text as a local Lua function of `name`, taking its KEYS and ARGV as parameters."""
    return f"local function {name}(KEYS, ARGV)\n{text}end\n"


def run_and_flush(script: str) -> str:
    """Lua that runs the local function `script` and sends the hash writes it held back (hashes.lua)."""
    return f"local reply = {script}(KEYS, ARGV)\nhash_flush()\nreturn reply\n"


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


@dataclass(frozen=True)
class LibraryText:
    """A library as `FUNCTION LOAD` takes it, its name, and each script's function."""

    name: str
    text: str
    functions: dict[str, str]


def library_text(prelude: str, uses: Mapping[str, Sequence[str]], read: Callable[[str], str] = lua_file) -> LibraryText:
    """The library of the standalone scripts `uses` names (script -> the scripts it uses), on `prelude`
    (hashes.lua as the EVALSHA form has it). `read` gives a file's text."""
    body = "".join(as_function(script, read(f"{script}.lua")) for script in definition_order(uses))
    registered = "".join(
        f"redis.register_function('{_NAME}_{script}', function(KEYS, ARGV)\n{RESET_CACHE}{run_and_flush(script)}end)\n"
        for script in uses
    )
    template = f"#!lua name={_NAME}\n{prelude}{body}{registered}"
    name = f"subq_{hashlib.sha1(template.encode()).hexdigest()[:16]}"
    return LibraryText(name, template.replace(_NAME, name), {script: f"{name}_{script}" for script in uses})


class Library:
    """The scripts' library on one client's server: loaded at the first `function` asked, loaded again after the
    server said it does not hold it (`refused`)."""

    def __init__(self, client: redis.Redis, library: LibraryText, noted_in: str) -> None:
        self.client = client
        self.name = library.name
        self.text = library.text
        self.functions = library.functions
        self.noted_in = noted_in
        self._lock = threading.Lock()
        self._loaded: bool | None = None  # None: to load (not asked yet, refused for now, or not found since)
        self._load_after_s = 0.0  # (monotonic) the next load's earliest time
        self._noted_at_s = 0.0  # (monotonic) when this process last noted the library

    def function(self, script: str) -> str | None:
        """The function to FCALL for `script`, or None to send it by EVALSHA."""
        if self._loaded is None and time.monotonic() >= self._load_after_s and self._lock.acquire(blocking=False):
            try:  # (a thread that finds another loading sends its step by EVALSHA meanwhile)
                if self._loaded is None:
                    self._loaded = self._load()
            finally:
                self._lock.release()
        if not self._loaded:
            return None
        if time.monotonic() - self._noted_at_s > NOTE_EVERY_S:
            self._note()
        return self.functions.get(script)

    def refused(self, error: redis.ResponseError) -> bool:
        """Whether an FCALL's `error` says nothing of it ran and its script by text may run: a library not found
        (loaded again by the next step), FCALL not allowed (EVALSHA from now on), or out of memory."""
        if isinstance(error, _NOT_ALLOWED) or str(error).startswith("unknown command"):
            log.info("subq: the server runs no FCALL for subq (%s); the steps go by EVALSHA", error)
            self._loaded = False
            return True
        if str(error).startswith(_NOT_FOUND):
            self._loaded = None
            return True
        return isinstance(error, _OUT_OF_MEMORY)

    def _load(self) -> bool | None:
        try:
            self.client.function_load(self.text)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._load_later(exc)
            return None
        except redis.ResponseError as exc:
            said = str(exc)
            if isinstance(exc, _NOT_ALLOWED) or said.startswith("unknown command"):
                # No functions (Redis 6.2), or not subq's user's to load: for good, in this process. (The server's
                # answer quotes the load's text: the log keeps its first clause.)
                log.info("subq: the server runs no functions for subq (%s); the steps go by EVALSHA", _clause(said))
                return False
            if isinstance(exc, _FOR_NOW) or said.startswith(_FOR_NOW_CODES):
                self._load_later(exc)
                return None
            if said != f"Library '{self.name}' already exists":
                # The server would not take the text (a Lua limit, a function it refuses): every load would fail.
                log.error("subq: the server refused the scripts' library (%s); the steps go by EVALSHA", exc)
                return False
        self._note()
        self._tidy()
        return True

    def _load_later(self, error: redis.RedisError) -> None:
        log.warning("subq: the scripts' library was not loaded (%s); the steps go by EVALSHA meanwhile", error)
        self._load_after_s = time.monotonic() + LOAD_AGAIN_S

    def _note(self) -> None:
        """Note in the deployment's hash that this process runs the library now (best effort: at worst it is
        removed a week after another note, and its next step loads it again)."""
        self._noted_at_s = time.monotonic()
        try:
            self.client.hset(self.noted_in, self.name, int(time.time()))
        except redis.RedisError as exc:
            log.warning("subq: the scripts' library was not noted (%s)", exc)

    def _tidy(self) -> None:
        """Remove the libraries noted more than LIBRARY_KEEP_S ago, each on its own (best effort: a library left
        is memory, not state, and one removed early is loaded again by its next step)."""
        try:
            noted = self.client.hgetall(self.noted_in)
        except redis.RedisError as exc:
            log.warning("subq: the scripts' old libraries were not tidied (%s)", exc)
            return
        for name in stale(noted, time.time(), self.name):
            try:
                self.client.function_delete(name)
            except redis.ResponseError as exc:
                if str(exc) != "Library not found":
                    log.warning("subq: the scripts' old library %s was not removed (%s)", name, exc)
                    continue
            except redis.RedisError as exc:
                log.warning("subq: the scripts' old library %s was not removed (%s)", name, exc)
                continue
            try:
                self.client.hdel(self.noted_in, name)
            except redis.RedisError as exc:
                log.warning("subq: the scripts' old library %s was not unnoted (%s)", name, exc)
                continue
            log.info("subq: removed the scripts' library %s, noted by no process for a week", name)


def _clause(said: str) -> str:
    """A server's refusal without the arguments it quotes back ("unknown command `FUNCTION`, with args ...")."""
    return said.split(", with args", 1)[0]


def stale(noted: Mapping[bytes | str, bytes | str], now_s: float, own: str) -> Iterable[str]:
    """The libraries of `noted` (name -> the epoch second it was last noted) noted more than LIBRARY_KEEP_S before
    `now_s`, not `own`; one noted with no time (not written here) too."""
    for raw_name, raw_at_s in noted.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
        at_s = raw_at_s.decode() if isinstance(raw_at_s, bytes) else raw_at_s
        if name != own and name.startswith("subq_") and (not at_s.isdigit() or now_s - int(at_s) > LIBRARY_KEEP_S):
            yield name

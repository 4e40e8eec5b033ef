"""A configuration file an operator edits while subq runs: SUBQ_API_KEYS_FILE, SUBQ_TENANTS_FILE.

`read_table` reads one as a TOML (`.toml`) or JSON table, its errors one line naming the setting
and the file (one unreadable, not UTF-8, malformed or nested too deep alike). `ReloadingFile` holds
what the file parsed to and takes an edit up without a restart: each look stats the file (one
`stat`, no read) and parses it again only when its modification time, size or inode changed, one
thread at a time. What a file that no longer parses stands for is its owner's choice: the keys file
fails closed (no key of it holds, coordinator/access.py), the tenants file keeps the last table that
parsed (coordinator/tenants.py). The error is logged once per change of the file, not at each look.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = ["MISSING", "ReloadingFile", "Stamp", "json_value", "read_data", "read_table", "stamp_of"]

T = TypeVar("T")

# (mtime_ns, size, inode): what tells an edit, a rewrite in place or a file swapped in by a rename.
Stamp = tuple[int, int, int]
# The stamp of a file that cannot be stat'ed: compared like any other, so a missing file is logged once.
MISSING: Stamp = (-1, -1, -1)


def stamp_of(path: Path) -> Stamp:
    """The file's stamp now, MISSING when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return MISSING
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def json_value(text: str) -> Any:
    """`json.loads`, with JSON nested too deep for it ('[' * 100000) a ValueError like any other bad JSON, not a
    RecursionError, which gets past every caller's `except ValueError` (pydantic's too) as a traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("not valid JSON: nested too deep") from None


def read_data(path: Path) -> Any:
    """The data of a TOML (`.toml`) or JSON file, a one-line ValueError saying why not otherwise.

    Every way a file can fail is a ValueError: what calls it (a reload among them) catches that
    one type, and anything else would pass as a crash (a 500 on each request reading the file).
    """
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
    try:
        return tomllib.loads(text) if kind == "TOML" else json_value(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid {kind}: {exc}") from None
    except RecursionError:  # tomllib recurses once a level too: '[' * 100000 runs out of stack first
        raise ValueError(f"not valid {kind}: nested too deep") from None


def read_table(path: Path, where: str, wrapper: str) -> Any:
    """The data of a TOML (`.toml`) or JSON file, a ValueError starting with `where` otherwise.

    A file whose only entry is a table named `wrapper` reads as that table (`[keys.<name>]`
    tables in TOML read as well as `[<name>]` ones).
    """
    try:
        data = read_data(path)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get(wrapper), dict) and len(data) == 1:
        return data[wrapper]
    return data


@dataclass(frozen=True)
class _Read(Generic[T]):
    """One read of the file: its stamp then (None: never read) and what it stands for. One object, swapped
    whole, so a look without the lock never pairs a new stamp with an old value."""

    stamp: Stamp | None
    value: T


class ReloadingFile(Generic[T]):
    """What a file parses to, read again when the file changes; read once as it is made."""

    def __init__(
        self,
        path: Path,
        parse: Callable[[Path], T],
        *,
        initial: T,
        broken: T | None,
        logger: logging.Logger,
        broken_means: str,
    ) -> None:
        """`parse` raises ValueError on a file it refuses. A refused file stands for `broken`, or, when that is
        None, for the last value that parsed (`initial` until one has); `broken_means` ends its logged error."""
        self._path = path
        self._parse = parse
        self._broken = broken
        self._logger = logger
        self._broken_means = broken_means
        self._lock = threading.Lock()
        self._read: _Read[T] = self._load(_Read(None, initial))

    def current(self) -> T:
        """The value now: one `stat` of the file, parsed again only when it changed."""
        read = self._read
        if stamp_of(self._path) == read.stamp:
            return read.value
        with self._lock:
            if stamp_of(self._path) != self._read.stamp:  # another thread may have read it meanwhile
                self._read = self._load(self._read)
            return self._read.value

    def _load(self, last: _Read[T]) -> _Read[T]:
        stamp = stamp_of(self._path)  # before the read: an edit during it is read again at the next look
        try:
            value = self._parse(self._path)
        except ValueError as exc:
            if stamp != last.stamp:
                self._logger.error("%s; %s", exc, self._broken_means)
            return _Read(stamp, last.value if self._broken is None else self._broken)
        return _Read(stamp, value)

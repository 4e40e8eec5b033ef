"""Keeping the trees in flight: no key of a tree in flight lapses.

Every key of a tree expires (docs/architecture.md, "Every key of a tree expires"): the step
that makes it gives it the retention (`SUBQ_RESULT_RETENTION_S`), and the steps that write it
later refresh it. A tree in flight can go a whole retention without writing some of its keys:
a parent waits on a child that runs for longer (its record, todo list, batch and batch lines
are written again only at the batch's close), a child's record waits out one long model
request, an approval waits for its decision. Such a key lapsed under a tree still running,
and the tree lost the parent it was to resume.

The reconciler's leader keeps them (`TreeKeeper.step`, once a tick): it walks the database's
trees' keys a SCAN call at a time, and hands the keys of the trees each call found to
`keep_trees.lua` in one call, which, for each tree in flight (an agent's root that has not
ended, or a caller's root while it is delegated: a caller's root has no end of its own, and an
idle one lapses as before), gives each key with less than `retention - pass` of its retention
left the whole retention again. A key with no expiry is left with none, a key gone is not made
again, and a run's lease is never kept (it lapses with its worker's heartbeat: `SHORT_LIVED`,
store/keys.py). A tree not in flight is left as it is: its keys lapse a retention after their
last write, as before.

Pace: a pass over the keyspace starts every `retention / PASSES_PER_RETENTION` (a quarter of
it, 42 hours by default), and each tick looks at twice the keys that would end the pass within
that at one tick an interval (`DBSIZE`), at least `MIN_SLICE_KEYS`, in SCAN calls of at most
`SCAN_CALL_KEYS` (Redis serves other clients between two). The settings hold the interval to at
most half a pass, so a slice ends a pass in time even at the smallest retention. A key is then
looked at least every half retention: one not kept at a look (it had more than three quarters of
its retention left) still has a quarter at the next, and one kept has half. Where the walk stands
(SCAN's cursor, when the next pass is due) is kept in Redis (`<p>:keeper`), so a new leader goes
on with it rather than starting again, and a fleet whose leader changes often still ends its
passes. A step that fails (Redis away, an ACL without SCAN or DBSIZE) logs one line and is tried
again `RETRY_S` later from the same cursor.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.errors import StoreError
from coordinator.settings import KEEPER_PASSES_PER_RETENTION as PASSES_PER_RETENTION

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["MIN_SLICE_KEYS", "PASSES_PER_RETENTION", "RETRY_S", "SCAN_CALL_KEYS", "TreeKeeper"]

log = logging.getLogger(__name__)

# The fewest keys one tick looks at: a small pass ends in a tick.
MIN_SLICE_KEYS = 1000
# The most keys one SCAN call looks at (its COUNT): a large slice is several calls.
SCAN_CALL_KEYS = 1000
# After a step that failed, the keeper waits this long before the next (a pass is due only every 42 hours by
# default: an ACL without SCAN says so once a minute, not at every tick).
RETRY_S = 60.0


class TreeKeeper:
    """The reconciler leader's walk over the trees' keys: `step` once a tick looks at one slice of it."""

    def __init__(
        self,
        plane: Plane,
        tick_s: float,
        *,
        min_slice_keys: int = MIN_SLICE_KEYS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = plane.store
        self._pass_s = plane.store.retention_s / PASSES_PER_RETENTION
        # A key with less than this left is given its retention again: it still has `pass` of it at the next look.
        self._floor_s = plane.store.retention_s - self._pass_s
        self._tick_s = tick_s
        self._min_slice_keys = min_slice_keys
        self._clock = clock  # the wall's: when the next pass is due is kept in Redis, for whichever process leads
        self._walk: tuple[int, float] | None = None  # (cursor, when the next pass is due), as read; None: to be read
        self._slice_keys = min_slice_keys
        self._retry_at = 0.0

    @property
    def in_pass(self) -> bool:
        """Whether a pass has begun and not ended (the next step goes on with it)."""
        return self._walk is not None and self._walk[0] != 0

    def interrupt(self) -> None:
        """This process no longer leads: where the walk stands is read again from Redis at its next step."""
        self._walk = None

    def step(self) -> int:
        """Look at the next slice of the pass (or begin one, when it is due): how many keys were kept."""
        now = self._clock()
        if now < self._retry_at:
            return 0
        try:
            return self._step(now)
        except StoreError as exc:
            self._walk, self._retry_at = None, now + RETRY_S
            log.warning(
                "subq reconciler: keeping the trees in flight failed (%s); it is tried again in %.0f s", exc, RETRY_S
            )
            return 0

    def _step(self, now: float) -> int:
        convergence = self._store.convergence
        if self._walk is None:
            self._walk = convergence.keeper_walk()
            if self._walk[0] != 0:
                self._size_slice()  # a pass another leader began: this one's slice
        cursor, next_pass_at = self._walk
        if cursor == 0:
            if now < next_pass_at:
                return 0
            self._size_slice()
            next_pass_at = now + self._pass_s
        looked = kept = 0
        while looked < self._slice_keys:
            count = min(SCAN_CALL_KEYS, self._slice_keys - looked)
            cursor, found = convergence.tree_keys(cursor, count)
            kept += convergence.keep_trees(found, self._floor_s)
            # Noted only once its trees are kept: a call that fails is made again, from the same cursor.
            convergence.note_keeper_walk(cursor, next_pass_at)
            self._walk, looked = (cursor, next_pass_at), looked + count
            if cursor == 0:
                break
        if kept:
            log.info("subq reconciler: %d key(s) of trees in flight given their retention again", kept)
        return kept

    def _size_slice(self) -> None:
        # Twice the slice that ends the pass within its time at one tick an interval: ticks come late.
        whole_pass_keys = 2 * self._store.convergence.key_count() * self._tick_s / self._pass_s
        self._slice_keys = max(self._min_slice_keys, math.ceil(whole_pass_keys))

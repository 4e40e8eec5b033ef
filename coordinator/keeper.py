"""Keeping the trees in flight: no key of a tree that has not settled lapses.

Every key of a tree expires (docs/architecture.md, "Every key of a tree expires"): the step
that makes it gives it the retention (`SUBQ_RESULT_RETENTION_S`), and the steps that write it
later refresh it. A tree in flight can go a whole retention without writing some of its keys:
a parent waits on a child that runs for longer (its record, todo list, batch and batch lines
are written again only at the batch's close), a child's record waits out one long model
request, an approval waits for its decision. Such a key lapsed under a tree still running,
and the tree lost the parent it was to resume.

The reconciler's leader keeps them (`TreeKeeper.step`, once a tick): it walks the database's
trees' keys a SCAN step at a time, and hands the keys of each tree it finds to
`keep_tree.lua`, which, while the tree's root is in flight (an agent's root that has not
ended, or a caller's root while it is delegated: a caller's root has no end of its own, and an
idle one lapses as before), gives each key with less than `retention - pass` of its retention
left the whole retention again. A key with no expiry is left with none, a key gone is not made
again, and a run's lease is never kept (it lapses with its worker's heartbeat: `SHORT_LIVED`,
store/keys.py). A settled tree is left as it is: its keys lapse a retention after their last
write, as before.

Pace: a pass over the keyspace starts every `retention / PASSES_PER_RETENTION` (a quarter of
it, 42 hours by default), and each tick looks at twice the keys that would end the pass within
that at one tick an interval (`DBSIZE`), at least `MIN_SLICE_KEYS`, in SCAN calls of at most
`SCAN_CALL_KEYS` (Redis serves other clients between two). The settings hold the interval to at
most half a pass, so a slice ends a pass even at the smallest retention. A key is then looked at
least every half retention, and a key kept at a look still has a quarter of its retention left
at the next. A small database's pass is a tick, then nothing until the next pass is due. A step
whose keeps fail is looked at again from the same cursor; a process that loses the lead
(`interrupt`) starts its next pass anew.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.settings import KEEPER_PASSES_PER_RETENTION as PASSES_PER_RETENTION

if TYPE_CHECKING:
    from coordinator.plane import Plane

__all__ = ["MIN_SLICE_KEYS", "PASSES_PER_RETENTION", "SCAN_CALL_KEYS", "TreeKeeper"]

log = logging.getLogger(__name__)

# The fewest keys one tick looks at: a small pass ends in a tick.
MIN_SLICE_KEYS = 1000
# The most keys one SCAN call looks at (its COUNT): a large slice is several calls.
SCAN_CALL_KEYS = 1000


class TreeKeeper:
    """The reconciler leader's walk over the trees' keys: `step` once a tick looks at one slice of it."""

    def __init__(
        self,
        plane: Plane,
        tick_s: float,
        *,
        min_slice_keys: int = MIN_SLICE_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = plane.store
        self._pass_s = plane.store.retention_s / PASSES_PER_RETENTION
        # A key with less than this left is given its retention again: it still has `pass` of it at the next look.
        self._floor_s = plane.store.retention_s - self._pass_s
        self._tick_s = tick_s
        self._min_slice_keys = min_slice_keys
        self._clock = clock
        self._cursor = 0  # SCAN's: 0 between passes
        self._slice_keys = min_slice_keys
        self._next_pass_at: float | None = None  # None: a pass starts at the next step

    @property
    def in_pass(self) -> bool:
        """Whether a pass has begun and not ended (the next step goes on with it)."""
        return self._cursor != 0

    def interrupt(self) -> None:
        """This process no longer leads: what another walks meanwhile is not known here, so its next pass starts anew
        at its next step."""
        self._cursor, self._next_pass_at = 0, None

    def step(self) -> int:
        """Look at the next slice of the pass (or begin one, when it is due): how many keys were kept."""
        now = self._clock()
        convergence = self._store.convergence
        if self._cursor == 0:
            if self._next_pass_at is not None and now < self._next_pass_at:
                return 0
            # Twice the slice that ends the pass within its time at one tick an interval: ticks come late.
            whole_pass_keys = 2 * convergence.key_count() * self._tick_s / self._pass_s
            self._slice_keys = max(self._min_slice_keys, math.ceil(whole_pass_keys))
        begins, looked, kept = self._cursor == 0, 0, 0
        while looked < self._slice_keys:
            count = min(SCAN_CALL_KEYS, self._slice_keys - looked)
            cursor, found = convergence.tree_keys(self._cursor, count)
            kept += sum(max(0, convergence.keep_tree(root_id, keys, self._floor_s)) for root_id, keys in found.items())
            # Moved on only once its trees are kept: a call that fails is made again at the next step.
            self._cursor, looked = cursor, looked + count
            if begins:
                self._next_pass_at, begins = now + self._pass_s, False
            if cursor == 0:
                break
        if kept:
            log.info("subq reconciler: %d key(s) of trees still in flight given their retention again", kept)
        return kept

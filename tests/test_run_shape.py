"""`Run` keeps only a run's life: each worker concern is a port of its own (coordinator/ports/).

Every concern that was added as a `Run` method (provider endpoints, compaction, typed ends, the tool
journal, approvals) made the class a grab-bag of 49 methods; the ports took them out. This holds the
line: a new concern becomes a port, not a twentieth public name on `Run`. (Ruff's C901, in
pyproject.toml, holds the other half: no function past ten branches.)
"""

from __future__ import annotations

import inspect

from coordinator.runs import Run

MAX_PUBLIC_NAMES = 19


def _public_names(cls: type) -> list[str]:
    """The public methods and properties a class defines itself (not those it inherits from object)."""
    return sorted(
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    )


def test_run_has_fewer_than_twenty_public_methods() -> None:
    names = _public_names(Run)
    assert len(names) <= MAX_PUBLIC_NAMES, (
        f"Run has {len(names)} public methods and properties ({', '.join(names)}): "
        "give the new concern a port of its own (coordinator/ports/) instead"
    )


def test_the_count_sees_methods_and_properties_and_leaves_out_private_ones() -> None:
    class Sample:
        limit = 3  # data, not a method

        def one(self) -> None: ...

        @property
        def two(self) -> int:
            return 2

        def _hidden(self) -> None: ...

    assert _public_names(Sample) == ["one", "two"]
    assert len(_public_names(Run)) >= 10  # the count reads Run itself, not an empty class

"""Example tools: plain Python functions a profile offers its agents, as `subq demo` does.

`subq demo` offers `sales_total` to its agents, and the first item of its plan
calls it on a CSV file the demo writes (docs/tools.md walks through the same
tool). A profile names a tool by its import path, as it would one of yours:

    [profiles.demo]
    model = "offline"
    tools = ["coordinator.local.example_tools:sales_total"]

The tools here use the standard library alone, read only what they are given,
and return a line of text for the model to read. A worker imports them by that
path when it starts (workers/runtime/profile_tools.py); nothing of subq imports
this module.
"""

from __future__ import annotations

import csv
from decimal import Decimal, InvalidOperation
from pathlib import Path

__all__ = ["sales_total"]

# The columns `sales_total` reads; any others (an order id, a date) are left alone.
SALES_COLUMNS = ("region", "amount")


def sales_total(path: str) -> str:
    """Total the orders of a sales CSV file (a header row, then one order a row, with `region` and
    `amount` columns): how many orders, and their total in USD, overall and by region."""
    totals: dict[str, Decimal] = {}
    counts: dict[str, int] = {}
    with Path(path).open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        missing = [column for column in SALES_COLUMNS if column not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no {' or '.join(missing)} column in its header row")
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            raw = (row.get("amount") or "").strip()
            try:
                amount = Decimal(raw)
            except InvalidOperation:
                raise ValueError(f"{where}: amount {raw!r} is not a number") from None
            if not amount.is_finite():
                raise ValueError(f"{where}: amount {raw!r} is not a number")
            region = (row.get("region") or "").strip() or "(no region)"
            totals[region] = totals.get(region, Decimal(0)) + amount
            counts[region] = counts.get(region, 0) + 1
    orders = sum(counts.values())
    by_region = ", ".join(f"{region} {_usd(totals[region])} ({_orders(counts[region])})" for region in sorted(totals))
    return f"{_orders(orders)}, {_usd(sum(totals.values(), Decimal(0)))} in total" + (
        f": {by_region}" if by_region else ""
    )


def _usd(amount: Decimal) -> str:
    return f"-${-amount:,.2f}" if amount < 0 else f"${amount:,.2f}"


def _orders(count: int) -> str:
    return f"{count} order{'' if count == 1 else 's'}"

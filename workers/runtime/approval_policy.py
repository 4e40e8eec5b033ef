"""Which tool calls need a human decision, and which the policy decides by itself.

The way command allow-lists work in AI coding tools: a rule is `tool` (every
call of it) or `tool:prefix` (calls whose main argument starts with the prefix
as whole words: `run_command:npm test` allows `npm test -- --watch`, not
`npm testing`). Deny rules win. A chained command (`a && b`, `a; b`, `a || b`,
`a | b`) is allowed only if every part is, and denied if any part is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from coordinator import Profile

__all__ = ["Verdict", "verdict"]

Verdict = Literal["allow", "deny", "ask"]
_CHAIN = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")


def _main_argument(args: Mapping[str, object]) -> str:
    for value in args.values():
        if isinstance(value, str):
            return value.strip()
    return ""


def _matches(rule: str, tool: str, part: str) -> bool:
    name, sep, prefix = rule.partition(":")
    if name != tool:
        return False
    if not sep:
        return True
    prefix = prefix.strip()
    return part == prefix or part.startswith(prefix + " ")


def verdict(profile: Profile, tool: str, args: Mapping[str, object]) -> Verdict:
    """allow, deny, or ask a human, for one call of `tool` under the profile's policy."""
    if tool not in profile.approval_tools:
        return "allow"
    parts = [p for p in _CHAIN.split(_main_argument(args)) if p] or [""]
    if any(_matches(rule, tool, part) for rule in profile.deny for part in parts):
        return "deny"
    if all(any(_matches(rule, tool, part) for rule in profile.allow) for part in parts):
        return "allow"
    return "ask"

"""Which tool calls need a human decision, and which the policy decides by itself.

The way command allow-lists work in AI coding tools: a rule is `tool` (every
call of it) or `tool:prefix` (calls whose main argument starts with the prefix
as whole words: `run_command:npm test` allows `npm test -- --watch`, not
`npm testing`). Deny rules win. A chained command (`a && b`, `a; b`, `a || b`,
`a | b`, `a & b`, or one per line) is allowed only if every part is, and
denied if any part is. A part that substitutes a command's output (`$(...)`,
backticks, `<(...)`, `>(...)`) is never allowed by a prefix: a human decides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from coordinator import Profile

__all__ = ["Verdict", "verdict"]

Verdict = Literal["allow", "deny", "ask"]
# The shell's command separators; each part is trimmed after the split. Spaces around them
# are not part of the pattern: `\s*` before a separator was tried from every space of a run
# that none follows, quadratic in the run (40,000 spaces took 6.3 s on the agents' loop).
_CHAIN = re.compile(r"&&|\|\||[;|&\n]")
# Where a command's output becomes part of the command line: a prefix rule cannot vouch for it.
_SUBSTITUTIONS = ("$(", "`", "<(", ">(")


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


def _allowed(rule: str, tool: str, part: str) -> bool:
    return _matches(rule, tool, part) and not any(mark in part for mark in _SUBSTITUTIONS)


def verdict(profile: Profile, tool: str, args: Mapping[str, object]) -> Verdict:
    """allow, deny, or ask a human, for one call of `tool` under the profile's policy."""
    if tool not in profile.approval_tools:
        return "allow"
    parts = [p for p in (part.strip() for part in _CHAIN.split(_main_argument(args))) if p] or [""]
    if any(_matches(rule, tool, part) for rule in profile.deny for part in parts):
        return "deny"
    if all(any(_allowed(rule, tool, part) for rule in profile.allow) for part in parts):
        return "allow"
    return "ask"

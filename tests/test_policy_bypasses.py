"""The ways around a deny rule, tried for real against two policies, with and without the sandbox.

Each attempt tries to delete or empty a canary file that lies outside the command's
`cwd`. Under each policy, an attempt the rules send to a human (`ask`) or refuse
(`deny`) is stopped by a decision; one they `allow` is run, once without the sandbox
(what the rules alone let through) and once in it. The table in docs/tools.md
("What the rules catch, and what only the sandbox stops") is read here and must say
exactly what this finds.

- EXAMPLE is the documented example policy (docs/tools.md, section 5): under it no
  attempt reaches the canary without a decision, sandbox or not.
- BROAD is a typical developer's allow list: prefix rules for the usual tools, and a
  deny rule for `rm`. Rules over argv cannot know what every program's options do
  (the GTFOBins catalogue lists hundreds), so some attempts get through them: the
  sandbox stops every one.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Profile, RunCommand
from workers.runtime import commands
from workers.runtime.approval_policy import verdict

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "tools.md"

EXAMPLE = Profile(
    approval_tools=["run_command"],
    allow=["run_command:=npm test", "run_command:ls", "run_command:git status", "run_command:=git diff"],
    deny=["run_command:sudo", "run_command:rm -rf /"],
)
BROAD_PROGRAMS = ("ls", "cat", "git", "tar", "find", "awk", "python3", "perl", "sed", "cp", "mv", "ln", "dd",
                  "truncate", "tee", "xargs", "env", "make")  # fmt: skip
BROAD = Profile(
    approval_tools=["run_command"], allow=[f"run_command:{p}" for p in BROAD_PROGRAMS], deny=["run_command:rm"]
)

# CANARY is the canary's absolute path, DIR its folder (outside the command's cwd).
ATTEMPTS = [
    "rm CANARY",
    "/bin/rm CANARY",
    "\\rm CANARY",
    "'rm' CANARY",
    "X=1 rm CANARY",
    "command rm CANARY",
    "env rm CANARY",
    "xargs rm CANARY",
    # A quoted `>` or `<`: no shell reads the argv, so env and xargs run rm; read as a shell would, the quote gone,
    # the word after it was a redirection's file, and an unguarded profile with `deny = ["run_command:rm"]` ran it.
    "env -u '>' rm CANARY",
    "xargs -d '<' rm CANARY",
    "sudo rm CANARY",
    "sh -c 'rm CANARY'",
    "bash -c 'rm CANARY'",
    "sh -c '$(printf rm) CANARY'",
    "ls; rm CANARY",
    "git -c alias.x='!rm CANARY' x",
    "tar --checkpoint=1 --checkpoint-action=exec='rm CANARY' -cf /dev/null /etc/hostname",
    "tar --remove-files -cf /dev/null CANARY",
    "find DIR -exec rm {} ;",
    "find DIR -exec sh -c 'rm CANARY' ;",
    "find DIR -name canary -delete",
    "awk 'BEGIN{system(\"rm CANARY\")}'",
    "python3 -c 'import os; os.remove(\"CANARY\")'",
    "perl -e 'unlink \"CANARY\"'",
    "sed -i d CANARY",
    "cp /dev/null CANARY",
    "mv CANARY CANARY.gone",
    "ln -sf /dev/null CANARY",
    "dd if=/dev/null of=CANARY",
    "truncate -s 0 CANARY",
    "tee CANARY",
    "env python3 -c 'import shutil; shutil.rmtree(\"DIR\")'",
    "make -f /dev/null --eval='x:;@rm CANARY' x",
    "git status",
    "ls -la DIR",
]
CANARY_TEXT = "still here\n"


@pytest.fixture
def canary() -> Iterator[Path]:
    # In /var/tmp, not /tmp: the sandbox's /tmp is its own, which would hide the canary rather than guard it.
    folder = Path(tempfile.mkdtemp(prefix="subq-canary-", dir="/var/tmp"))
    try:
        yield folder / "canary"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _command(attempt: str, canary: Path) -> str:
    return attempt.replace("CANARY", str(canary)).replace("DIR", str(canary.parent))


def _reaches(command: str, cwd: Path, canary: Path, sandbox: bool) -> bool:
    """Whether running `command` deletes or changes the canary (laid anew first)."""
    shutil.rmtree(canary.parent, ignore_errors=True)
    canary.parent.mkdir()
    canary.write_text(CANARY_TEXT)
    asyncio.run(commands.run(command, RunCommand(cwd=cwd, sandbox=sandbox, timeout_s=30)))
    return not (canary.is_file() and not canary.is_symlink() and canary.read_text() == CANARY_TEXT)


def _findings(profile: Profile, cwd: Path, canary: Path) -> dict[str, tuple[str, bool, bool]]:
    """attempt -> (verdict, reaches the canary unconfined, reaches it in the sandbox); only allowed ones run."""
    found = {}
    for attempt in ATTEMPTS:
        command = _command(attempt, canary)
        decided = verdict(profile, "run_command", {"command": command})
        ran = decided == "allow"
        found[attempt] = (
            decided,
            ran and _reaches(command, cwd, canary, sandbox=False),
            ran and _reaches(command, cwd, canary, sandbox=True),
        )
    return found


def _documented() -> dict[str, tuple[str, str, str]]:
    """The docs' table: attempt -> (example's verdict, the broad list's verdict, what stops it there)."""
    text = DOCS.read_text()
    section = text[text.index("<!-- bypass-table -->") : text.index("<!-- /bypass-table -->")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`").replace("\\|", "|")] = (cells[1], cells[2], cells[3])
    return rows


def _stopped_by(decided: str, unconfined: bool) -> str:
    if decided != "allow":
        return "the rules"
    return "the sandbox" if unconfined else "nothing needed"


def test_no_attempt_reaches_the_canary_without_a_decision(tmp_path: Path, canary: Path) -> None:
    example = _findings(EXAMPLE, tmp_path, canary)
    broad = _findings(BROAD, tmp_path, canary)
    through_example = [a for a, (_, unconfined, confined) in example.items() if unconfined or confined]
    assert through_example == [], "under the documented example, the rules alone stop every attempt"
    through_sandbox = [a for a, (_, _, confined) in broad.items() if confined]
    assert through_sandbox == [], "under the broad allow list, the sandbox stops what the rules let through"
    past_the_rules = [a for a, (_, unconfined, _) in broad.items() if unconfined]
    assert len(past_the_rules) >= 6, f"the broad list's rules alone let these through: {past_the_rules}"
    table = {
        attempt: (example[attempt][0], broad[attempt][0], _stopped_by(broad[attempt][0], broad[attempt][1]))
        for attempt in ATTEMPTS
    }
    assert _documented() == table, "docs/tools.md's table says what the rules and the sandbox do"


def test_every_attempt_would_reach_the_canary_unconfined_and_unruled(tmp_path: Path, canary: Path) -> None:
    # The attempts are real: with no rule and no sandbox, each that is meant to reach the canary does.
    # Without a shell, `X=1`, `command` and `ls;` are programs that do not exist; sudo is not installed.
    harmless = {"git status", "ls -la DIR", "X=1 rm CANARY", "command rm CANARY", "ls; rm CANARY", "sudo rm CANARY"}
    missed = [
        attempt
        for attempt in ATTEMPTS
        if attempt not in harmless and not _reaches(_command(attempt, canary), tmp_path, canary, sandbox=False)
    ]
    assert missed == []

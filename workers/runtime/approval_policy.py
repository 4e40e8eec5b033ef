"""Which tool calls need a human decision, and which the policy decides by itself.

A rule is `tool` (every call of it) or `tool:argument`. Deny rules apply to every call of
every tool and always win: a deny rule that matches denies the call whether or not
`approval_tools` (or an MCP server's hint) puts the tool under the policy, and no allow
rule overrides it. The tools `approval_tools` names (names or `*` globs) are guarded: a
call of one runs only if an allow rule allows it, and a human decides the rest. A call of
any other tool runs, unless a deny rule denies it, or a deny rule may match it where it
cannot be told (below): then a human decides, as for a guarded tool. That a deny rule
was skipped for an unguarded tool was a live hole: a profile with
`approval_tools = ["git_commit"]` and `deny = ["run_command:rm"]` ran `rm canary`.

`run_command` runs its command line as argv, without a shell (workers/runtime/commands.py),
and its rules match that argv, split the same way (`shlex`: quotes and backslashes are
removed, so `'rm'` and `\\rm` are `rm`):

- `run_command:npm test` (a prefix) allows an argv that starts with the words `npm`,
  `test`: `npm test -- --watch`, not `npm testing`. The extra words must be plain
  arguments: a word with a shell operator or substitution in it (`;`, `&`, `|`, `<`,
  `>`, a backtick, `$(`), or a new line in the command, means the model expected a
  shell, and a human decides.
- `run_command:=npm test` (exact) allows exactly the argv `npm test`, no more words.
- An allow rule names the program as the command must: `run_command:ls` allows `ls`
  (found on PATH), not `/tmp/x/ls` or `./ls`.
- A deny rule matches the program by its name (`/bin/rm` is `rm`) wherever it would
  run: first in the command, after `VAR=value` words and after the wrappers that run
  another program (`sudo`, `env`, `xargs`, `nice`, `timeout`, `busybox`...), in the
  script of `sh -c`/`bash -c` and `eval`, and after a shell separator the model wrote
  (`a; rm x`): there it denies. Found anywhere else among the words (`find . -exec rm`,
  `echo rm`), or where a shell script hides what it runs (`$x`, globs, a script file),
  the call goes to a human instead: an escape from a deny rule never reaches "allow".

Other tools keep the text rules: `tool:prefix` matches the main (first string, in the tool's
schema's order: mcp_servers.in_schema_order) argument
as whole words; a chained argument (`a && b`, `a; b`, `a || b`, `a | b`, `a & b`, or one
per line) is allowed only if every part is, and denied if any part is; a part with a
substitution (`$(...)`, backticks, `<(...)`, `>(...)`) is never allowed by a prefix.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal

from coordinator import Profile
from workers.runtime.commands import MAX_COMMAND_CHARS

__all__ = ["RUN_COMMAND", "Verdict", "unguarded_command", "verdict"]

Verdict = Literal["allow", "deny", "ask"]
RUN_COMMAND = "run_command"
# The shell's command separators; each part is trimmed after the split. Spaces around them
# are not part of the pattern: `\s*` before a separator was tried from every space of a run
# that none follows, quadratic in the run (40,000 spaces took 6.3 s on the agents' loop).
_CHAIN = re.compile(r"&&|\|\||[;|&\n]")
# Where a command's output becomes part of the command line: a prefix rule cannot vouch for it.
_SUBSTITUTIONS = ("$(", "`", "<(", ">(")

# -- run_command: argv rules -------------------------------------------------------------

# A word that would be a shell operator or substitution: the model expected a shell.
_SHELL_WORD = re.compile(r"[;&|<>`]|\$\(")
# A word that may itself be a command line: it has a space or a shell operator in it.
_SCRIPT_LIKE = re.compile(r"[\s;&|<>`]|\$\(")
# `NAME=value` before a program: a shell assignment (without a shell, a program of that name).
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# A wrapper option's value: a count, a priority, a duration.
_OPTION_VALUE = re.compile(r"[+-]?\d+(\.\d+)?[smhd]?")
# Programs that run the program named after their own options (or a script: the shells).
WRAPPERS = frozenset(
    {
        "builtin", "busybox", "caffeinate", "chroot", "chrt", "command", "doas", "env", "exec",
        "flock", "ionice", "ltrace", "nice", "nohup", "nsenter", "parallel", "pkexec",
        "runuser", "setsid", "stdbuf", "strace", "su", "sudo", "taskset", "time", "timeout",
        "torsocks", "unbuffer", "unshare", "watch", "xargs",
    }
)  # fmt: skip
SHELLS = frozenset({"ash", "bash", "csh", "dash", "fish", "ksh", "mksh", "sh", "tcsh", "zsh"})
# In a shell's script, words after which a command starts (`if x; then rm y; fi`).
_KEYWORDS = frozenset({"!", "do", "elif", "else", "if", "then", "until", "while"})
# In a shell's script, a word with these may expand into another program's name.
_EXPANSION = re.compile(r"[$`*?\[{}]")
# Shell syntax tokens (shlex's punctuation); a token of only these is an operator, not a word.
_PUNCTUATION = ";&|()<>\n"
_SEPARATOR = re.compile(r"[;&|()\n]")
# How deep scripts inside scripts are read before the command counts as unreadable.
_MAX_DEPTH = 4


@dataclass(frozen=True)
class _Rule:
    argv: tuple[str, ...] | None  # None: the whole tool ("run_command"); () when unreadable or empty
    exact: bool = False

    @classmethod
    def of(cls, rule: str) -> _Rule | None:
        name, sep, text = rule.partition(":")
        if name != RUN_COMMAND:
            return None
        if not sep:
            return cls(None)
        text = text.strip()
        exact = text.startswith("=")
        try:
            argv = tuple(shlex.split(text[1:] if exact else text))
        except ValueError:
            argv = ()
        return cls(argv, exact)

    def allows(self, argv: list[str], command: str) -> bool:
        """An allow rule: the argv runs the rule's program with the rule's words (and plain arguments)."""
        if self.argv == ():  # an empty or unreadable allow rule allows nothing
            return False
        if self.exact:
            return tuple(argv) == self.argv
        n = 0 if self.argv is None else len(self.argv)
        if tuple(argv[:n]) != (self.argv or ()):
            return False
        return "\n" not in command and not any(_SHELL_WORD.search(word) for word in argv[n:])

    def denies_at(self, words: list[str], i: int) -> bool:
        """A deny rule: its program (by name) with its words runs at `words[i]`."""
        if not self.argv:  # the whole tool, or an empty or unreadable deny rule: everything
            return True
        if posixpath.basename(words[i]) != posixpath.basename(self.argv[0]):
            return False
        rest = self.argv[1:]
        if self.exact:
            return tuple(words[i + 1 :]) == rest
        return tuple(words[i + 1 : i + 1 + len(rest)]) == rest


@dataclass
class _Reading:
    """Where a command line runs programs, as far as can be told."""

    # (words, index): a program surely runs at words[index] (if the line were run by a shell).
    runs: list[tuple[list[str], int]] = field(default_factory=list)
    # Every word list read, any word of which may be a program another one runs.
    words: list[list[str]] = field(default_factory=list)
    opaque: bool = False  # a shell script hides what it runs


def _tokens(script: str) -> list[str]:
    """A shell's view of a line: its words, with each run of operator characters a token of its own."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=_PUNCTUATION)
    lexer.whitespace = " \t\r"  # a new line separates commands
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def _simple_commands(tokens: list[str], targets: list[str]) -> Iterator[list[str]]:
    """The simple commands of a token list: split at separators, redirections dropped, and their targets added to
    `targets`: the tokens lose their quotes, so a quoted `'>'` reads as an operator, and the word after it (`env -u
    '>' rm x` runs rm) must still be a word a program may be (`_Reading.words`)."""
    current: list[str] = []
    redirect = False
    for token in tokens:
        if token and all(c in _PUNCTUATION for c in token):
            if _SEPARATOR.search(token):
                if current:
                    yield current
                current, redirect = [], False
            else:  # `>`, `<`, `>>`: the next word is a file
                redirect = True
            continue
        if redirect:
            redirect = False
            targets.append(token)
            continue
        current.append(token)
    if current:
        yield current


def _read_script(script: str, reading: _Reading, depth: int, shell: bool) -> None:
    """Read a shell script (`shell`), or a word that looks like one (then only its words count)."""
    if depth > _MAX_DEPTH:
        reading.opaque = reading.opaque or shell
        return
    try:
        tokens = _tokens(script)
    except ValueError:
        reading.opaque = reading.opaque or shell
        return
    targets: list[str] = []
    for words in _simple_commands(tokens, targets):
        if shell and any(_EXPANSION.search(word) for word in words):
            reading.opaque = True
        _read_command(words, reading, depth, surely_runs=shell)
    if targets:
        reading.words.append(targets)


def _read_command(words: list[str], reading: _Reading, depth: int, surely_runs: bool) -> None:
    reading.words.append(words)
    read_as_scripts = _read_runs(words, reading, depth) if surely_runs else range(0)
    for i, word in enumerate(words):  # a word that is a command line itself (`su -c 'rm x'`, `python -c ...`)
        if i not in read_as_scripts and _SCRIPT_LIKE.search(word):
            _read_script(word, reading, depth + 1, shell=False)


def _read_runs(words: list[str], reading: _Reading, depth: int) -> range:
    """Note where programs surely run in a simple command; returns which of its words a shell read as a script."""
    i = 0
    while i < len(words):
        if _ASSIGNMENT.match(words[i]):
            i += 1
            continue
        reading.runs.append((words, i))
        program = posixpath.basename(words[i])
        if program in SHELLS or program in (".", "source"):
            return _read_shell(words, i + 1, reading, depth)
        if program == "eval":
            _read_script(" ".join(words[i + 1 :]), reading, depth + 1, shell=True)
            return range(i + 1, len(words))
        if program in _KEYWORDS:
            i += 1
            continue
        if program not in WRAPPERS:
            return range(0)
        i += 1
        while i < len(words) and (words[i].startswith("-") or _OPTION_VALUE.fullmatch(words[i])):
            i += 1  # the wrapper's options, until the program it runs
    return range(0)


def _read_shell(words: list[str], start: int, reading: _Reading, depth: int) -> range:
    """A shell's arguments: `-c SCRIPT` is read; a script file (or a `.`/`source` file) hides what it runs."""
    command_mode = False
    for i in range(start, len(words)):
        arg = words[i]
        if arg.startswith("-") and len(arg) > 1:
            command_mode = command_mode or (not arg.startswith("--") and "c" in arg[1:])
            continue
        if command_mode:
            _read_script(arg, reading, depth + 1, shell=True)
            return range(i, i + 1)
        reading.opaque = True  # a script file: its contents are not known here
        return range(0)
    return range(0)


def _read(command: str, argv: list[str]) -> _Reading | None:
    """How a command line runs programs, read as a shell would and as its argv (`argv`: what runs, no shell);
    None when it cannot be read (an unbalanced quote)."""
    reading = _Reading()
    try:
        tokens = _tokens(command)
    except ValueError:
        return None
    targets: list[str] = []
    for words in _simple_commands(tokens, targets):
        _read_command(words, reading, 0, surely_runs=True)
    if targets:
        reading.words.append(targets)
    # The argv as it runs: no shell reads its `>` or `;` (a quoted `'>'` too), so a wrapper's program after one
    # (`env -u '>' rm x`, `xargs -d '<' rm x`) runs where the shell's reading above saw a redirection's target.
    _read_command(argv, reading, 0, surely_runs=True)
    return reading


def _command_verdict(profile: Profile, command: str, guarded: bool) -> Verdict:
    allow = [r for r in (_Rule.of(rule) for rule in profile.allow) if r is not None]
    deny = [r for r in (_Rule.of(rule) for rule in profile.deny) if r is not None]
    if any(rule.argv is None for rule in deny):
        return "deny"
    # Unguarded, a command runs unless a deny rule may apply; a line that cannot be read
    # might hide a denied program, so with deny rules it is asked about like a guarded one.
    unreadable: Verdict = "ask" if guarded or deny else "allow"
    if len(command) > MAX_COMMAND_CHARS:
        return unreadable
    try:
        argv = shlex.split(command)
    except ValueError:
        return unreadable
    reading = _read(command, argv)
    if reading is None:
        return unreadable
    if deny:
        if any(rule.denies_at(words, i) for rule in deny for words, i in reading.runs):
            return "deny"
        anywhere = any(rule.denies_at(words, i) for rule in deny for words in reading.words for i in range(len(words)))
        if anywhere or reading.opaque:
            return "ask"
    if not guarded or (argv and any(rule.allows(argv, command) for rule in allow)):
        return "allow"
    return "ask"


# -- other tools: text rules ----------------------------------------------------------------


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


def verdict(profile: Profile, tool: str, args: Mapping[str, object], *, guarded: bool | None = None) -> Verdict:
    """allow, deny, or ask a human, for one call of `tool` under the profile's policy.

    `guarded` says whether a call needs an allow rule to run; None: whether `approval_tools`
    names the tool (names or `*` globs). Deny rules apply either way, and win.
    """
    if guarded is None:
        guarded = any(fnmatchcase(tool, pattern) for pattern in profile.approval_tools)
    if tool == RUN_COMMAND:
        command = args.get("command")
        return _command_verdict(profile, command if isinstance(command, str) else _main_argument(args), guarded)
    parts = [p for p in (part.strip() for part in _CHAIN.split(_main_argument(args))) if p] or [""]
    if any(_matches(rule, tool, part) for rule in profile.deny for part in parts):
        return "deny"
    if not guarded:
        # A substitution may run a denied argument that no prefix can see: a human decides.
        named = any(rule.partition(":")[0] == tool for rule in profile.deny)
        hidden = any(mark in part for mark in _SUBSTITUTIONS for part in parts)
        return "ask" if named and hidden else "allow"
    if all(any(_allowed(rule, tool, part) for rule in profile.allow) for part in parts):
        return "allow"
    return "ask"


def unguarded_command(profile: Profile) -> bool:
    """Whether a profile that enables `run_command` lets any command run without anyone deciding:
    `approval_tools` does not name the tool, or an allow rule allows every command."""
    if profile.run_command is None:
        return False
    guarded = any(fnmatchcase(RUN_COMMAND, pattern) for pattern in profile.approval_tools)
    everything = any((rule := _Rule.of(text)) is not None and rule.argv is None for text in profile.allow)
    return not guarded or everything

"""docker-compose.yml read as Docker Compose reads it, for tests that run its services without Docker.

No Docker engine runs on the test machines, so tests/test_compose.py starts each
service's own `command` with its own environment (`env_file` then `environment`,
interpolated as Compose does) and runs its own `healthcheck`. What differs from a
container is only where things listen: `localize` rewrites host names and ports
(`redis:6379` to `127.0.0.1:<free port>`, `0.0.0.0` to `127.0.0.1`) and the
container paths of mounts to the files and folders they mount (`mounts`).

`load(override, ...)` merges override files over docker-compose.yml as
`docker compose -f docker-compose.yml -f <override>` does
(tests/test_compose_sentinel.py brings up deploy/docker-compose.sentinel.yml so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
SENTINEL_FILE = ROOT / "deploy" / "docker-compose.sentinel.yml"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, or $$ (a literal $).
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
# Compose durations as this file writes them: 5s, 1m30s.
_DURATION = re.compile(r"^(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?$")


# Service attributes a later file replaces whole: Compose's exception for shell commands.
_REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}
# Service attributes Compose reads as a mapping also when written as a KEY=VALUE list, and merges key by key.
_KEYED = {("environment",), ("labels",)}


def load(*overrides: Path) -> dict[str, Any]:
    """docker-compose.yml, with each of `overrides` merged over it in turn (`docker compose -f ... -f ...`)."""
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())  # YAML merge keys (<<: *subq) included
    for path in overrides:
        data = merge(data, yaml.safe_load(path.read_text()))
    return data


def merge(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    """`override` merged over `base` by Compose's rules (docs.docker.com/reference/compose-file/merge/).

    Mappings merge key by key; `environment` and `labels` by key whichever form each file
    writes them in (an empty value stays an empty value); `command`, `entrypoint` and a
    healthcheck's `test` are replaced; `volumes` merge by their container path; `ports`
    are appended once each; any other sequence is appended. `path` is the keys from the
    file's root to `base`.
    """
    attribute = path[2:] if path[:1] == ("services",) else ()
    if attribute in _REPLACED:
        return override
    if attribute in _KEYED:
        return {**_as_mapping(base), **_as_mapping(override)}
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value, (*path, key)) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(override, list):
        if attribute == ("volumes",):
            by_target = {_mount(entry)[1]: entry for entry in [*base, *override]}
            return list(by_target.values())
        if attribute == ("ports",):
            return [*base, *(entry for entry in override if entry not in base)]
        return [*base, *override]
    return override


def _as_mapping(value: dict[str, Any] | list[str]) -> dict[str, Any]:
    """KEY=VALUE entries as a mapping; a bare KEY is None (Compose takes it from its own shell)."""
    if isinstance(value, dict):
        return value
    return {key: (rest[0] if rest else None) for key, *rest in (entry.split("=", 1) for entry in value)}


def _mount(entry: str) -> tuple[str | None, str]:
    """(source, container path) of a short-syntax volume; no source for an anonymous volume."""
    parts = entry.split(":")
    return (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])


def mounts(name: str, spec: dict[str, Any], volumes_dir: Path) -> dict[str, str]:
    """Container path -> local path of each mount of service `name` (`spec`, as `load` gives it).

    A bind mount is its source, relative to the project directory (the first file's,
    the checkout); a named volume is the folder `volumes_dir/<volume>`, kept across a
    restart as Docker keeps the volume; a tmpfs is `volumes_dir/<service>-tmpfs<path>`.
    An anonymous volume has no name to find it by: the caller gives it a fresh folder.
    """
    paths: dict[str, str] = {}
    for entry in spec.get("volumes", []):
        source, target = _mount(entry)
        if source is None:
            continue
        local = ROOT / source if source.startswith((".", "/")) else volumes_dir / source
        paths[target] = str(local.resolve())
    tmpfs = spec.get("tmpfs", [])
    for target in [tmpfs] if isinstance(tmpfs, str) else tmpfs:
        paths[target] = str(volumes_dir / f"{name}-tmpfs{target}")
    return paths


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation of one string (the forms docker-compose.yml may use)."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = variables.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in ("-", ":-"):
            return arg if unset else str(value)
        if op in ("?", ":?"):
            if unset:
                raise ValueError(f"{name}: {arg}")
            return str(value)
        return value or ""

    return _VARIABLE.sub(substitute, text)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped (the subset of Compose's format .env.example uses)."""
    env: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{path}:{number}: not KEY=VALUE: {line!r}")
        env[key] = value
    return env


def seconds(duration: str) -> float:
    match = _DURATION.match(duration)
    if not duration or match is None:
        raise ValueError(f"not a duration this test reads: {duration!r}")
    return int(match.group("m") or 0) * 60 + int(match.group("s") or 0)


# host:port, in a URL or a list of addresses; the host starts where a word does.
_ADDRESS = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9][\w.-]*):(?P<port>\d+)\b")


@dataclass
class Localizer:
    """Host names, ports and mounted paths of the containers, as they are on this machine.

    Each rule is applied once, in one pass over the text, so a local port or path is
    never taken for a container's.
    """

    hosts: dict[str, str] = field(default_factory=dict)  # container host name -> local host
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port (the service's own)
    paths: dict[str, str] = field(default_factory=dict)  # container path -> local path
    # "host:port" -> "local host:local port", where services share a container port (every Redis node's 6379).
    addresses: dict[str, str] = field(default_factory=dict)

    def __call__(self, text: str) -> str:
        if self.paths:  # a path whole, or a folder before /<file>; never a part of a longer name
            names = "|".join(re.escape(path) for path in sorted(self.paths, key=len, reverse=True))
            text = re.sub(rf"(?<![\w./-])(?:{names})(?![\w.-])", lambda m: self.paths[m.group(0)], text)
        if text in {str(port) for port in self.ports}:  # an argument that is only a port: --port 8000
            return str(self.ports[int(text)])
        if text in self.hosts:  # a value that is only a host name: a node's own address
            return self.hosts[text]
        text = _ADDRESS.sub(self._address, text)
        return text.replace("0.0.0.0", "127.0.0.1")

    def _address(self, match: re.Match[str]) -> str:
        host, port = match.group("host"), int(match.group("port"))
        if f"{host}:{port}" in self.addresses:
            return self.addresses[f"{host}:{port}"]
        return f"{self.hosts.get(host, host)}:{self.ports.get(port, port)}"


@dataclass(frozen=True)
class Service:
    """One compose service as it would run: its argv, its environment, its healthcheck."""

    name: str
    command: list[str]
    environment: dict[str, str]
    healthcheck: list[str]  # argv; a CMD-SHELL test becomes sh -c
    healthcheck_timeout_s: float

    @classmethod
    def of(cls, name: str, env_file_dir: Path, localize: Localizer, compose: dict[str, Any] | None = None) -> Service:
        """Service `name` of `compose` (`load()` unless given), with `env_file_dir`'s .env."""
        spec = (compose or load())["services"][name]
        host_env = read_env_file(env_file_dir / ".env")  # Compose interpolates from .env too
        environment: dict[str, str] = {}
        if "env_file" in spec:
            files = spec["env_file"] if isinstance(spec["env_file"], list) else [spec["env_file"]]
            for env_file in files:
                environment.update(read_env_file(env_file_dir / env_file))
        # A KEY with no value takes Compose's own shell's, and no test sets one: the variable is unset.
        keyed = _as_mapping(spec.get("environment", {}))
        environment.update({key: str(value) for key, value in keyed.items() if value is not None})
        environment = {key: localize(interpolate(value, host_env)) for key, value in environment.items()}
        command = [localize(interpolate(arg, host_env)) for arg in spec["command"]]
        test = [interpolate(arg, host_env) for arg in spec["healthcheck"]["test"]]
        kind, args = test[0], test[1:]
        if kind == "CMD-SHELL":
            check = ["sh", "-c", localize(args[0])]
        elif kind == "CMD":
            check = [localize(arg) for arg in args]
        else:
            raise ValueError(f"{name}: healthcheck test {kind!r} is neither CMD nor CMD-SHELL")
        return cls(name, command, environment, check, seconds(spec["healthcheck"]["timeout"]))

"""docker-compose.yml read as Docker Compose reads it, for tests that run its services without Docker.

No Docker engine runs on the test machines, so tests/test_compose.py starts each
service's own `command` with its own environment (`env_file` then `environment`,
interpolated as Compose does) and runs its own `healthcheck`. What differs from a
container is only where things listen: `localize` rewrites host names and ports
(`redis:6379` to `127.0.0.1:<free port>`, `0.0.0.0` to `127.0.0.1`) and the
container paths of bind mounts to the files they mount.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, or $$ (a literal $).
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
# Compose durations as this file writes them: 5s, 1m30s.
_DURATION = re.compile(r"^(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?$")


def load() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())  # YAML merge keys (<<: *subq) included
    return data


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


@dataclass
class Localizer:
    """Host names, ports and bind-mounted paths of the containers, as they are on this machine."""

    hosts: dict[str, str] = field(default_factory=dict)  # container host name -> local host
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port
    paths: dict[str, str] = field(default_factory=dict)  # container path -> local path

    def __call__(self, text: str) -> str:
        for container_path, local_path in self.paths.items():
            text = text.replace(container_path, local_path)
        if text in {str(port) for port in self.ports}:  # an argument that is only a port: --port 8000
            return str(self.ports[int(text)])
        for port, local_port in self.ports.items():
            text = re.sub(rf"(?<=:){port}\b", str(local_port), text)  # host:port in a URL
        for host, local_host in self.hosts.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?=:\d)", local_host, text)  # host before :port
        return text.replace("0.0.0.0", "127.0.0.1")


@dataclass(frozen=True)
class Service:
    """One compose service as it would run: its argv, its environment, its healthcheck."""

    name: str
    command: list[str]
    environment: dict[str, str]
    healthcheck: list[str]  # argv; a CMD-SHELL test becomes sh -c
    healthcheck_timeout_s: float

    @classmethod
    def of(cls, name: str, env_file_dir: Path, localize: Localizer) -> Service:
        spec = load()["services"][name]
        host_env = read_env_file(env_file_dir / ".env")  # Compose interpolates from .env too
        environment: dict[str, str] = {}
        if "env_file" in spec:
            files = spec["env_file"] if isinstance(spec["env_file"], list) else [spec["env_file"]]
            for env_file in files:
                environment.update(read_env_file(env_file_dir / env_file))
        environment.update({key: str(value) for key, value in spec.get("environment", {}).items()})
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

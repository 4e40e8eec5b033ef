"""The OS sandbox a `run_command` command (and an MCP server with `sandbox = true`) runs in.

The approval policy's rules catch the obvious (workers/runtime/approval_policy.py), but
hundreds of programs run other programs or write files through their own options (`tar
--checkpoint-action=exec=...`, `git -c alias.x='!...'`, `find -delete`, `awk 'BEGIN{system(...)}'`),
and no rule over argv can know them all. The sandbox bounds whatever gets past the rules:

- **Files**: the whole filesystem is mounted read-only; only the command's `cwd` (and the
  folders an MCP entry names) is writable, with a private, empty `/tmp` and `/dev/shm` (memory:
  each at most the command's `memory_mb`; the rest of `/dev` is read-only). subq's own files
  are hidden (/dev/null or an empty read-only folder in their place; a folder between `cwd`
  and a path hidden in it is a mount point, which cannot be renamed to move the path out from
  under its cover): the profiles file, the API keys file, the Redis TLS key, and
  `SUBQ_SANDBOX_HIDDEN_PATHS` (`subq up` adds the folder of its credentials file). So are the
  Unix sockets that would let a command past its network namespace: a `unix://` Redis's, and
  the container engines' (`HOST_SOCKETS`): a read-only mount does not stop `connect()`, and a
  socket is a file, not the network. And the machine's usual credentials (`HOST_SECRETS`,
  `HOST_CREDENTIALS`, `HOME_CREDENTIALS`): the read-only view shows every file the worker's
  user can read.
- **Processes**: a PID namespace of its own, with its own `/proc`, so the worker's
  processes, and so their environment (`/proc/<pid>/environ`, with the Redis URL and the
  API token), cannot be read; when the command's first process exits, every process it
  left behind is killed with the namespace.
- **Network**: a network namespace of its own. With `network = false` (the default) it has
  only its own loopback. With `network = true` it reaches public hosts and never the host's
  loopback (Redis, the API, Flower) nor its private, link-local and metadata ranges; with
  `network = ["docs.example.org", "*.example.com"]` it reaches only those hosts, through a
  filtering proxy that records each refusal (workers/runtime/egress.py, which runs bwrap then).
- **Limits**: at most `max_processes` processes of the worker's user (RLIMIT_NPROC; the
  kernel does not apply it to root, so a worker run as root, unlike the image's, gets no
  process cap), `memory_mb` of data (RLIMIT_DATA), `max_file_mb` a file (RLIMIT_FSIZE) and
  `cpu_time_s` of CPU (RLIMIT_CPU), set by util-linux's `prlimit` inside the sandbox. Each is a
  process's own: shared memory (MAP_SHARED, memfd, System V) and the sum over processes are
  bounded only by a cgroup, such as the container's memory limit (docs/tools.md).

It is bubblewrap (`bwrap`, Debian's `bubblewrap`), the sandbox Flatpak and Claude Code use on
Linux; why bubblewrap and not Landlock is in docs/architecture.md. It needs user namespaces
and a mountable `/proc`, which a default container profile takes away: `probe` tries it once
a process, and a worker refuses a profile that runs commands in a sandbox it cannot start,
with one line saying what the pod needs (docs/deploy.md), unless the profile says
`sandbox = false`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from coordinator import RunCommand, Settings
from workers.runtime import egress

__all__ = [
    "BWRAP", "HOME_CREDENTIALS", "HOST_CREDENTIALS", "HOST_SECRETS", "HOST_SOCKETS", "NEEDS", "PRLIMIT", "Sandbox",
    "SandboxUnavailable", "probe",
]  # fmt: skip

BWRAP = "bwrap"
PRLIMIT = "prlimit"
MIB = 1024 * 1024
# The sockets that would run a program outside the sandbox, hidden where they exist: a command connected to one
# could start a privileged container or a unit of the host's systemd, whatever its `network` (a socket is a file
# in the read-only view, not the network). The container engines' (Docker's, containerd's, k3s's, CRI-O's,
# Podman's); the system bus and systemd's own (a worker run as root reaches them as root); and the login
# sessions' folders (`/run/user/<uid>`: the session bus, the user's systemd, rootless Docker and Podman).
HOST_SOCKETS = (
    "/run/docker.sock", "/var/run/docker.sock", "/run/containerd/containerd.sock", "/run/podman/podman.sock",
    "/run/k3s/containerd/containerd.sock", "/run/crio/crio.sock", "/run/dbus/system_bus_socket",
    "/var/run/dbus/system_bus_socket", "/run/systemd/private", "/run/user",
)  # fmt: skip
# The secrets a container platform mounts, hidden where they exist: Kubernetes' service account token (a pod's
# credentials for the cluster's API, mode 0644) and Docker's and Compose's secrets.
HOST_SECRETS = ("/run/secrets", "/var/run/secrets")
# The machine's own credentials, hidden where they exist: the read-only view shows every file the worker's user can
# read. The password hashes (and their backups), which a worker run as root reads.
HOST_CREDENTIALS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-")
# And, in the home of the worker's user (`subq up` runs as a developer), the usual places of SSH keys, the cloud
# CLIs' and kubectl's credentials, registry logins and package index and git tokens. Not the whole home: the
# worker's Python, and the programs a command runs, may live there (`~/.pyenv`, `~/.cargo`).
HOME_CREDENTIALS = (
    ".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".config/gh", ".netrc", ".npmrc", ".pypirc",
    ".git-credentials",
)  # fmt: skip
# What a worker's machine or pod must give for the sandbox to start (the refusal's line, docs/deploy.md).
NEEDS = (
    "bubblewrap (bwrap) and util-linux's prlimit installed, user namespaces allowed and /proc mountable "
    "(Docker: security_opt seccomp=unconfined, apparmor=unconfined, systempaths=unconfined; Kubernetes: "
    "seccompProfile and appArmorProfile Unconfined, procMount Unmasked); with the network, "
    f"{egress.NEEDS} and the device /dev/net/tun"
)
# How long the start probe may take: bwrap starts in milliseconds; a loaded machine is slow.
PROBE_TIMEOUT_S = 20.0


class SandboxUnavailable(Exception):
    """The sandbox cannot start on this machine: why, in one line."""


@dataclass(frozen=True)
class Sandbox:
    """The paths a process's sandboxed commands never see; `wrap` gives the argv that runs one confined."""

    hidden: tuple[Path, ...] = ()
    # Names the filtering proxy resolves to a fixed address (SUBQ_SANDBOX_RESOLVE).
    resolve: tuple[tuple[str, str], ...] = ()
    # The worker's environment variables a profile's MCP server reads as `${VAR}` (its token, say): secrets a
    # command is never given (commands.command_env), whatever their names.
    secrets: frozenset[str] = frozenset()
    # The credentials of the worker's home (HOME_CREDENTIALS) that exist: hidden from a model's commands, shown to
    # an MCP server the operator configured (a cluster's kubeconfig, gh's token may be what it works with).
    home_credentials: tuple[Path, ...] = ()

    @classmethod
    def of(cls, settings: Settings) -> Sandbox:
        known = (settings.profiles_file, settings.api_keys_file, settings.redis_tls_key_file, _redis_socket(settings))
        hidden = (
            *known, *_redis_url_keys(settings), *settings.sandbox_hidden_paths, *HOST_SOCKETS, *HOST_SECRETS,
            *HOST_CREDENTIALS,
        )  # fmt: skip
        paths = [Path(path).absolute() for path in hidden if path is not None]
        secrets = frozenset(
            name for profile in settings.profiles.values() for server in profile.mcp_servers
            for name in server.secret_names()
        )  # fmt: skip
        return cls(
            tuple(dict.fromkeys(paths)), tuple(settings.sandbox_resolve.items()), secrets, tuple(_home_credentials())
        )

    def wrap(
        self,
        argv: Sequence[str],
        cwd: Path,
        *,
        network: bool | Sequence[str],
        writable: Sequence[Path] | None = None,
        limits: RunCommand | None = None,
        refusals: Path | None = None,
        home_credentials: bool = False,
    ) -> list[str]:
        """`argv` run by bwrap in `cwd`: read-only but for `writable` (None: `cwd`) and a private /tmp;
        subq's files hidden (and the home's credentials, unless `home_credentials`); the network as `network`
        says (egress.py runs bwrap when there is one), each connection the proxy refused a line `host:port` in
        `refusals`."""
        # Every path resolved, at each command (a deploy flips its `current` link): bwrap mounts inside the new
        # root, where an absolute symlink's target is not yet ("Can't bind mount"), and a hidden file named
        # through a symlink one way and its folder the other way (`current` -> `releases/42`) was mounted over
        # by the folder's bind and never matched `is_relative_to` to be hidden again.
        cwd = cwd.resolve()
        own = [path.resolve() for path in ([cwd] if writable is None else writable)]
        hidden = [path.resolve() for path in (*self.hidden, *(() if home_credentials else self.home_credentials))]
        bwrap = egress.host_program(BWRAP) or BWRAP
        if network is True:
            wrapped = egress.launcher("public", refusals=refusals)
        elif network:
            wrapped = egress.launcher("hosts", allow=network, resolve=dict(self.resolve), refusals=refusals)
        else:
            wrapped = []
        # Never --share-net: with the network, egress.py gives the namespace its own way out.
        # --cap-drop ALL: bwrap started by root keeps every capability for the command otherwise, and a
        # command root in its namespaces could unmount what hides subq's files and delete its routes.
        wrapped += [bwrap, "--die-with-parent", "--unshare-all", "--cap-drop", "ALL"]
        wrapped += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # A tmpfs is memory, which no RLIMIT_DATA counts: /tmp, and /dev/shm (POSIX shared memory; --dev's own was
        # writable and unbounded), each hold at most the command's `memory_mb`, as its data does.
        size = ["--size", str(limits.memory_mb * MIB)] if limits is not None else []
        wrapped += [*size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm"]
        # The worker's own Python stays readable where the private /tmp would hide it (a checkout in
        # /tmp: an MCP server started from its virtual environment exited before it answered).
        for prefix in dict.fromkeys(Path(p).absolute() for p in (sys.prefix, sys.base_prefix)):
            if prefix.is_relative_to("/tmp"):
                wrapped += ["--ro-bind", str(prefix), str(prefix)]
        # Hidden first, then the writable folders (one inside a hidden folder stays reachable),
        # then what is hidden inside a writable folder again.
        wrapped += self._hide(hidden)
        for path in own:
            wrapped += ["--bind", str(path), str(path)]
        inner = [path for path in hidden if any(path.is_relative_to(folder) for folder in own)]
        wrapped += _pinned(inner, own)
        wrapped += self._hide(inner)
        # Each hidden folder read-only last, once everything inside it is mounted: bwrap runs its steps in order,
        # and a folder made read-only first refused the mount points a writable folder (or a hidden path) inside
        # it needed. Not recursive: a writable folder mounted inside one stays writable.
        for path in dict.fromkeys(path for path in hidden if path.is_dir()):
            wrapped += ["--remount-ro", str(path)]
        # And --dev's own tmpfs, where a file written was memory no limit bounded. Not recursive: its device nodes,
        # /dev/pts and /dev/shm are mounts of their own, and stay writable.
        wrapped += ["--remount-ro", "/dev"]
        wrapped += ["--setenv", "TMPDIR", "/tmp", "--chdir", str(cwd), "--"]
        if limits is not None:
            wrapped += [
                egress.host_program(PRLIMIT) or PRLIMIT,
                f"--nproc={limits.max_processes}",
                f"--data={limits.memory_mb * MIB}",
                f"--fsize={limits.max_file_mb * MIB}",
                f"--cpu={limits.cpu_time_s}",
                "--",
            ]
        return wrapped + list(argv)

    @staticmethod
    def _hide(paths: Iterable[Path]) -> list[str]:
        args: list[str] = []
        for path in paths:
            if path.is_dir():  # an empty folder, made read-only once all is mounted (`wrap`)
                args += ["--tmpfs", str(path)]
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        return args


def _pinned(hidden: Iterable[Path], writable: Sequence[Path]) -> list[str]:
    """Each folder between a writable folder and a path hidden inside it, bound onto itself: a mount point
    cannot be renamed, so a command cannot move the hidden path away from what hides it (`mv conf moved`, then
    `cat moved/profiles.toml` in its next command: the hiding is by path, and found nothing there). The folders
    stay writable; the writable folder and the hidden path are mount points already."""
    folders: set[Path] = set()
    for path in hidden:
        for top in writable:
            if path.is_relative_to(top):
                folders.update(parent for parent in path.parents if parent.is_relative_to(top) and parent != top)
    args: list[str] = []
    for folder in sorted(folders, key=lambda f: len(f.parts)):  # outer first: an inner bind goes on top of it
        if folder.is_dir():
            args += ["--bind", str(folder), str(folder)]
    return args


def _home_credentials() -> list[Path]:
    """HOME_CREDENTIALS in the worker's home that exist: $HOME's, and its user's in the password database where
    that differs (a service whose HOME points elsewhere still has its keys in its own home). A home the worker
    cannot enter (an inherited HOME, `sudo -E`) holds none it could show: left out, as `is_dir` would raise."""
    homes = [Path(os.path.expanduser("~"))]  # "~" itself when nothing names a home: not absolute, left out
    with contextlib.suppress(KeyError):  # a uid with no entry (a container run as an arbitrary user)
        homes.append(Path(pwd.getpwuid(os.getuid()).pw_dir))
    found = []
    for path in (home / name for home in dict.fromkeys(homes) if home.is_absolute() for name in HOME_CREDENTIALS):
        with contextlib.suppress(OSError):
            if path.exists():
                found.append(path.absolute())
    return found


def _redis_socket(settings: Settings) -> str | None:
    """The socket file of a `unix://` Redis URL (`unix:///run/redis/redis.sock?db=0`); None for TCP."""
    url = urlsplit(settings.redis_url or "")
    return url.path if url.scheme == "unix" and url.path else None


def _redis_url_keys(settings: Settings) -> list[str]:
    """The client TLS keys a Redis URL names (`rediss://h:6380/0?ssl_keyfile=/etc/subq/client.key`): with one Redis,
    TLS is set in its URL (redis-py reads its query), not in SUBQ_REDIS_TLS_KEY_FILE, which is Sentinel's."""
    query = parse_qs(urlsplit(settings.redis_url or "").query)
    return [value for value in query.get("ssl_keyfile", []) if value]


_probed: dict[str, str | None] = {}
_probe_lock = threading.Lock()
# The allow list the probe of a proxied sandbox starts with (a name that never resolves: nothing is asked).
PROBE_HOSTS = ("probe.invalid",)


def probe(network: bool | Sequence[str] = False) -> None:
    """Start the sandbox once (cached per process and kind of network: none, public, hosts);
    SandboxUnavailable says why not."""
    kind = "public" if network is True else "hosts" if network else "none"
    with _probe_lock:
        if kind not in _probed:
            _probed[kind] = _try(True if kind == "public" else PROBE_HOSTS if kind == "hosts" else False)
        why = _probed[kind]
    if why is not None:
        raise SandboxUnavailable(why)


def _try(network: bool | Sequence[str]) -> str | None:
    mode = "public" if network is True else "hosts"
    programs = (BWRAP, PRLIMIT, *(egress.needed_programs(mode) if network else ()))
    for program in programs:
        if egress.host_program(program) is None:
            return f"{program} is not installed"
    if network and not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing (pasta connects the sandbox's network through it)"
    with tempfile.TemporaryDirectory(prefix="subq-sandbox-probe-") as folder:
        argv = Sandbox().wrap(["true"], Path(folder), network=network, limits=RunCommand(cwd=Path(folder)))
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap did not start: {exc}"
    if done.returncode != 0:
        said = " ".join(done.stderr.split()) or f"exit {done.returncode}"
        return f"{'its network' if done.returncode == egress.SETUP_FAILED else 'bwrap'} cannot start here: {said}"
    return None

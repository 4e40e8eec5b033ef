"""A sandboxed process's way out to the network: public hosts without the host's own, or named hosts through a proxy.

A command (or a stdio MCP server) with `network = true` must reach the internet, and must not
reach subq's own control plane: Redis, the API and Flower listen on the host's loopback, and a
host's private networks hold other services and the cloud's metadata address. bwrap's
`--share-net` gave the command the host's network as it is, loopback included (a model's
command sent `SET pwned yes` to the local Redis). This program runs between the worker and
bwrap and gives the sandbox's network namespace of its own one of two ways out:

    egress.py public [--refusals FILE] -- bwrap ARGS...
    egress.py hosts --allow NAME [--allow NAME ...] [--resolve NAME=ADDR ...] [--refusals FILE] -- bwrap ARGS...

- **public** (`network = true`): pasta (Debian's `passt`), user-mode networking, connects the
  namespace to the outside through sockets of its own on the host, with no port of the host's
  loopback forwarded in (`-T none`) and the gateway not mapped to the host (`--no-map-gw`).
  Before the command starts, the namespace's routing table refuses ("prohibit") the loopback,
  private, shared, link-local (the cloud metadata address 169.254.169.254 among them),
  multicast and reserved ranges and each address of the host's own interfaces. IPv4 only:
  IPv6 gets no route. DNS goes through pasta's forwarder to the host's resolver.
- **hosts** (`network = ["docs.example.org", "*.example.com"]`): the namespace has no route
  at all. This program runs an HTTP proxy (CONNECT and plain HTTP) on the host's loopback;
  pasta forwards that one port of the namespace's loopback to it, and the command finds it in
  `HTTP_PROXY`/`HTTPS_PROXY`. The proxy lets a request through only to a listed name (`*.x`
  matches every name under x, not x itself) whose addresses are none of the ranges above;
  every refused connection is a line `host:port` appended to `--refusals`, which the worker
  turns into a `network_refused` UI line on the task and a metric.

It uses the standard library alone and is started as `python -I -S egress.py`: it starts with
every sandboxed command, so it imports nothing of subq's but coordinator/networks.py (the ranges no
connection of subq's may reach, standard library alone too), found beside its own package. bwrap is started with `--info-fd`
(its child's PID) and `--block-fd` (the command waits until the network is ready). pasta runs
in the foreground as this program's child, in its process group, and is ended with it: a
daemonised pasta attached to a PID outlives the namespace's last process.

Exit status: the command's (bwrap's); 125 and one line on stderr when the network could not be
set up (pasta missing, a namespace that did not come up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

if not __package__:  # started as its own program (-I -S, no path but its own folder): the tree it sits in
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from coordinator.networks import BLOCKED_NETWORKS, IpAddress, blocked_address, own_addresses

__all__ = [
    "BLOCKED_NETWORKS",
    "IP",
    "MAX_REFUSALS_BYTES",
    "NEEDS",
    "PASTA",
    "SETUP_FAILED",
    "allowed",
    "blocked",
    "host_program",
    "launcher",
    "missing_programs",
]

PASTA = "pasta"
IP = "ip"
NFT = "nft"
SYSTEM_FOLDERS = ("/usr/sbin", "/sbin")
# What a machine needs for a sandbox with the network (the worker's refusal names them; docs/deploy.md).
NEEDS = "pasta (Debian's passt), ip (iproute2) and nft (nftables)"
# The exit status when the network could not be set up (as `env` says for a command it cannot run).
SETUP_FAILED = 125
# Never reached from a sandbox: coordinator/networks.py's ranges (a webhook keeps off them too), and the host's
# own addresses.
# The namespace's own address and gateway (public): IETF protocol assignments (RFC 6890), where no
# public host lives, so no destination is hidden behind them. The gateway answers DNS (pasta forwards it).
NS_ADDRESS, NS_PREFIX, NS_GATEWAY = "192.0.0.2", "30", "192.0.0.1"
# How long pasta may take to bring the namespace's network up: milliseconds on a quiet machine.
READY_TIMEOUT_S = 15.0
# ioctl(2) on a namespace file: the user namespace that owns it (linux/nsfs.h); setns(2)'s kinds.
NS_GET_USERNS = 0xB701
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
# prctl(2): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)
READY_POLL_S = 0.005
# The proxy: a request head larger than this is refused; a connection to a listed host that does not
# open within CONNECT_TIMEOUT_S is a 504.
MAX_HEAD_BYTES = 64 * 1024
# A target the proxy reads: a DNS name (letters, digits, '-' and '.') or an IP address (no scope id), at most 253
# characters; anything else is a 400, never a refusal line (a line is `host:port`, nothing a command forged).
HOST_NAME = re.compile(r"[A-Za-z0-9.-]{1,253}")
# The refusals one sandboxed process may write: a command that loops on a refused host must not fill
# the worker's disk, memory or the task's UI (the worker shows 20 a call, and counts what it reads).
MAX_REFUSALS = 1000
# What the worker reads of a refusals file, at most: that many lines of a name and a port.
MAX_REFUSALS_BYTES = MAX_REFUSALS * len("x" * 253 + ":65535\n")
CONNECT_TIMEOUT_S = 10.0
PIPE_CHUNK = 64 * 1024


def host_program(name: str) -> str | None:
    """The program `name` as the host runs it, looked up in the absolute folders of PATH only: an empty or
    relative entry (`::`, `.`, `node_modules/.bin`) names a folder from the current one, which may be a command's
    own, where the model could have written a `pasta` or a `bwrap` that would then run outside the sandbox."""
    folders = [folder for folder in os.environ.get("PATH", os.defpath).split(os.pathsep) if os.path.isabs(folder)]
    # And the system's own folders of administration programs, which a user's PATH often leaves out (`nft` is only
    # in /usr/sbin on Debian).
    folders += [folder for folder in SYSTEM_FOLDERS if folder not in folders]
    return shutil.which(name, path=os.pathsep.join(folders))


def missing_programs(mode: str = "public") -> list[str]:
    """The programs a sandbox with the network of `mode` needs that are not installed here (an allow list's goes
    through the proxy alone, and needs no netfilter chain)."""
    return [program for program in needed_programs(mode) if host_program(program) is None]


def needed_programs(mode: str) -> tuple[str, ...]:
    """The programs a sandbox with the network of `mode` ('public' or 'hosts') runs."""
    return (PASTA, IP, NFT) if mode == "public" else (PASTA, IP)


def launcher(
    mode: str, allow: Sequence[str] = (), resolve: dict[str, str] | None = None, refusals: Path | None = None
) -> list[str]:
    """The argv that runs this program in `mode` ('public' or 'hosts'), to be followed by bwrap's argv."""
    argv = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), mode]
    for name in allow:
        argv += ["--allow", name]
    for name, address in (resolve or {}).items():
        argv += ["--resolve", f"{name}={address}"]
    if refusals is not None:
        argv += ["--refusals", str(refusals)]
    return [*argv, "--"]


def allowed(host: str, names: Iterable[str]) -> bool:
    """Whether `host` is on the allow list: equal to a name, or under a `*.` name (not the name itself)."""
    host = host.lower().rstrip(".")
    for name in names:
        name = name.lower().rstrip(".")
        if name.startswith("*."):
            if host.endswith(name[1:]) and len(host) > len(name) - 1:
                return True
        elif host == name:
            return True
    return False


def blocked(address: str, own: set[IpAddress] | None = None) -> bool:
    """Whether a sandbox may never reach `address` (a blocked range, or one of the host's own addresses)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    return blocked_address(ip, own)


# -- the proxy (hosts) --------------------------------------------------------------------


class Proxy:
    """An HTTP proxy that opens connections only to the listed hosts, and records each refusal."""

    def __init__(self, names: Sequence[str], resolve: dict[str, str], refusals: Path | None) -> None:
        self.names = tuple(names)
        self.resolve = {name.lower().rstrip("."): address for name, address in resolve.items()}
        self.refusals = refusals
        self.own = own_addresses()
        self.refused = 0

    def refuse(self, host: str, port: int) -> None:
        self.refused += 1
        if self.refusals is not None and self.refused <= MAX_REFUSALS:
            with contextlib.suppress(OSError), self.refusals.open("a") as out:
                out.write(f"{host}:{port}\n")

    async def addresses(self, host: str, port: int) -> list[str]:
        """Where `host` may be reached: its addresses, less every blocked one."""
        fixed = self.resolve.get(host.lower().rstrip("."))
        if fixed is not None:
            found = [fixed]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                return []
            found = [str(info[4][0]) for info in infos]
        return [address for address in dict.fromkeys(found) if not blocked(address, self.own)]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, _, rest = head.partition(b"\r\n")
        method, target, version = request_line.decode("latin-1").split(" ", 2)
        if method.upper() == "CONNECT":
            host, _, port_text = target.rpartition(":")
            host, port = host.strip("[]"), int(port_text)
            forward = b""
        else:
            parts = urlsplit(target)
            if parts.scheme != "http" or not parts.hostname:
                await _answer(writer, 400, "a proxy request names an absolute http:// URL")
                return
            host, port = parts.hostname, parts.port or 80
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            forward = f"{method} {path} {version}\r\n".encode("latin-1") + _one_request_headers(rest, host, port)
        if not _target(host) or not 0 < port < 65536:
            await _answer(writer, 400, "subq sandbox: the target is not a host name or an IP address and a port")
            return
        if not allowed(host, self.names):
            self.refuse(host, port)
            await _answer(writer, 403, f"subq sandbox: {host}:{port} is not on this profile's network allow list")
            return
        addresses = await self.addresses(host, port)
        if not addresses:
            self.refuse(host, port)
            await _answer(writer, 403, f"subq sandbox: {host} resolves to no public address")
            return
        upstream_reader, upstream_writer = await _open(addresses, port)
        if upstream_writer is None or upstream_reader is None:
            await _answer(writer, 504, f"subq sandbox: {host}:{port} did not accept a connection")
            return
        if not forward:
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            return
        # Plain HTTP: one request a connection. A kept-alive client (curl given two URLs, urllib3's ProxyManager)
        # sends its next request, for any host, on the same connection: it must come back on a new one, checked.
        # The request says `Connection: close`, so the server answers it alone; then both sides are closed.
        upstream_writer.write(forward)
        body = asyncio.ensure_future(_pipe(reader, upstream_writer))
        try:
            await _pipe(upstream_reader, writer)
        finally:
            body.cancel()
            upstream_writer.close()


def _one_request_headers(rest: bytes, host: str, port: int) -> bytes:
    """A plain HTTP request's header lines as forwarded: `Host` the checked host (a client's own could name another,
    and a virtual host or CDN routes by it), `Connection: close`, and none of the client's proxy or connection
    headers (a keep-alive would let its next request, unchecked, through)."""
    dropped = (b"host", b"connection", b"keep-alive", b"proxy-connection")
    kept = [
        line
        for line in rest.split(b"\r\n")
        if line and not line.lower().startswith(b"proxy-") and line.split(b":", 1)[0].strip().lower() not in dropped
    ]
    name = f"[{host}]" if ":" in host else host
    kept += [f"Host: {name}{'' if port == 80 else f':{port}'}".encode("latin-1"), b"Connection: close"]
    return b"".join(line + b"\r\n" for line in kept) + b"\r\n"


def _target(host: str) -> bool:
    """Whether `host` is a DNS name or an IP address without a scope id (what a refusal line may name)."""
    if HOST_NAME.fullmatch(host):
        return True
    # An IPv6 scope id (`fe80::1%eth0`) may hold any character but '%' and '/', a newline among them: a line
    # the worker would read as a refusal of the command's own making. No public host needs one.
    if "%" in host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _open(addresses: Sequence[str], port: int) -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None]:
    for address in addresses:
        try:
            return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError):
            continue
    return None, None


async def _answer(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 504: "Gateway Timeout"}[status]
    body = (text + "\n").encode()
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(OSError):
        await writer.drain()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(PIPE_CHUNK):
            sink.write(chunk)
            await sink.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            if sink.can_write_eof():
                sink.write_eof()


def _serve_forever(proxy: Proxy, listener: socket.socket) -> None:
    async def main() -> None:
        server = await asyncio.start_server(proxy.handle, sock=listener, limit=MAX_HEAD_BYTES)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the namespace ------------------------------------------------------------------------


class SetupFailed(Exception):
    """The sandbox's network could not be set up: why, in one line."""


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data


def _wait_until(watched: Sequence[subprocess.Popen[bytes]], ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        for proc in watched:
            if proc.poll() is not None:
                raise SetupFailed(f"{what}: a process it needs exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise SetupFailed(f"{what}: not ready within {READY_TIMEOUT_S:g}s")
        time.sleep(READY_POLL_S)


def _routed(pid: int) -> bool:
    """Whether pasta has given the namespace its default route (/proc/<pid>/net/route is the namespace's)."""
    try:
        lines = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(line.split()[1] == "00000000" for line in lines if len(line.split()) > 1)


def _listening(pid: int, port: int) -> bool:
    """Whether pasta listens on `port` in the namespace (its forward of the proxy's port)."""
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(f":{port:04X}" in line.split()[1] and line.split()[3] == "0A" for line in lines if len(line.split()) > 3)


@dataclass
class Sandboxed:
    """The sandbox's network namespace, open, and the user namespace that owns it.

    bwrap (with `--dev`) puts its process in a second user namespace, nested in the one that owns the
    network namespace, and only the owner gives the right to join it and change its routes: neither
    nsenter (it enters the process's own) nor pasta given the PID (it joins the same) can. NS_GET_USERNS
    on the network namespace names its owner; where that is this process's own (a worker run as root),
    only the network namespace is entered.
    """

    net: int
    owner: int
    foreign: bool

    @classmethod
    def of(cls, pid: int) -> Sandboxed:
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        owner = fcntl.ioctl(net, NS_GET_USERNS)
        os.set_inheritable(owner, False)
        return cls(net, owner, os.fstat(owner).st_ino != os.stat("/proc/self/ns/user").st_ino)

    def close(self) -> None:
        for fd in (self.net, self.owner):
            with contextlib.suppress(OSError):
                os.close(fd)

    def pasta_args(self) -> list[str]:
        """pasta's arguments that name the namespaces (their descriptors, passed to it)."""
        if self.foreign:
            return ["--userns", f"/proc/self/fd/{self.owner}", "--netns", f"/proc/self/fd/{self.net}"]
        return ["--netns-only", "--netns", f"/proc/self/fd/{self.net}"]

    def enter(self) -> None:
        """In a child, between fork and exec: enter the namespace (through its owner where that is not ours)."""
        _die_with_parent()
        for fd, kind in ((self.owner, CLONE_NEWUSER), (self.net, CLONE_NEWNET)):
            if (kind == CLONE_NEWNET or self.foreign) and LIBC.setns(fd, kind) != 0:
                raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")


def _die_with_parent() -> None:
    """This process is killed when its parent dies (a worker killed with SIGKILL takes its sandboxes along)."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _prohibit(space: Sandboxed) -> None:
    """Refuse every blocked IPv4 range, and each of the host's own addresses, in the namespace: in its routing, and
    in a netfilter output chain.

    The routes alone did not hold: a socket that names its interface (SO_BINDTODEVICE, IP_UNICAST_IF, an
    IP_PKTINFO message's index; no capability needed) skips a route lookup that fails, the kernel takes the address
    as on that link, and pasta carries the packet to it: 10.0.0.0/8, the metadata service. The chain sees every
    packet the namespace sends whatever its socket named, and refuses it at once (a TCP reset, an ICMP refusal)."""
    nets = {net for net in BLOCKED_NETWORKS if isinstance(net, ipaddress.IPv4Network)}
    nets |= {ipaddress.IPv4Network(f"{ip}/32") for ip in own_addresses() if ip.version == 4}
    collapsed = [str(net) for net in ipaddress.collapse_addresses(nets)]  # (an nft set refuses overlapping ranges)
    for program, text, what in (
        (IP, "".join(f"route add prohibit {net}\n" for net in collapsed), "routes"),
        (NFT, _ruleset(collapsed), "netfilter"),
    ):
        done = subprocess.run(
            [host_program(program) or program, *(("-batch", "-") if program == IP else ("-f", "-"))],
            input=text.encode(),
            capture_output=True,
            preexec_fn=space.enter,
        )
        if done.returncode != 0:
            raise SetupFailed(f"{what}: {' '.join(done.stderr.decode(errors='replace').split())[:300]}")


def _ruleset(nets: Sequence[str]) -> str:
    """The namespace's output chain: its own loopback and pasta's DNS forwarder pass; a blocked range is refused."""
    blocked = ", ".join(nets)
    return (
        "table ip subq_sandbox {\n"
        "  chain out {\n"
        "    type filter hook output priority 0; policy accept;\n"
        '    oifname "lo" accept\n'
        f"    ip daddr {NS_GATEWAY} accept\n"
        f"    ip daddr {{ {blocked} }} meta l4proto tcp reject with tcp reset\n"
        f"    ip daddr {{ {blocked} }} reject with icmp type admin-prohibited\n"
        "  }\n"
        "}\n"
    )


def _pasta(space: Sandboxed, public: bool, port: int | None, log: Path) -> subprocess.Popen[bytes]:
    argv = [host_program(PASTA) or PASTA, "--foreground", "--quiet", "--log-file", str(log), "--ipv4-only"]
    # pasta started as root would become nobody, who may not enter a namespace of root's.
    argv += [f"--runas={os.getuid()}:{os.getgid()}", "--no-map-gw", "-t", "none", "-u", "none", "-U", "none"]
    argv += ["-T", str(port) if port is not None else "none"]
    if public:
        argv += ["--config-net", "-a", NS_ADDRESS, "-n", NS_PREFIX, "-g", NS_GATEWAY, "--dns-forward", NS_GATEWAY]
    return subprocess.Popen(
        [*argv, *space.pasta_args()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(space.net, space.owner),
        preexec_fn=_die_with_parent,
    )


@dataclass
class _WayOut:
    """What bwrap is given for one way out: arguments of its own, the descriptors they name, and (hosts) the
    proxy's listening socket."""

    args: list[str]
    fds: list[int]
    listener: socket.socket | None = None


def _public_way_out() -> _WayOut:
    """The namespace's /etc/resolv.conf names pasta's DNS forwarder (bound read-only from a pipe)."""
    resolv_r, resolv_w = os.pipe()
    os.write(resolv_w, f"nameserver {NS_GATEWAY}\n".encode())
    os.close(resolv_w)
    return _WayOut(["--ro-bind-data", str(resolv_r), "/etc/resolv.conf"], [resolv_r])


def _proxied_way_out() -> _WayOut:
    """A proxy listening on the host's loopback, which the command finds in its proxy variables (no exceptions)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    proxy_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    args: list[str] = []
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        args += ["--setenv", name, proxy_url]
    args += ["--unsetenv", "no_proxy", "--unsetenv", "NO_PROXY", "--unsetenv", "ALL_PROXY"]
    return _WayOut(args, [], listener)


def _start_bwrap(bwrap: list[str], way: _WayOut) -> tuple[subprocess.Popen[bytes], int, int]:
    """bwrap started with the way out's arguments; the read end of its info pipe (its child's PID comes there) and
    the write end of its block pipe (the command waits until something is written there, or it closes)."""
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    extra = [*way.args, "--info-fd", str(info_w), "--block-fd", str(block_r)]
    # Before bwrap's own `--`, after its mounts: a mount given before `--ro-bind / /` would be hidden by it.
    split = bwrap.index("--") if "--" in bwrap else len(bwrap)
    # Its own death signal from the fork on, as pasta's: bwrap's `--die-with-parent` is set once bwrap runs, and
    # a SIGKILL of this program before then (a loaded host is slow) left bwrap behind.
    sandbox = subprocess.Popen(
        [*bwrap[:split], *extra, *bwrap[split:]], pass_fds=(info_w, block_r, *way.fds), preexec_fn=_die_with_parent
    )
    for fd in (info_w, block_r, *way.fds):
        os.close(fd)
    return sandbox, info_r, block_w


@dataclass
class _Network:
    """The sandbox's network as it is set up: bwrap, then its namespace's process and pasta, each once there."""

    sandbox: subprocess.Popen[bytes]
    pid: int | None = None
    space: Sandboxed | None = None
    pasta: subprocess.Popen[bytes] | None = None

    def end_on_signals(self) -> None:
        """A signal that ends this program kills bwrap and pasta first, rather than leave the command unwatched."""

        def end(signum: int, _frame: object) -> None:
            for proc in (self.sandbox, self.pasta):
                if proc is not None and proc.poll() is None:
                    proc.kill()
            os._exit(128 + signum)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, end)

    def connect(self, info_r: int, way: _WayOut, args: argparse.Namespace, log: Path) -> None:
        """pasta connects the namespace bwrap made, and this returns once the way out is ready (raises if it is not)."""
        try:
            info = json.loads(_read_all(info_r) or b"{}")
        finally:
            os.close(info_r)
        self.pid = pid = int(info.get("child-pid", 0))
        if not pid:
            raise SetupFailed("bwrap reported no sandbox process")
        listener = way.listener
        port = listener.getsockname()[1] if listener is not None else None
        self.space = Sandboxed.of(pid)
        self.pasta = _pasta(self.space, listener is None, port, log)
        if listener is None:
            _wait_until([self.pasta, self.sandbox], lambda: _routed(pid), "pasta")
            _prohibit(self.space)
        else:
            assert port is not None
            _wait_until([self.pasta, self.sandbox], lambda: _listening(pid, port), "pasta")
            proxy = Proxy(args.allow, dict(pair.split("=", 1) for pair in args.resolve), args.refusals)
            threading.Thread(target=_serve_forever, args=(proxy, listener), daemon=True).start()

    def abandon(self) -> None:
        """Ends what was started, when the network could not be set up."""
        # The command waits on the block pipe, and an end of file would start it: end it before that closes.
        if self.pid:  # 0: bwrap ended before naming its child, and os.kill(0) would kill this whole group
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        self.sandbox.kill()
        self.sandbox.wait()
        if self.pasta is not None:
            self.pasta.kill()
            self.pasta.wait()
        if self.space is not None:
            self.space.close()

    def start_command(self, block_w: int) -> int:
        """Lets the command start, once connected, and waits for it: bwrap's exit status."""
        assert self.space is not None and self.pasta is not None, "connect() first"
        self.space.close()
        os.write(block_w, b"go")
        os.close(block_w)
        code = self.sandbox.wait()
        self.pasta.kill()
        self.pasta.wait()
        return code


def run(args: argparse.Namespace, bwrap: list[str]) -> int:
    if missing := missing_programs(args.mode):
        raise SetupFailed(f"{', '.join(missing)} not installed (a sandbox with the network needs {NEEDS})")
    # Started by a worker that may die with SIGKILL: this program, and so bwrap (--die-with-parent) and
    # pasta (its own death signal), go with it, rather than leave the command running unwatched.
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:
        return SETUP_FAILED
    way = _public_way_out() if args.mode == "public" else _proxied_way_out()
    sandbox, info_r, block_w = _start_bwrap(bwrap, way)
    network = _Network(sandbox)
    network.end_on_signals()
    with tempfile.TemporaryDirectory(prefix="subq-egress-") as folder:
        log = Path(folder) / "pasta.log"
        try:
            network.connect(info_r, way, args, log)
        except (SetupFailed, OSError, ValueError) as exc:
            said = " ".join(log.read_text(errors="replace").split())[:300] if log.exists() else ""
            network.abandon()
            print(
                f"subq sandbox: the network could not be set up: {exc}{f' ({said})' if said else ''}", file=sys.stderr
            )
            return SETUP_FAILED
        code = network.start_command(block_w)
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: egress.py public|hosts [--allow NAME]... [--resolve NAME=ADDR]... [--refusals FILE] -- bwrap ARGS",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="egress.py")
    parser.add_argument("mode", choices=("public", "hosts"))
    parser.add_argument("--allow", action="append", default=[])
    parser.add_argument("--resolve", action="append", default=[])
    parser.add_argument("--refusals", type=Path)
    args = parser.parse_args(argv[:split])
    bwrap = argv[split + 1 :]
    if not bwrap:
        parser.error("no bwrap command after --")
    try:
        return run(args, bwrap)
    except SetupFailed as exc:
        print(f"subq sandbox: the network could not be set up: {exc}", file=sys.stderr)
        return SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main())

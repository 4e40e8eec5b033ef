"""A sandbox's network (workers/runtime/egress.py): real bubblewrap, real pasta, a real proxy, real Redis.

The reproduction this answers: a command with `network = true` opened a connection to subq's own
Redis on 127.0.0.1 and sent `SET pwned yes`. Now `network = true` reaches public hosts and never
the host's loopback, its own addresses or the private, link-local and metadata ranges; and
`network = [hosts]` reaches only those hosts, through a proxy that records each refusal.

"A public host" is a web server in a network namespace this file makes (`ip netns`, a veth
pair, TEST-NET-2 addresses: 198.51.100.0/30), which the host reaches over the veth: nothing
leaves the machine. Making one needs root (as CI and ./scripts/test run); elsewhere the tests
that need it are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator import ConfigError, Coordinator, McpServer, Profile, RunCommand, Settings, TaskStatus, load_settings
from tests.agents import agent, call, reply
from tests.conftest import dedicated_fleet
from tests.helpers import assert_worker_refuses, connections_counted, counting_listener, eventually, subq_tools
from workers.runtime import commands, egress
from workers.runtime.sandbox import Sandbox

# The "public host": its address and the host's end of the veth (one of the host's own addresses then).
PUBLIC, HOST_END = "198.51.100.2", "198.51.100.1"
PRIVATE, PRIVATE_HOST_END = "10.254.77.2", "10.254.77.1"
MARKER = "a page from the public host"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="making a network namespace needs root and iproute2"
)


# The public host's web server: HTTP/1.1, which keeps a connection open for a next request (as most servers
# do); `/marker` is MARKER, any other path the Host header and the path it was asked for.
PUBLIC_SERVER = """
import http.server, socket, sys, threading
class Page(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = (sys.argv[2] if self.path == "/marker" else f"Host={self.headers['Host']} {self.path}\\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
def echo():  # UDP port 80 answers each datagram with the marker
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((sys.argv[1], 80))
    while True:
        _, sender = udp.recvfrom(512)
        udp.sendto(sys.argv[2].encode(), sender)
threading.Thread(target=echo, daemon=True).start()
http.server.ThreadingHTTPServer((sys.argv[1], 80), Page).serve_forever()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _host_in_namespace(address: str, host_end: str) -> Iterator[str]:
    """A web server (and a UDP echo) at `address`:80 in a network namespace of its own (PUBLIC_SERVER), the host's
    end of its veth at `host_end` (/30)."""
    name = f"subqpub{uuid.uuid4().hex[:6]}"
    outer, inner = f"{name}h", f"{name}p"
    _ip("netns", "add", name)
    server: subprocess.Popen[bytes] | None = None
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("addr", "add", f"{host_end}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        for args in (
            ("addr", "add", f"{address}/30", "dev", inner),
            ("link", "set", inner, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", name, "ip", *args)
        server = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-c", PUBLIC_SERVER, address, MARKER],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _until_answers(address, 80)
        yield address
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def public_host() -> Iterator[str]:
    """A web server at PUBLIC:80 in a network namespace of its own (PUBLIC_SERVER)."""
    with _host_in_namespace(PUBLIC, HOST_END) as address:
        yield address


@pytest.fixture(scope="module")
def private_host() -> Iterator[str]:
    """The same server at an address of a private range (10.0.0.0/8) that the host reaches: where a cloud's
    metadata service, a Compose network's Redis or a cluster's API sit."""
    with _host_in_namespace(PRIVATE, PRIVATE_HOST_END) as address:
        yield address


def _until_answers(address: str, port: int) -> None:
    for _ in range(500):
        try:
            socket.create_connection((address, port), 0.1).close()
            return
        except OSError:
            threading.Event().wait(0.02)
    raise AssertionError(f"{address}:{port} never answered")


@pytest.fixture
def listener() -> Iterator[tuple[int, list[object]]]:
    """A TCP listener on every address of this host (0.0.0.0) that counts the connections it accepts."""
    with counting_listener("0.0.0.0") as counted:
        yield counted


def _run(command: str, cwd: Path, hiding: Sandbox | None = None, **config: Any) -> commands.CommandResult:
    return asyncio.run(commands.run(command, RunCommand(cwd=cwd, **config), sandbox=hiding))


# A client that sends Redis commands over a raw socket, as the reproduction's command did.
REDIS_SET = (
    "python3 -c 'import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); "
    'pw=sys.argv[3]; s.sendall((f"AUTH {{pw}}\\r\\n" if pw else "").encode() + b"SET pwned yes\\r\\n"); '
    "print(s.recv(100))' {host} {port} {password}"
)
# A real MCP server nobody here wrote (the `dev` extra), that fetches URLs.
FETCH_SERVER = str(Path(sys.executable).parent / "mcp-server-fetch")
CONNECT = "python3 -c 'import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); print(\"connected\")' {host} {port}"
CURL = "curl -fsS -m 10 {flags} http://{target}/marker"


def _own_address() -> str:
    """An address of this host's own that is not loopback (a service bound to 0.0.0.0 answers on it)."""
    found = sorted(str(ip) for ip in egress.own_addresses() if ip.version == 4 and not ip.is_loopback)
    assert found, "this host has an IPv4 address besides loopback"
    return found[0]


def test_the_allow_list_matches_names_and_names_under_a_wildcard() -> None:
    names = ["docs.example.org", "*.example.com"]
    assert egress.allowed("docs.example.org", names) and egress.allowed("DOCS.example.org.", names)
    assert egress.allowed("a.example.com", names) and egress.allowed("a.b.example.com", names)
    assert not egress.allowed("example.com", names), "*.x names what is under x, not x"
    assert not egress.allowed("evil-example.com", names) and not egress.allowed("example.org", names)
    assert not egress.allowed("docs.example.org.evil.net", names)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1", "169.254.169.254", "0.0.0.0",
     "::1", "fd00:ec2::254", "fe80::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "not an address",
     "::7f00:1", "::a00:1", "64:ff9b:1::a00:1", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "100::1",
     "168.63.129.16", "100.100.100.200", "192.0.0.192", "fd20:ce::254"],
)  # fmt: skip
def test_loopback_private_link_local_and_metadata_addresses_are_blocked(address: str) -> None:
    assert egress.blocked(address)


def test_only_the_public_network_needs_nft(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allow list goes through the proxy alone: a machine without nft gives it, and refuses `network = true`."""
    found = egress.host_program
    monkeypatch.setattr(egress, "host_program", lambda name: None if name == egress.NFT else found(name))
    assert egress.missing_programs("hosts") == [] and egress.missing_programs("public") == [egress.NFT]


def test_public_addresses_are_not_blocked_but_the_hosts_own_are() -> None:
    assert not egress.blocked("198.51.100.2") and not egress.blocked("2001:db8::1")
    own = _own_address()
    assert egress.blocked(own, egress.own_addresses()) and not egress.blocked(own, set())


def test_public_reaches_no_service_of_the_host(
    tmp_path: Path, redis_url: str, listener: tuple[int, list[object]]
) -> None:
    """The reproduction, and every other way to the host's services: each fails, and nothing changed."""
    port, accepted = listener
    client = redis.Redis.from_url(redis_url)
    client.delete("pwned")
    parts = redis.connection.parse_url(redis_url)
    password = parts.get("password") or ""
    for host in ("127.0.0.1", "localhost", _own_address()):
        tried = _run(REDIS_SET.format(host=host, port=parts["port"], password=password), tmp_path, network=True)
        assert tried.exit_code != 0 and "Error" in tried.output, tried.text()
    assert client.get("pwned") is None, "Redis is unchanged"
    for host in ("127.0.0.1", _own_address(), "169.254.169.254", "10.0.0.1"):
        tried = _run(CONNECT.format(host=host, port=port), tmp_path, network=True, timeout_s=20)
        assert tried.exit_code != 0 and "connected" not in tried.output, (host, tried.text())
    assert accepted == [], "the listener on every address of the host counted no connection"
    unconfined = _run(CONNECT.format(host="127.0.0.1", port=port), tmp_path, sandbox=False)
    assert unconfined.text() == "exit 0\nconnected\n", "the same command outside the sandbox"
    # One, the unconfined: none of the sandboxed ones came before it.
    assert connections_counted(accepted, 1) == 1, "the listener counted the command outside the sandbox alone"
    client.close()


@needs_root
def test_public_reaches_a_public_host_and_none_has_no_network(tmp_path: Path, public_host: str) -> None:
    reached = _run(CURL.format(flags="", target=public_host), tmp_path, network=True)
    assert reached.text() == f"exit 0\n{MARKER}", reached.text()
    assert _run(CURL.format(flags="", target=public_host), tmp_path, network=False).exit_code != 0
    # The host's end of the veth is one of the host's own addresses: a service bound to 0.0.0.0 is there.
    assert _run(CURL.format(flags="", target=HOST_END), tmp_path, network=True).exit_code != 0


# Ways to the host's network that name the interface, which a failed route lookup then skips (no capability needed):
# a TCP connect from a socket bound to the device, a UDP datagram whose IP_PKTINFO names its index, and the plain
# connect beside them. Each prints what it reached, or the error.
NAMED_INTERFACE = """python3 -c '
import socket, struct, sys
host = sys.argv[1]
dev = [n for _, n in socket.if_nameindex() if n != "lo"][0]
def tried(label, attempt):
    try:
        print(label, attempt())
    except OSError as exc:
        print(label, "refused:", exc.strerror)
def bound():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, dev.encode())
    s.settimeout(5)
    s.connect((host, 80))
    return "connected"
def pktinfo():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(5)
    info = struct.pack("I4s4s", socket.if_nametoindex(dev), bytes(4), bytes(4))
    u.sendmsg([b"x"], [(socket.IPPROTO_IP, 8, info)], 0, (host, 80))  # 8: IP_PKTINFO (linux/in.h)
    return u.recv(100).decode()
tried("bound:", bound)
tried("pktinfo:", pktinfo)
tried("plain:", lambda: socket.create_connection((host, 80), 5) and "connected")
' {host}"""


# What NAMED_INTERFACE prints for an address the namespace refuses (its routes and its netfilter chain).
REFUSED_EVERY_WAY = (
    "exit 0\nbound: refused: Connection refused\npktinfo: refused: Operation not permitted\n"
    "plain: refused: Permission denied\n"
)


@needs_root
def test_public_reaches_no_private_address_through_a_socket_that_names_its_interface(
    tmp_path: Path, public_host: str, private_host: str
) -> None:
    """The routes that refuse the blocked ranges are skipped by a socket that names its interface: the kernel takes
    the address as on that link and pasta carried the packet to it. The namespace's netfilter chain refuses them."""
    reached = _run(NAMED_INTERFACE.format(host=public_host), tmp_path, network=True, timeout_s=60)
    assert reached.text() == f"exit 0\nbound: connected\npktinfo: {MARKER}\nplain: connected\n", reached.text()
    tried = _run(NAMED_INTERFACE.format(host=private_host), tmp_path, network=True, timeout_s=60)
    assert tried.text() == REFUSED_EVERY_WAY, tried.text()
    unconfined = _run(NAMED_INTERFACE.format(host=private_host), tmp_path, sandbox=False, timeout_s=60)
    assert "plain: connected" in unconfined.text(), "the private host answers the same command outside the sandbox"


def test_public_never_reaches_azures_wireserver(tmp_path: Path) -> None:
    """Azure's WireServer, 168.63.129.16, is a public address that every Azure VM reaches, and it hands the VM its
    certificates and extensions' settings: no private range holds it, and `network = true` reached it (a timeout
    here, off Azure). It is refused at once, every way, as the metadata address is."""
    tried = _run(NAMED_INTERFACE.format(host="168.63.129.16"), tmp_path, network=True, timeout_s=60)
    assert tried.text() == REFUSED_EVERY_WAY, tried.text()


@needs_root
def test_an_allow_list_reaches_its_hosts_through_the_proxy_and_nothing_else(
    tmp_path: Path, public_host: str, listener: tuple[int, list[object]]
) -> None:
    port, accepted = listener
    proxied = Sandbox(resolve=(("allowed.test", public_host), ("other.test", public_host)))
    allow = ["allowed.test"]
    reached = _run(CURL.format(flags="", target="allowed.test"), tmp_path, proxied, network=allow)
    assert reached.text() == f"exit 0\n{MARKER}" and reached.refused == (), reached.text()
    other = _run(CURL.format(flags="", target="other.test"), tmp_path, proxied, network=allow)
    assert other.exit_code != 0 and other.refused == ("other.test:80",), other.text()
    tunnel = _run("curl -fsS -m 10 https://other.test/", tmp_path, proxied, network=allow)
    assert tunnel.exit_code != 0 and tunnel.refused == ("other.test:443",), tunnel.text()
    direct = _run(CURL.format(flags="--noproxy '*'", target=public_host), tmp_path, proxied, network=allow)
    assert direct.exit_code != 0 and direct.refused == (), "no route but the proxy's"
    # A listed name whose address is the host's own loopback is refused too (DNS pointing home).
    home = Sandbox(resolve=(("allowed.test", "127.0.0.1"),))
    pointed = _run(CURL.format(flags="", target=f"allowed.test:{port}"), tmp_path, home, network=allow)
    assert pointed.exit_code != 0 and pointed.refused == (f"allowed.test:{port}",) and accepted == []


@needs_root
def test_the_proxy_checks_each_plain_http_request_and_sends_the_checked_host(tmp_path: Path, public_host: str) -> None:
    """A kept-alive connection to the proxy carried a next request, for any host, unchecked to the first one's
    server, and a request's own Host header went on as the client wrote it: a virtual host or a CDN routes by it."""
    proxied = Sandbox(resolve=(("allowed.test", public_host), ("other.test", public_host)))
    allow = ["allowed.test"]
    # curl keeps its connection to the proxy for its next plain http:// URL, as urllib3's ProxyManager does.
    both = _run("curl -sS -m 10 http://allowed.test/one http://other.test/two", tmp_path, proxied, network=allow)
    assert "Host=allowed.test /one\n" in both.output and "Host=other.test" not in both.output, both.text()
    assert both.refused == ("other.test:80",), both.text()
    named = _run("curl -sS -m 10 -H 'Host: other.test' http://allowed.test/three", tmp_path, proxied, network=allow)
    assert named.text() == "exit 0\nHost=allowed.test /three\n", named.text()


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"network": "sometimes"}, "give false (no network), true (public hosts) or a list of host names"),
        ({"network": []}, "give false (no network), true (public hosts) or a list of host names"),
        ({"network": ["packages.example.net", "bad host"]}, "'bad host' is not a host name"),
        ({"network": ["*"]}, "'*' is not a host name"),
        ({"network": ["http://packages.example.net/"]}, "'http://packages.example.net/' is not a host name"),
    ],
)
def test_a_bad_network_setting_is_one_line_naming_the_entry(
    tmp_path: Path, table: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(profiles={"builder": {"run_command": {"cwd": str(tmp_path), **table}}})
    assert str(caught.value).startswith(f"Invalid setting SUBQ_PROFILES (builder.run_command.network): {error}")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ('{"allowed.test": "nowhere"}', "allowed.test: 'nowhere' is not an IP address"),
        ('{"*.test": "198.51.100.2"}', "'*.test' is not a host name"),
        ("allowed.test=198.51.100.2", 'not JSON (Expecting value); give {"name": "address"}'),
        ('["allowed.test"]', 'give a JSON object {"name": "address"}'),
    ],
)
def test_a_bad_sandbox_resolve_is_one_line(value: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(sandbox_resolve=value)
    assert str(caught.value) == f"Invalid setting SUBQ_SANDBOX_RESOLVE: {error}"


def test_a_worker_refuses_a_network_it_cannot_give(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """bubblewrap and prlimit are there; pasta is not: a profile with the network is refused in one line."""
    # Outside /tmp: the sandbox's /tmp is its own, and prlimit and `true` run inside it.
    bin_dir = Path(tempfile.mkdtemp(prefix="subq-bin-", dir="/var/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(bin_dir, ignore_errors=True))
    for program in ("bwrap", "prlimit", "ip", "true"):
        found = shutil.which(program)
        assert found, program
        (bin_dir / program).symlink_to(found)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{bin_dir}")
    builder = Profile(run_command=RunCommand(cwd=tmp_path, network=["packages.example.net"]))
    own = settings.model_copy(update={"profiles": {"builder": builder}})
    from workers.runtime.sandbox import NEEDS

    line = (
        "Invalid profile 'builder': run_command: its OS sandbox cannot start here (pasta is not installed); "
        f"the worker needs {NEEDS}, or set sandbox = false"
    )
    assert_worker_refuses(own, tmp_path / "refused", line)
    offline = own.model_copy(update={"profiles": {"builder": Profile(run_command=RunCommand(cwd=tmp_path))}})
    assert subq_tools(offline).returncode == 0, "without the network, pasta is not needed"


def test_subq_tools_shows_each_programs_network(settings: Settings, tmp_path: Path) -> None:
    fetch = McpServer(name="fetch", command=FETCH_SERVER, sandbox=True, network=["docs.example.org"])
    profiles = {
        "quiet": Profile(run_command=RunCommand(cwd=tmp_path)),
        "public": Profile(run_command=RunCommand(cwd=tmp_path, network=True)),
        "listed": Profile(
            run_command=RunCommand(cwd=tmp_path, network=["packages.example.net", "*.example.com"]), mcp_servers=[fetch]
        ),
        "loose": Profile(run_command=RunCommand(cwd=tmp_path, sandbox=False)),
    }
    listed = subq_tools(settings.model_copy(update={"profiles": profiles}))
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    assert "quiet:" in out and "  network: run_command: none\n" in out
    assert "  network: run_command: public\n" in out
    assert (
        "  network: run_command: hosts packages.example.net, *.example.com; mcp:fetch: hosts docs.example.org\n" in out
    )
    assert "  network: run_command: unconfined (sandbox = false)\n" in out


def _returns_and_ui(coord: Any, task_id: str) -> tuple[list[Any], list[tuple[str, str]]]:
    returns = [p["content"] for m in coord.messages(task_id, kind="api") for p in m["parts"]
               if p.get("part_kind") == "tool-return"]  # fmt: skip
    ui = [(m.get("say", ""), m.get("text", "")) for m in coord.messages(task_id)]
    return returns, ui


@pytest.fixture(scope="module")
def networked(settings: Settings, tmp_path_factory: pytest.TempPathFactory, public_host: str) -> Iterator[Coordinator]:
    """One real worker for the two acceptance runs (a start of its own each cost 2.5 s of CPU): commands with the
    network (public) or an allow list (listed), and a sandboxed MCP server with an allow list (fetcher). Both
    names resolve to the public host, so a refusal of other.test is the allow list's, not the name's."""
    folder = tmp_path_factory.mktemp("network")
    work = folder / "work"
    work.mkdir()
    fetch = McpServer(
        name="fetch", command=FETCH_SERVER, args=["--ignore-robots-txt"],
        sandbox=True, network=["allowed.test"], timeout_s=60,
    )  # fmt: skip
    profiles = {
        "public": Profile(run_command=RunCommand(cwd=work, network=True), approval_tools=[]),
        "listed": Profile(run_command=RunCommand(cwd=work, network=["allowed.test"]), approval_tools=[]),
        "fetcher": Profile(mcp_servers=[fetch], approval_tools=[]),
    }
    own = settings.model_copy(
        update={
            "profiles": {**settings.profiles, **profiles},
            "sandbox_resolve": {"allowed.test": public_host, "other.test": public_host},
        }
    )
    with dedicated_fleet(own, folder / "logs", 1, queue="subq-network") as (coord, _fleet):
        yield coord


@needs_root
def test_a_workers_commands_with_the_network_reach_what_the_profile_says(
    settings: Settings, networked: Coordinator, public_host: str, listener: tuple[int, list[object]]
) -> None:
    """The acceptance run: a real worker, commands that run without a decision, Redis with its password given."""
    coord, (port, accepted) = networked, listener
    parts = redis.connection.parse_url(settings.redis_url or "")
    redis_set = REDIS_SET.format(host="127.0.0.1", port=parts["port"], password=parts.get("password") or "")
    client = redis.Redis.from_url(settings.redis_url or "")
    client.delete("pwned")
    wide = [redis_set, CONNECT.format(host="127.0.0.1", port=port), CURL.format(flags="", target=public_host)]
    task = coord.create_task(
        agent(*[call("run_command", command=c) for c in wide], reply("tried")), profile="public", run=True
    )
    assert coord.wait(task.id, 120).status == TaskStatus.COMPLETED
    (to_redis, to_listener, to_public), _ = _returns_and_ui(coord, task.id)
    narrow = [CURL.format(flags="", target="allowed.test"), CURL.format(flags="", target="other.test"),
              CURL.format(flags="--noproxy '*'", target=public_host)]  # fmt: skip
    proxied = coord.create_task(
        agent(*[call("run_command", command=c) for c in narrow], reply("tried")), profile="listed", run=True
    )
    assert coord.wait(proxied.id, 120).status == TaskStatus.COMPLETED
    (allowed, other, direct), ui = _returns_and_ui(coord, proxied.id)
    assert not to_redis.startswith("exit 0") and client.get("pwned") is None, to_redis
    assert not to_listener.startswith("exit 0") and accepted == [], to_listener
    assert to_public == f"exit 0\n{MARKER}", to_public
    assert allowed == f"exit 0\n{MARKER}", allowed
    assert not other.startswith("exit 0") and not direct.startswith("exit 0")
    assert [text for kind, text in ui if kind == "network_refused"] == ["other.test:80"], ui
    client.close()


@needs_root
def test_a_sandboxed_mcp_server_with_an_allow_list(networked: Coordinator) -> None:
    """mcp-server-fetch (nobody's here) in the sandbox: it fetches from a listed host, and not from another."""
    coord = networked
    steps = [
        call("fetch", url="http://allowed.test/marker", raw=True),
        call("fetch", url="http://other.test/marker", raw=True),
    ]
    task = coord.create_task(agent(*steps, reply("fetched")), profile="fetcher", run=True)
    assert coord.wait(task.id, 120).status == TaskStatus.COMPLETED
    (allowed, other), ui = _returns_and_ui(coord, task.id)
    assert MARKER in str(allowed), allowed
    assert MARKER not in str(other), other
    assert [text for kind, text in ui if kind == "network_refused"] == ["other.test:80"], ui


def test_a_command_has_no_capability_even_when_the_worker_is_root(tmp_path: Path) -> None:
    """bwrap started by root keeps every capability for the command unless told not to: with them, a
    command could delete its namespace's routes or unmount what hides subq's files (--cap-drop ALL)."""
    tried = _run(
        "sh -c 'grep CapEff /proc/self/status; ip route del prohibit 10.0.0.0/8 && echo DELETED; "
        "umount /tmp && echo UNMOUNTED; exit 0'",
        tmp_path,
        network=True,
    )
    assert "CapEff:\t0000000000000000" in tried.output, tried.text()
    assert "DELETED" not in tried.output and "UNMOUNTED" not in tried.output, tried.text()


# A command run the way a worker not run as root runs it (the image's user): from a process of `nobody`.
AS_NOBODY = """
import asyncio, sys
from pathlib import Path
from coordinator import RunCommand
from workers.runtime import commands
config = RunCommand(cwd=Path(sys.argv[1]), network=True)
print(asyncio.run(commands.run(sys.argv[2], config)).text())
"""


@needs_root
def test_an_unprivileged_worker_gives_the_same_network(public_host: str) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="subq-nobody-"))  # in /tmp itself: pytest's folders are root's only
    workdir.chmod(0o777)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    root = Path(__file__).resolve().parent.parent

    def run(command: str) -> str:
        argv = [*nobody, sys.executable, "-c", AS_NOBODY, str(workdir), command]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        assert run(CURL.format(flags="", target=public_host)) == f"exit 0\n{MARKER}\n"
        refused = run(CONNECT.format(host=_own_address(), port=9))
        assert refused.startswith("exit 1") and "PermissionError" in refused, refused
        assert "DELETED" not in run("sh -c 'ip route del prohibit 10.0.0.0/8 && echo DELETED; exit 0'")
    finally:
        shutil.rmtree(workdir)


# A CONNECT head a command sends the proxy as it likes: a target that is no host name once forged refusal
# lines with a newline in it, and an IPv6 scope id (which Python 3.11's ipaddress takes) may hold one too.
FORGED_TARGETS = {
    "newlines": "evil.example\\nINJECTED:1\\nother:2",
    "scope id": "fe80::1%x\\nforged.example:443",
}


@pytest.mark.parametrize("target", FORGED_TARGETS.values(), ids=FORGED_TARGETS.keys())
def test_a_forged_target_is_a_400_and_no_refusal_line(tmp_path: Path, target: str) -> None:
    forge = (
        'python3 -c \'import os,socket; p=int(os.environ["HTTP_PROXY"].rsplit(":",1)[1]); '
        's=socket.create_connection(("127.0.0.1",p)); '
        f's.sendall(b"CONNECT {target} HTTP/1.1\\r\\n\\r\\n"); print(s.recv(200))\''
    )
    forged = _run(forge, tmp_path, network=["allowed.test"])
    assert "400 Bad Request" in forged.output and forged.refused == (), forged.text()


def test_a_command_that_loops_on_refused_hosts_writes_a_bounded_list(tmp_path: Path) -> None:
    """A command that loops on refused hosts writes at most egress.MAX_REFUSALS lines."""
    loop = (
        'python3 -c \'import os,socket; p=int(os.environ["HTTP_PROXY"].rsplit(":",1)[1])\n'
        "for n in range({n}):\n"
        ' s=socket.create_connection(("127.0.0.1",p)); s.sendall(b"CONNECT h%d.test:443 HTTP/1.1\\r\\n\\r\\n" % n); '
        "s.recv(200); s.close()'"
    )
    flood = _run(loop.format(n=egress.MAX_REFUSALS + 50), tmp_path, network=["allowed.test"], timeout_s=120)
    assert flood.exit_code == 0, flood.text()
    assert len(flood.refused) == egress.MAX_REFUSALS and flood.refused[0] == "h0.test:443"


# A worker stand-in: it starts a command with the network, says so, and waits to be killed.
DIES = """
import asyncio, sys
from pathlib import Path
from coordinator import RunCommand
from workers.runtime import commands
print("started", flush=True)
asyncio.run(commands.run(sys.argv[2], RunCommand(cwd=Path(sys.argv[1]), network=True, timeout_s=600)))
"""


# Alone (the suite's second pass, on a machine the first has left idle): it follows the worker's processes,
# and a full run that starts thousands of processes and threads on 2 cores once left it unsure (pid_max 32768).
@pytest.mark.alone
def test_a_worker_killed_with_sigkill_takes_its_sandboxed_command_along(tmp_path: Path) -> None:
    """egress.py, bwrap, pasta and the command all end with the worker, as bwrap alone did before it."""
    import psutil

    command = f"sleep 333.{uuid.uuid4().int % 100_000}"  # ours alone
    worker = subprocess.Popen(
        [sys.executable, "-c", DIES, str(tmp_path), command],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent, start_new_session=True,
    )  # fmt: skip
    assert worker.stdout is not None and worker.stdout.readline().strip() == "started"

    def alive(procs: list[psutil.Process]) -> list[str]:
        """The command lines of those still running: a Process object, not a pid, so a pid the busy
        machine gave another process since is not taken for ours (is_running checks its start time)."""
        lines = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    lines.append(" ".join(proc.cmdline()))
        return lines

    def started() -> list[psutil.Process] | None:
        """Every process, once the command itself runs (bwrap's own command line names it from the start)."""
        procs = psutil.Process(worker.pid).children(recursive=True)
        lines = alive(procs)
        return procs if command in lines and any("pasta" in line for line in lines) else None

    procs = eventually(started, "the command and pasta to run", timeout_s=60, every_s=0.05)
    worker.kill()  # SIGKILL to the worker alone, not its process group: as the kernel's OOM killer does
    worker.wait()
    deadline = time.monotonic() + 30
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(procs) == [], "every process the worker started ends with it"

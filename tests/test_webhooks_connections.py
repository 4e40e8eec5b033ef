"""The deliverer's keep-alive connections (coordinator/outbound.py `Connections`), against real sockets on
127.0.0.1: one connection serves attempt after attempt; one the receiver closed while idle is replaced
without failing the attempt, and is closed at the next look when it shows meanwhile; the socket goes to
the checked address whatever the URL's host; a refused connection reads as a ConnectError; many POSTs are
in flight at once on the one thread; an answer is read as HTTP says (h11: a body, `Connection: close`,
chunked, an interim 100), a silent receiver is a ReadTimeout and a stranger's answer a
RemoteProtocolError; over TLS the certificate is checked against the host's name.
No Redis: pure connection handling.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import trustme

from coordinator.outbound import Connections

ANSWER = b"HTTP/1.1 204 No Content\r\n\r\n"


class RawReceiver:
    """Answers each request 204 on a keep-alive connection; counts connections; `close_idle()` closes
    every connection it holds, as a server's keep-alive timeout does."""

    def __init__(self, answer: bytes = ANSWER, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> None:
        self.answer, self.tls = answer, tls
        self.release = threading.Event()  # a receiver made with `hold()` answers once it is set
        self.release.set()
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        self.requests: list[bytes] = []
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def hold(self) -> None:
        """Answer nothing until `release` is set (the requests are counted meanwhile)."""
        self.release.clear()

    def _serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):  # a client that refused our certificate
                conn.close()
                return
        buffer = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            buffer += data
            while b"\r\n\r\n" in buffer:
                head, _, rest = buffer.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                if len(rest) < length:
                    break
                with self.lock:
                    self.requests.append(head)
                buffer = rest[length:]
                self.release.wait()
                try:
                    conn.sendall(self.answer)
                except OSError:
                    return

    def close_idle(self) -> None:
        with self.lock:
            for conn in self.open:
                with contextlib.suppress(OSError):  # a TLS connection's raw socket is its wrapper's now
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self.open.clear()

    def stop(self) -> None:
        self.close_idle()
        self.sock.close()


@pytest.fixture
def receiver() -> Iterator[RawReceiver]:
    server = RawReceiver()
    yield server
    server.stop()


def _post(connections: Connections, url: str, address: str = "127.0.0.1", timeout_s: float = 5.0) -> tuple[int, str]:
    parts = urlsplit(url)
    headers = {"host": parts.netloc, "content-type": "application/json", "webhook-id": "evt_1"}
    return connections.post(parts, address, b'{"id":"evt_1"}', headers, timeout_s)


def test_one_connection_serves_attempt_after_attempt(receiver: RawReceiver) -> None:
    connections = Connections(most_idle=2)
    url = f"http://127.0.0.1:{receiver.port}/hook"
    assert [_post(connections, url) for _ in range(5)] == [(204, "")] * 5
    assert receiver.connections == 1 and len(receiver.requests) == 5


def test_a_connection_the_receiver_closed_while_idle_is_replaced(receiver: RawReceiver) -> None:
    connections = Connections(most_idle=2)
    url = f"http://127.0.0.1:{receiver.port}/hook"
    assert _post(connections, url) == (204, "")
    receiver.close_idle()
    assert _post(connections, url) == (204, "")  # not a failed attempt: made again on a new connection
    assert receiver.connections == 2 and len(receiver.requests) == 2


def test_an_idle_connection_the_receiver_closed_is_closed_at_the_next_look(receiver: RawReceiver) -> None:
    """An idle connection stays watched for reads (no system call to watch it again at its next POST): one
    the receiver closes shows at the next `collect` and is closed there, not tried by the next POST."""
    connections = Connections(most_idle=2)
    url = f"http://127.0.0.1:{receiver.port}/hook"
    assert _post(connections, url) == (204, "")
    assert sum(len(idle) for idle in connections._idle.values()) == 1
    receiver.close_idle()
    deadline = time.monotonic() + 60.0
    while any(connections._idle.values()) and time.monotonic() < deadline:
        assert connections.collect() == []
        time.sleep(0.01)
    assert not any(connections._idle.values())
    assert _post(connections, url) == (204, "")
    assert receiver.connections == 2 and len(receiver.requests) == 2


def test_the_socket_goes_to_the_checked_address_and_the_host_header_names_the_host(receiver: RawReceiver) -> None:
    connections = Connections(most_idle=2)
    # A name that resolves nowhere: only the checked address is connected to, never a fresh resolution.
    assert _post(connections, f"http://hooks.example.invalid:{receiver.port}/in?x=1") == (204, "")
    head = receiver.requests[0].decode()
    assert head.startswith("POST /in?x=1 HTTP/1.1") and f"host: hooks.example.invalid:{receiver.port}" in head


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    status, line = _post(Connections(most_idle=2), f"http://127.0.0.1:{port}/hook")
    assert status == 0 and line.startswith("ConnectError:"), line


def test_many_posts_are_in_flight_at_once_on_the_one_thread(receiver: RawReceiver) -> None:
    connections = Connections(most_idle=10)
    parts = urlsplit(f"http://127.0.0.1:{receiver.port}/hook")
    receiver.hold()
    ended: list[tuple[object, int, str]] = []
    for n in range(10):
        headers = {"host": parts.netloc, "webhook-id": f"evt_{n}"}
        ended += connections.start(n, parts, "127.0.0.1", b"{}", headers, 60.0)
    # Every request reaches the receiver while none is answered: ten POSTs in flight, no thread each.
    deadline = time.monotonic() + 60.0
    while len(receiver.requests) < 10 and time.monotonic() < deadline:
        ended += connections.drive(0.05) + connections.collect()
    assert len(receiver.requests) == 10 and not ended and connections.in_flight == 10
    receiver.release.set()
    while len(ended) < 10 and time.monotonic() < deadline:
        ended += connections.drive(0.05) + connections.collect()
    assert sorted(ended, key=lambda e: int(str(e[0]))) == [(n, 204, "") for n in range(10)]
    assert receiver.connections == 10 and connections.in_flight == 0


@pytest.mark.parametrize(
    ("answer", "status", "connections"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, 1),  # read whole: the connection serves on
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n", 202, 1),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 200, 3),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", 200, 1),  # read whole too
        (b"HTTP/1.1 200 OK\r\n\r\nok", 200, 3),  # no length: the body ends with the connection
        (b"HTTP/1.0 503 Busy\r\nContent-Length: 0\r\n\r\n", 503, 3),
    ],
)
def test_an_answer_is_read_as_http_says(answer: bytes, status: int, connections: int) -> None:
    receiver = RawReceiver(answer)
    try:
        pool = Connections(most_idle=2)
        url = f"http://127.0.0.1:{receiver.port}/hook"
        assert [_post(pool, url) for _ in range(3)] == [(status, "")] * 3
        assert receiver.connections == connections
    finally:
        receiver.stop()


def test_a_silent_receiver_is_a_read_timeout_and_a_strangers_answer_a_protocol_error() -> None:
    silent = RawReceiver()
    silent.hold()
    stranger = RawReceiver(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    try:
        status, line = _post(Connections(most_idle=2), f"http://127.0.0.1:{silent.port}/hook", timeout_s=0.5)
        assert status == 0 and line.startswith("ReadTimeout:"), line
        status, line = _post(Connections(most_idle=2), f"http://127.0.0.1:{stranger.port}/hook")
        assert status == 0 and line.startswith("RemoteProtocolError: not an HTTP answer"), line
    finally:
        silent.release.set()
        silent.stop()
        stranger.stop()


@pytest.mark.parametrize("ends", ["trickles past the timeout", "closes mid-body"])
def test_an_answer_whose_head_came_is_that_answer_though_its_body_never_ends(ends: str) -> None:
    """A receiver that answers 200 at once and then trickles its body (or drops the connection within it): the
    attempt was a ReadTimeout (or a protocol error), the event sent again until given up though the receiver had
    taken it, and its host's other deliveries held back as a silent host's."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n")
            while ends == "trickles past the timeout" and not done.wait(0.2):
                with contextlib.suppress(OSError):
                    conn.sendall(b"1\r\nx\r\n")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert _post(Connections(most_idle=2), f"http://127.0.0.1:{listener.getsockname()[1]}/hook", timeout_s=1.0) == (
            200,
            "",
        )
    finally:
        done.set()
        server.join(5)
        listener.close()


def test_a_receiver_that_streams_interim_answers_without_end_fails_its_attempt_alone(receiver: RawReceiver) -> None:
    """A receiver answering with `100 Continue` after `100 Continue`, as fast as it can: each read had data, so the
    attempt's timeout was never looked at and the deliverer's one thread read it for good, every other attempt of
    the process (every tenant's) waiting behind it. Now the attempt fails, and an attempt beside it is answered."""
    flood = RawReceiver(b"HTTP/1.1 100 Continue\r\n\r\n" * 200_000)
    pool = Connections(most_idle=2)
    ended: dict[object, tuple[int, str]] = {}

    def deliver() -> None:
        for token, port in (("flood", flood.port), ("healthy", receiver.port)):
            parts = urlsplit(f"http://127.0.0.1:{port}/hook")
            headers = {"host": parts.netloc, "content-type": "application/json", "webhook-id": "evt_1"}
            pool.start(token, parts, "127.0.0.1", b"{}", headers, 30.0)
        while len(ended) < 2:
            ended.update((token, (status, line)) for token, status, line in pool.drive(0.1) + pool.collect())

    try:
        loop = threading.Thread(target=deliver, daemon=True)  # (held for good before: the test waits outside it)
        loop.start()
        loop.join(60)
        assert not loop.is_alive(), f"the deliverer's loop is still held after 60 s: {ended}"
        assert ended["healthy"] == (204, ""), "the attempt beside it is answered"
        assert ended["flood"] == (0, "RemoteProtocolError: not an HTTP answer: more than 16 interim (1xx) answers")
    finally:
        flood.stop()


def test_over_tls_the_certificate_is_checked_against_the_hosts_name() -> None:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hooks.example.test").configure_cert(server)
    receiver = RawReceiver(tls=server)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    try:
        url = f"https://hooks.example.test:{receiver.port}/hook"
        assert [_post(Connections(most_idle=2, tls=trusting), url) for _ in range(2)] == [(204, "")] * 2
        assert len(receiver.requests) == 2
        # Another name at the same address: the certificate does not name it.
        status, line = _post(Connections(most_idle=2, tls=trusting), f"https://other.example.test:{receiver.port}/")
        assert status == 0 and line.startswith("ConnectError:") and "certificate" in line, line
        # The system's trust does not know the test's CA.
        status, line = _post(Connections(most_idle=2), url)
        assert status == 0 and line.startswith("ConnectError:") and "certificate" in line, line
    finally:
        receiver.stop()

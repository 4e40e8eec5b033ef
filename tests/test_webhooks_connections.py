"""The deliverer's keep-alive connections (coordinator/outbound.py `Connections`), against real sockets on
127.0.0.1: one connection serves attempt after attempt; one the receiver closed while idle is replaced
without failing the attempt; the socket goes to the checked address whatever the URL's host; a refused
connection reads as a ConnectError. No Redis: pure connection handling.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from coordinator.outbound import Connections

ANSWER = b"HTTP/1.1 204 No Content\r\n\r\n"


class RawReceiver:
    """Answers each request 204 on a keep-alive connection; counts connections; `close_idle()` closes
    every connection it holds, as a server's keep-alive timeout does."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
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

    def _serve(self, conn: socket.socket) -> None:
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
                conn.sendall(ANSWER)

    def close_idle(self) -> None:
        with self.lock:
            for conn in self.open:
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


def _post(connections: Connections, url: str, address: str = "127.0.0.1") -> tuple[int, str]:
    parts = urlsplit(url)
    headers = {"host": parts.netloc, "content-type": "application/json", "webhook-id": "evt_1"}
    return connections.post(parts, address, b'{"id":"evt_1"}', headers, 5.0)


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

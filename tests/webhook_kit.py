"""A real HTTP receiver on 127.0.0.1 for the webhook tests: it records every request it gets.

`Receiver()` binds a free port and serves at once; `Receiver(port, start=False)` holds a port nobody
listens on (connections are refused) until `start()`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from coordinator.local.ports import free_port

__all__ = ["Got", "Receiver", "free_port"]


class Got:
    """One request as it arrived: its path, headers (lower-case names), body and time."""

    def __init__(self, path: str, headers: dict[str, str], body: bytes) -> None:
        self.path, self.headers, self.body = path, headers, body
        self.at = time.time()

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    def __init__(self, port: int | None = None, *, start: bool = True, status: int = 204) -> None:
        self.port = port or free_port()
        self.status = status
        self.got: list[Got] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.got.append(Got(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def of_type(self, event_type: str) -> list[Got]:
        with self._lock:
            return [got for got in self.got if got.json.get("type") == event_type]

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

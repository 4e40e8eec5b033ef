"""Refuse request bodies over `SUBQ_API_MAX_BODY_BYTES` with 413, before anything parses them.

A pure ASGI middleware: a declared `Content-Length` over the limit is refused
without reading a byte; otherwise the body is read up to the limit (a chunked
body declares no length) and replayed to the application, so neither JSON
decoding nor validation ever sees an oversize body.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.errors import BODY_TOO_LARGE, error_response

__all__ = ["BodyLimit"]


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            # The body once, then the real channel: a streaming response still hears the disconnect.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            BODY_TOO_LARGE,
            f"The request body is over {self.max_body_bytes} bytes (SUBQ_API_MAX_BODY_BYTES)",
        )
        await response(scope, receive, send)

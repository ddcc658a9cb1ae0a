"""A request body over the limit answers 413 before the app reads it (``RECLOOP_SERVE_MAX_BODY_BYTES``).

Without it, a 50 MB ``/rank`` body was parsed, scored and stored verbatim in the journal.

Example::

    app.add_middleware(BodyLimit, max_bytes=settings.serve_max_body_bytes)
"""

from __future__ import annotations

import json


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` answers 413 before the app sees it.

    A declared ``Content-Length`` over the limit is refused without reading; otherwise the body is
    read up to the limit (chunked bodies included) and handed on. Without it, a 50 MB ``/rank`` body
    was parsed, scored and stored verbatim in the journal.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and not declared.isdigit():  # (uvicorn's h11 refuses it first; another server may not)
            await self._refuse(send, 400, "the Content-Length header is not a number")
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(send)
                return
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, status: int = 413, why: str | None = None) -> None:
        detail = json.dumps({"detail": why or f"request body over the limit of {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(detail)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": detail})

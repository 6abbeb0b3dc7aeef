"""Errors in the Open Inference Protocol's form: ``{"error": "<message>"}``.

The KServe routes raise the service's own errors (`service.errors`, the pool's errors),
which the app renders as RFC 9457 problem details with their usual status. `ProtocolErrors`
rewrites every such problem under ``/v2`` into the protocol's error object, keeping the
status and headers (Retry-After on 503, ...). So ``/v2`` refuses exactly what ``/prefill``
refuses, with the same 4xx status, and the errors raised by middleware (401 without the
API key, 413 for a body over the limit) and by routing (404, 405) take the same form.
"""
from __future__ import annotations

import json
from typing import Optional

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ServiceError
from ..wire.media import JSON, PROBLEM, media_type

PREFIX = "/v2"


class UnknownModel(ServiceError):
    status = 404
    slug = "unknown-model"
    title = "Unknown model"


def error_body(problem: bytes) -> bytes:
    """``{"error": detail}`` from a problem+json body (its title, or the raw text, failing that)."""
    try:
        doc = json.loads(problem)
        message = doc.get("detail") or doc.get("title") or problem.decode("utf-8", "replace")
    except (ValueError, AttributeError):
        message = problem.decode("utf-8", "replace")
    return json.dumps({"error": str(message)}).encode()


class ProtocolErrors:
    """ASGI middleware: problem+json responses to requests under ``/v2`` become
    ``{"error": ...}`` application/json with the same status and other headers. Add it
    outermost so it also sees the responses of the other middleware."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            return await self.app(scope, receive, send)
        held: Optional[Message] = None
        chunks: list[bytes] = []

        async def translate(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=list(message["headers"]))
                if message["status"] >= 400 and media_type(headers.get("content-type")) == PROBLEM:
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = error_body(b"".join(chunks))
                headers = MutableHeaders(raw=list(held["headers"]))
                headers["content-type"] = JSON
                headers["content-length"] = str(len(body))
                await send({**held, "headers": headers.raw})
                message = {"type": "http.response.body", "body": body}
            await send(message)

        await self.app(scope, receive, translate)

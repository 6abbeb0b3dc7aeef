"""Response bodies of the REST routes: sent in pieces without joining them, handed over
in bounded pieces that stop (and free what the request made) when the client has left,
and the ``Server-Timing`` header of a prefill."""
from __future__ import annotations

from typing import Awaitable, Callable, Sequence

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .tracing import Phase, record_phases


def server_timing(phases: Sequence[Phase]) -> dict[str, str]:
    """A ``Server-Timing`` header (W3C) of the phases, in milliseconds; each phase is also
    recorded as a span of the request when tracing is on (`service.http.tracing`)."""
    record_phases(phases)
    return {"server-timing": ", ".join(f"{p.name};dur={p.seconds * 1000:.3f}" for p in phases)}


async def _client_gone(receive: Receive) -> bool:
    """Whether the client has disconnected (after its body was read), without waiting."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return (await receive())["type"] == "http.disconnect"
    return False


class PiecesResponse(Response):
    """A response whose body is ``pieces`` sent one after another, never joined (a
    safetensors reply: its header, then views of the result tensors' own bytes)."""

    def __init__(self, pieces: Sequence[memoryview], media_type: str, headers: dict[str, str]) -> None:
        self.pieces = [piece.cast("B") for piece in pieces]
        length = sum(piece.nbytes for piece in self.pieces)
        super().__init__(b"", media_type=media_type, headers={**headers, "content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(self.pieces) - 1})
        if not self.pieces:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class DeliveryGuard(PiecesResponse):
    """A response that hands its body to the server in pieces of at most ``PIECE`` bytes
    and, when the client is gone before the last piece is handed over, awaits
    ``on_abandoned`` (which frees the slots whose ids only this body carries) and stops.
    Once the last piece is handed over the server cannot tell delivery from loss; idle
    expiry (--slot-ttl-s) reclaims a slot whose id never arrived."""

    PIECE = 1 << 20

    def __init__(self, pieces: Sequence[memoryview], media_type: str,
                 on_abandoned: Callable[[], Awaitable[None]], headers: dict[str, str]) -> None:
        super().__init__(pieces, media_type, headers)
        self._on_abandoned = on_abandoned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        slices = [piece[start:start + self.PIECE] for piece in self.pieces
                  for start in range(0, len(piece), self.PIECE)] or [memoryview(b"")]
        for i, body in enumerate(slices):
            if await _client_gone(receive):
                await self._on_abandoned()
                return
            await send({"type": "http.response.body", "body": body, "more_body": i < len(slices) - 1})

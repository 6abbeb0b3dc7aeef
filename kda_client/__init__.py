"""Python clients for kda-serve: `KDAClient` (sync) and `AsyncKDAClient` (asyncio), on httpx.

A package of its own: importing it loads httpx, torch and the wire formats
(`service.wire`), never the server (no fastapi, starlette, uvicorn or triton).
"""
from .client import AsyncKDAClient, KDAClient, PrefillOutput, PrefixAlloc, SequenceInput
from .errors import (
    BadRequest, ClientClosed, KDAError, MalformedResponse, PoolFullError, ServerError, ServiceUnavailable, SlotGone,
    SlotNotFound, StateLost, Unauthorized,
)

__all__ = [
    "KDAClient", "AsyncKDAClient", "PrefillOutput", "PrefixAlloc", "SequenceInput", "KDAError", "BadRequest",
    "Unauthorized", "StateLost",
    "SlotNotFound", "SlotGone", "ServiceUnavailable", "PoolFullError", "ServerError", "MalformedResponse",
    "ClientClosed",
]

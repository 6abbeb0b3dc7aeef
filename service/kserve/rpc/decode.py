"""Requests whose bytes are not a message of their type (cut short, a wrong wire type, a
string field that is not UTF-8): bad input like any other, so the protocol's error, not
grpcio's.

grpcio decodes a request before the method runs; a message that does not parse would end
the call UNKNOWN (a stream with it, dropping the responses of the requests it carried
before) with a traceback in the log. `TolerantDecoding` (a server interceptor) makes every
method's decoder return a `Malformed` instead, which the method refuses as it refuses any
bad request: a unary call ends INVALID_ARGUMENT (after the API key check), a stream
answers it with an error message and reads on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from ...errors import InvalidRequest

Decoder = Callable[[bytes], Any]


@dataclass(frozen=True)
class Malformed:
    """What a method receives for a request that did not parse: ``reason``, protobuf's."""

    reason: str

    def error(self) -> InvalidRequest:
        """The refusal of this request (400: INVALID_ARGUMENT)."""
        return InvalidRequest(f"the request is not a valid protobuf message: {self.reason}", field="request")


def tolerant(decode: Decoder) -> Decoder:
    """``decode``, returning `Malformed` where it raises DecodeError."""
    def parse(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError as e:
            return Malformed(str(e))
    return parse


def _tolerant_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with its request decoder made `tolerant`. The service's methods are
    unary (all but one) or bidirectional (ModelStreamInfer)."""
    decode, encode = tolerant(handler.request_deserializer), handler.response_serializer
    if handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, decode, encode)
    return grpc.unary_unary_rpc_method_handler(handler.unary_unary, decode, encode)


class TolerantDecoding(grpc.aio.ServerInterceptor):
    """Every method's handler with a `tolerant` request decoder (made once per method)."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Optional[grpc.RpcMethodHandler]]],
            details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        method = details.method
        if method not in self._handlers:
            handler = await continuation(details)
            if handler is None:  # an unknown method: grpcio's UNIMPLEMENTED
                return None
            self._handlers[method] = _tolerant_handler(handler)
        return self._handlers[method]

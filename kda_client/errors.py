"""The client's errors: `KDAError` and its subclasses for the server's error responses
(`kda_client.client` maps each status to one), `MalformedResponse` for a reply the client
cannot decode, and `ClientClosed` for a call on a closed client, which no server answered.
Network failures raise httpx's exceptions, bad inputs ValueError."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Union

from service.errors import ServiceError


class KDAError(Exception):
    """An error response. ``status``: the HTTP status; ``problem``: the RFC 9457 document
    (type, title, status, detail and members such as ``field``)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        super().__init__(f"{status} {problem.get('title', '')}: {problem.get('detail', '')}".strip())


class BadRequest(KDAError):
    """The request was refused as it stands (400, 406, 408, 409, 413, 415, 422 and any
    other 4xx without a class of its own); nothing changed."""


class StateLost(BadRequest):
    """409 ``state-lost``: the request names a slot whose state cannot be trusted (an update
    on it failed midway, or it advanced after the snapshot the server restarted from).
    Nothing changed; put a state into the slot (`put_state`) or free it and prefill anew.
    ``slot``: the slot named."""

    @property
    def slot(self) -> Optional[str]:
        value = self.problem.get("slot")
        return value if isinstance(value, str) else None


class Unauthorized(KDAError):
    """401: missing or wrong API key."""


class SlotNotFound(KDAError):
    """404: the slot id was never issued, was freed, or expired (or, for the prefix
    routes, the prefix cache holds no entry of that key)."""


class SlotGone(SlotNotFound):
    """410 (a sharded deployment): the slot's state is lost for good (its shard died, or
    stopped without a snapshot to come back from); its id will never work again."""


class ServiceUnavailable(KDAError):
    """503: try again after ``retry_after`` seconds (None when the server gave none)."""

    def __init__(self, status: int, problem: dict[str, Any], retry_after: Optional[float]) -> None:
        super().__init__(status, problem)
        self.retry_after = retry_after


class PoolFullError(ServiceUnavailable):
    """503: no free slot for the allocation (nothing was allocated)."""


class ServerError(KDAError):
    """500 and other server-side failures."""


class MalformedResponse(KDAError):
    """A reply the client cannot decode (a 200 whose body is bad JSON, a safetensors
    container whose header lies or that was cut short, a document missing a member, a
    body of the wrong Content-Type: a proxy that mangled it, a server cut off), as httpx's
    ``DecodingError`` for its own. ``status``: the reply's status (that of a success,
    mostly: its body is what failed); ``what``: what could not be decoded ("the POST
    /prefill response"); ``problem``: a document the client wrote (type
    ``urn:kda-client:malformed-response``), its ``detail`` the decoder's reason, shortened,
    never the body. The decoder's own error is the ``__cause__``. Whatever the call changed
    on the server, it did: a prefill's slots advanced, say."""

    def __init__(self, status: int, what: str, reason: str) -> None:
        self.what = what
        if len(reason) > _REASON_CHARS:
            reason = reason[:_REASON_CHARS - 3] + "..."
        super().__init__(status, {"type": "urn:kda-client:malformed-response", "title": "Malformed response",
                                  "status": status, "detail": f"could not decode {what}: {reason}"})


_REASON_CHARS = 240
"""The most of a decoder's message a `MalformedResponse` keeps."""
_DECODING_ERRORS = (ServiceError, ValueError, LookupError, TypeError, AttributeError)
"""What the wire decoders raise for a body they cannot read: the server's own errors
(`service.errors.MalformedBody`, `SchemaError`), json's and base64's (ValueError), a
missing member (KeyError, IndexError), a member of the wrong type (TypeError,
AttributeError). Not RuntimeError (torch's out-of-memory errors are ones), MemoryError,
OSError or anything else."""


@contextmanager
def decoding(status: int, what: Union[str, Callable[[], str]]) -> Iterator[None]:
    """Decode a reply of ``status`` inside the block: a decoding error raised in it
    (`_DECODING_ERRORS`) comes out as `MalformedResponse` naming ``what`` (or what it
    returns: worked out only on a failure), the error its ``__cause__``; every other
    exception passes unchanged."""
    try:
        yield
    except _DECODING_ERRORS as e:
        reason = e.detail if isinstance(e, ServiceError) else str(e) or type(e).__name__
        named = what if isinstance(what, str) else what()
        raise MalformedResponse(status, named, f"{type(e).__name__}: {reason}") from e


class ClientClosed(ValueError):
    """A call on a closed client (after `KDAClient.close`, `AsyncKDAClient.aclose` or the end
    of its ``with`` block), or a run of one of its prepared prefills: refused before anything
    is sent, created or registered. Not a `KDAError`, which is a server's answer: a misuse,
    hence a ValueError, as a run of a released prepared prefill and ``io``'s operations on a
    closed file are. ``detail``: what else the caller should know, after the message."""

    def __init__(self, detail: Optional[str] = None) -> None:
        super().__init__("the client is closed" if detail is None else f"the client is closed: {detail}")

"""Python clients for kda-serve: `KDAClient` (sync) and `AsyncKDAClient` (asyncio), on httpx.

Binary transport (safetensors) by default, JSON with ``encoding="json"``. Tensors may be
on any device and in float32, bfloat16 or float16; results come back as CPU tensors
viewing the response buffer (no copy). Errors raise `KDAError` subclasses carrying the
server's problem details (`kda_client.errors`), and a reply that cannot be decoded (a
malformed or truncated body, a wrong Content-Type) `MalformedResponse`, its decoder's
error as the cause; network failures raise httpx's exceptions.
A closed client (`close`, `aclose`, the end of its ``with`` block) refuses every call, and
its prepared prefills every run, with `ClientClosed` before sending or registering anything.

`KDAClient` sends small ``http://`` requests (bodies up to 64 KiB: one-token to
few-hundred-token prefills, slot calls) through `kda_client.small.SmallExchange`, one
``send()`` and a hand-parsed response on a kept-alive socket, without httpx's request
and response machinery; larger ones through `kda_client.transport.StdlibTransport`:
the body goes to the socket as views of the tensors' own bytes and the response is read
into one buffer of its Content-Length (httpx's default transport copies each byte about
three times more). `AsyncKDAClient` keeps httpx's default asyncio transport: an asyncio
fast path would need its own HTTP/1.1 client, and the sync client is what moves large
bodies (one prefill at a time per connection either way).

``transport="shm"`` (a client on the server's host) passes prefill tensors through a
POSIX shared memory region instead of the HTTP body (`kda_client.shm`): the client
creates and registers it on first use, grows it as needed and unregisters it on close.
Its results are copies unless ``shm_views=True`` (views of the region, valid until the
next prefill on this client). One region per client: its shared memory prefills run one
at a time (use one client per concurrent stream). ``transport="cuda"`` does the same with
a region of this process's GPU memory shared by CUDA IPC (`kda_client.shm.CudaArena`):
for a client whose tensors are already on the server's GPU; the server copies them device
to device and its results arrive as tensors on that GPU. With ``framed_socket`` (the
server's ``--framed-socket`` path) `KDAClient` sends those shared memory prefills over that
Unix socket in length-prefixed frames instead of HTTP (`kda_client.framed`); every other
call stays on HTTP::

    with KDAClient("http://127.0.0.1:8000") as kda:
        out = kda.prefill(0, [(None, q, k, v, g, beta)])      # None: allocate a slot
        slot = out.slots[0]
        out = kda.prefill(0, [(slot, q2, k2, v2, g2, beta2)])  # continue the sequence
        out.o[0]            # [T2, HV, V]
        out.final_state[0]  # [HV, V, K]
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import urllib.parse
import weakref
from collections import deque
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from functools import partial
from typing import (
    Any, AsyncIterator, Callable, Generic, Iterator, Literal, Mapping, Optional, Sequence, TypeVar, Union,
)

import httpx
import torch

from .errors import (
    BadRequest, ClientClosed, KDAError, MalformedResponse, PoolFullError, ServerError, ServiceUnavailable, SlotGone,
    SlotNotFound, StateLost, Unauthorized, decoding,
)
from .framed import AsyncFramedExchange, FramedExchange
from .outputs import PrefillOutput
from .prepared import AsyncPreparedPrefill, PreparedPrefill
from .small import MAX_BODY, Response, SmallExchange
from .transport import StdlibTransport
from .shm import (
    SHM_JSON, Arena, CudaArena, Geometry, Placed, Registration, ShmArena, is_unknown_region, split_sequences,
)
from service.wire.buffers import BodyBuffer
from service.wire.frames import PREPARED_ID, Op
from service.wire.media import JSON, PROBLEM, SAFETENSORS, media_type
from service.core.inputs import REQUIRED_TENSORS
from service.wire.prefill import decode_prefill_response
from service.wire.schema import PREFIX_DROPPED_HEADER
from service.wire.safetensors_codec import safetensors_pieces
from service.wire.state import decode_state_json, decode_state_safetensors, encode_state_json, encode_state_safetensors
from service.wire.tensors import JSON_NAMES, tensor_to_json

__all__ = [
    "KDAClient", "AsyncKDAClient", "PrefillOutput", "PrefixAlloc", "SequenceInput",
    "KDAError", "BadRequest", "Unauthorized", "SlotNotFound", "ServiceUnavailable", "PoolFullError", "ServerError",
    "MalformedResponse", "ClientClosed",
]

Encoding = Literal["safetensors", "json"]
Transport = Literal["http", "shm", "cuda"]
SequenceInput = tuple[Optional[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""One sequence of a prefill: (slot id or None, q [T,H,K], k [T,H,K], v [T,HV,V], g [T,HV,K], beta [T,HV])."""
_T = TypeVar("_T")
Body = Union[bytes, bytearray, list[memoryview]]
"""A request body: one buffer, or pieces sent back to back without joining them."""
Headers = Mapping[str, str]
"""A response's headers, looked up by lower-case name: httpx's, or `SmallExchange`'s."""


def _body_size(body: Body) -> int:
    return sum(piece.nbytes for piece in body) if isinstance(body, list) else len(body)


def _problem(status: int, headers: Headers, body: bytearray) -> dict[str, Any]:
    """An error response's problem document: its RFC 9457 body, an Open Inference Protocol
    error (``{"error": message}``, the ``/v2`` routes') as one with that ``detail``, else
    the body's text as ``detail``."""
    try:
        doc = json.loads(body) if media_type(headers.get("content-type")) in (PROBLEM, JSON) else None
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "detail" not in doc and isinstance(doc.get("error"), str):
        return {"status": status, "detail": doc["error"]}
    if isinstance(doc, dict):
        return doc
    return {"status": status, "detail": bytes(body[:2000]).decode("utf-8", "replace")}


def _retry_member(problem: dict[str, Any]) -> Optional[float]:
    """The problem's ``retry_after`` seconds (the framed socket's replies have no headers),
    or None."""
    value = problem.get("retry_after")
    if type(value) not in (int, float) or not value >= 0:
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        return None
    return seconds if math.isfinite(seconds) else None


def _raise_for(status: int, headers: Headers, body: bytearray) -> None:
    if status < 400:
        return
    problem = _problem(status, headers, body)
    if status == 503:
        retry = headers.get("retry-after")
        retry_after = (float(retry) if retry and retry.isascii() and retry.replace(".", "", 1).isdigit()
                       else _retry_member(problem))
        cls = PoolFullError if str(problem.get("type", "")).endswith(":pool-full") else ServiceUnavailable
        raise cls(status, problem, retry_after)
    if status == 409 and str(problem.get("type", "")).endswith(":state-lost"):
        raise StateLost(status, problem)
    cls = {401: Unauthorized, 404: SlotNotFound, 410: SlotGone}.get(status, BadRequest if status < 500 else ServerError)
    raise cls(status, problem)


# -- results ---------------------------------------------------------------------------

@dataclass
class PrefixAlloc:
    """What `alloc` with a prefix gives: the new ``slots`` and the entry they start from:
    ``matched`` (1-based position among the keys sent, 0 for none), its ``key`` (None) and
    its ``tokens`` per layer (0)."""

    slots: list[str]
    matched: int
    key: Optional[str]
    tokens: int


# -- calls: what to send and how to read the answer, shared by both clients --------------

@dataclass
class _Call(Generic[_T]):
    method: str
    path: str
    parse: Callable[[Headers, bytearray], _T]
    body: Optional[Body] = None
    content_type: Optional[str] = None
    accept: Optional[str] = None

    def headers(self) -> dict[str, str]:
        h = {}
        if self.body is not None:
            h["content-type"] = self.content_type or JSON
            h["content-length"] = str(_body_size(self.body))
        if self.accept:
            h["accept"] = self.accept
        return h

    def what(self, headers: Headers) -> str:
        """The answer with ``headers``, as a `MalformedResponse` names it."""
        media = media_type(headers.get("content-type"))
        return f"the {self.method} {self.path} response" + (f" ({media:.60})" if media else "")

    def decoding(self, status: int, headers: Headers) -> AbstractContextManager[None]:
        """`decoding` of the answer of ``status`` with ``headers`` (named only on a failure)."""
        return decoding(status, partial(self.what, headers))

    def read(self, status: int, headers: Headers, body: bytearray) -> _T:
        """The answer of ``status``, parsed: the error of an error status raised, and
        MalformedResponse for a body ``parse`` cannot decode."""
        _raise_for(status, headers, body)
        with self.decoding(status, headers):
            return self.parse(headers, body)


def _body_buffer(headers: Headers) -> BodyBuffer:
    """A buffer for a body of the answer's Content-Length (ValueError for one that is no number)."""
    length = headers.get("content-length")
    return BodyBuffer(int(length) if length is not None else None)


def _q(slot: str) -> str:
    """A slot id as one URL path segment."""
    return urllib.parse.quote(slot, safe="")


def _json(_: Headers, body: bytearray) -> Any:
    return json.loads(body)


def _nothing(_: Headers, __: bytearray) -> None:
    return None


def _dropped(headers: Headers, _: bytearray) -> Optional[bool]:
    """Whether a prefix delete removed an entry (None: a server that does not say)."""
    said = headers.get(PREFIX_DROPPED_HEADER.lower())
    return None if said is None else said == "true"


def _media(encoding: Encoding) -> str:
    if encoding not in ("safetensors", "json"):
        raise ValueError(f"encoding must be 'safetensors' or 'json', got {encoding!r}")
    return SAFETENSORS if encoding == "safetensors" else JSON


_NO_FRAMED_SOCKET = ("prepare needs the server's framed socket: a client made with transport='shm' or 'cuda' "
                     "and framed_socket=PATH")


def _slots_of(sequences: Sequence[SequenceInput]) -> list[str]:
    """The slot of each sequence of a prepared prefill (ValueError for one without)."""
    if any(seq[0] is None for seq in sequences):
        raise ValueError("a prepared prefill runs on existing slots: allocate them first")
    return [str(seq[0]) for seq in sequences]


def _prepared_layout(base: Arena, layer: int, sequences: Sequence[SequenceInput], **options: Any
                     ) -> tuple[Arena, "_ShmPrefill", list[str]]:
    """A new arena like ``base`` (its geometry known) for a prepared prefill, the
    prefill's layout in it (``options``: `_shm_prefill`'s, checkpoints excepted) and its
    slots (`_slots_of`)."""
    slots = _slots_of(sequences)
    arena = type(base)(base.ttl_s, base.views)
    arena.geometry = base.geometry
    return arena, _shm_prefill(arena, layer, sequences, **options), slots


def _finished(answer: Response) -> dict[str, float]:
    """The phases of a framed answer (its error raised, as `KDAClient` raises them)."""
    _raise_for(answer.status, answer.headers, answer.body)
    return _server_timing(answer.headers)


def _prepared_number(answer: Response) -> int:
    """The id a framed PREPARE answer gives (its error raised, as `KDAClient` raises them;
    MalformedResponse for a body without one)."""
    _raise_for(answer.status, answer.headers, answer.body)
    with decoding(answer.status, "the framed socket's PREPARE reply"):
        number = json.loads(answer.body)["prepared"]
        if type(number) is not int or not 0 <= number < 1 << 32:
            raise ValueError(f"'prepared' must be an id of 32 bits, got {number!r:.40}")
    return number


def _server_timing(headers: Headers) -> dict[str, float]:
    """``Server-Timing: kernel;dur=1.5, encode;dur=0.2`` -> {"kernel": 1.5, "encode": 0.2}."""
    phases = {}
    for metric in headers.get("server-timing", "").split(","):
        name, *params = metric.split(";")
        if not (name := name.strip()):
            continue
        for param in params:
            key, _, value = param.strip().partition("=")
            if key == "dur":
                try:
                    phases[name] = float(value)
                except ValueError:  # not a number: left out
                    pass
    return phases


def _read_state(headers: Headers, body: bytearray) -> torch.Tensor:
    if media_type(headers.get("content-type")) == JSON:
        return decode_state_json(body)
    return decode_state_safetensors(body)  # an export: its geometry metadata is not needed here


def _check_tensor(name: str, t: Any) -> None:
    """ValueError unless ``t`` is a tensor the wire carries (integer ones the server refuses
    itself, with its problem document)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in JSON_NAMES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype} (no wire form)")


def _check_inputs(parts: Mapping[str, Sequence[Any]], **extra: Any) -> None:
    """Every encoding and transport refuses the same inputs before anything is made or sent:
    tensors of a wire dtype, and the sequences' parts of one name packable along tokens (a
    token dimension, one dtype and trailing shape). The rest the server checks."""
    for name, ts in parts.items():
        for t in ts:
            _check_tensor(name, t)
            if t.dim() == 0:
                raise ValueError(f"{name} must have a token dimension to be packed along tokens, got a 0-d tensor")
        first = ts[0]
        for t in ts[1:]:
            if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
                raise ValueError(f"{name}: parts must share dtype and trailing shape to be packed along tokens, got "
                                 f"{first.dtype}{list(first.shape)} and {t.dtype}{list(t.shape)}")
    for name, t in extra.items():
        if t is not None:
            _check_tensor(name, t)


def _prefill_options(
    layer: int, sequences: Sequence[SequenceInput], *, lower_bound: Optional[float], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, allow_neg_eigval: bool, scale: Optional[float], return_final_state: bool,
    checkpoints: Optional[Sequence[Sequence[tuple[int, str]]]] = None,
) -> tuple[list[Optional[str]], dict[str, list[torch.Tensor]], list[int], dict[str, Any]]:
    """(slots, each tensor's per-sequence parts, lengths, the request options) of a prefill."""
    if not sequences:
        raise ValueError("prefill needs at least one sequence")
    slots, parts = split_sequences(sequences, REQUIRED_TENSORS)
    _check_inputs(parts)
    lengths = [int(q.shape[0]) for q in parts["q"]]
    specs: list[dict[str, Any]] = [{"slot": s, "length": n} for s, n in zip(slots, lengths)]
    if checkpoints is not None:
        if len(checkpoints) != len(specs):
            raise ValueError(f"checkpoints needs one list per sequence ({len(specs)}), got {len(checkpoints)}")
        for spec, marks in zip(specs, checkpoints):
            if marks:
                spec["checkpoints"] = [{"offset": int(offset), "key": key} for offset, key in marks]
    options: dict[str, Any] = {
        "layer": layer, "sequences": specs,
        "use_qk_l2norm": use_qk_l2norm, "use_beta_sigmoid": use_beta_sigmoid,
        "allow_neg_eigval": allow_neg_eigval, "return_final_state": return_final_state,
    }
    if lower_bound is not None:
        options["lower_bound"] = float(lower_bound)
    if scale is not None:
        options["scale"] = float(scale)
    return slots, parts, lengths, options


@dataclass
class _ShmPrefill:
    """A shared memory prefill, laid out: what goes where, and how to read the answer."""

    tensors: dict[str, list[torch.Tensor]]
    places: dict[str, Placed]
    need: int
    options: dict[str, Any]
    lengths: list[int]

    def call(self, arena: Arena) -> _Call[PrefillOutput]:
        """Copy the inputs in and build the request (after the region is large enough)."""
        body = arena.fill(self.tensors, self.places, self.options)

        def parse(headers: Headers, data: bytearray) -> PrefillOutput:
            doc = json.loads(data)
            o = arena.result(doc, "o")
            if o is None:
                raise KeyError("o")
            return PrefillOutput(doc["slots"], self.lengths, o, arena.result(doc, "final_state"),
                                 _server_timing(headers))

        return _Call("POST", "/prefill", parse, body, SHM_JSON, JSON)


def _shm_prefill(
    arena: Arena, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor], lower_bound: Optional[float], use_qk_l2norm: bool, use_beta_sigmoid: bool,
    allow_neg_eigval: bool, scale: Optional[float], return_final_state: bool,
    checkpoints: Optional[Sequence[Sequence[tuple[int, str]]]] = None,
) -> _ShmPrefill:
    _, parts, lengths, options = _prefill_options(
        layer, sequences, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval, scale=scale, return_final_state=return_final_state,
        checkpoints=checkpoints)
    _check_inputs({}, A_log=A_log, dt_bias=dt_bias)
    tensors = {**parts, **{name: [t] for name, t in (("A_log", A_log), ("dt_bias", dt_bias)) if t is not None}}
    places, need = arena.layout(tensors, lengths, return_final_state)
    return _ShmPrefill(tensors, places, need, options, lengths)


def _prefill_call(
    media: str, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor], lower_bound: Optional[float], use_qk_l2norm: bool, use_beta_sigmoid: bool,
    allow_neg_eigval: bool, scale: Optional[float], return_final_state: bool,
    checkpoints: Optional[Sequence[Sequence[tuple[int, str]]]] = None,
) -> _Call[PrefillOutput]:
    slots, parts, lengths, options = _prefill_options(
        layer, sequences, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval, scale=scale, return_final_state=return_final_state,
        checkpoints=checkpoints)
    _check_inputs({}, A_log=A_log, dt_bias=dt_bias)
    extra = {name: t for name, t in (("A_log", A_log), ("dt_bias", dt_bias)) if t is not None}
    if media == SAFETENSORS:  # sent as the header and views of the tensors' own bytes: no copy, no join
        body: Body = safetensors_pieces({**parts, **extra}, {"request": json.dumps(options)})
    else:
        tensors = {name: torch.cat(ps) if len(ps) > 1 else ps[0] for name, ps in parts.items()}
        doc = {**options, **{name: tensor_to_json(t) for name, t in {**tensors, **extra}.items()}}
        body = json.dumps(doc, separators=(",", ":")).encode("ascii")

    def parse(headers: Headers, data: bytearray) -> PrefillOutput:
        got_slots, o, final = decode_prefill_response(data, media_type(headers.get("content-type")) or media)
        return PrefillOutput(got_slots, lengths, o, final, _server_timing(headers))

    return _Call("POST", "/prefill", parse, body, media, media)


def _geometry(info: Any) -> Geometry:
    """`Geometry.from_info`, its sizes checked (ValueError for one that is not a positive
    integer: the region's layout would fail on it, or be wrong)."""
    geometry = Geometry.from_info(info)
    for name in ("num_heads", "head_v_dim", "head_k_dim"):
        value = getattr(geometry, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r:.40}")
    return geometry


class _Calls:
    """Builds every call; `KDAClient` and `AsyncKDAClient` only differ in how they send."""

    def __init__(self, encoding: Encoding) -> None:
        self.media = _media(encoding)

    def alloc(self, count: int) -> _Call[list[str]]:
        return _Call("POST", "/slots", lambda h, b: _json(h, b)["slots"], json.dumps({"count": count}).encode())

    def alloc_prefix(self, count: int, prefix: Sequence[str]) -> _Call[PrefixAlloc]:
        def parse(h: Headers, b: bytearray) -> PrefixAlloc:
            doc = _json(h, b)
            return PrefixAlloc(doc["slots"], **doc["prefix"])
        return _Call("POST", "/slots", parse, json.dumps({"count": count, "prefix": list(prefix)}).encode())

    def publish(self, slot: str, key: str) -> _Call[dict[str, Any]]:
        return _Call("POST", f"/slots/{_q(slot)}/publish", _json, json.dumps({"key": key}).encode())

    def prefix_info(self, key: str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/prefix/{_q(key)}", _json)

    def drop_prefix(self, key: str) -> _Call[Optional[bool]]:
        return _Call("DELETE", f"/prefix/{_q(key)}", _dropped)

    def free(self, slot: str) -> _Call[None]:
        return _Call("DELETE", f"/slots/{_q(slot)}", _nothing)

    def fork(self, slot: str) -> _Call[str]:
        return _Call("POST", f"/slots/{_q(slot)}/fork", lambda h, b: _json(h, b)["slot"])

    def slot_info(self, slot: str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/slots/{_q(slot)}", _json)

    def geometry(self) -> _Call[Geometry]:
        """The pool's geometry, from /info (what a shared memory prefill lays out by; a size
        that is not a positive integer is a reply the client cannot decode)."""
        return _Call("GET", "/info", lambda h, b: _geometry(_json(h, b)))

    def get_state(self, slot: str) -> _Call[torch.Tensor]:
        return _Call("GET", f"/slots/{_q(slot)}/state", _read_state, accept=self.media)

    def put_state(self, slot: str, state: torch.Tensor) -> _Call[None]:
        body = encode_state_safetensors(state) if self.media == SAFETENSORS else encode_state_json(state)
        return _Call("PUT", f"/slots/{_q(slot)}/state", _nothing, body, self.media)

    def info(self) -> _Call[dict[str, Any]]:
        return _Call("GET", "/info", _json)

    def prefill(self, layer: int, sequences: Sequence[SequenceInput], **options: Any) -> _Call[PrefillOutput]:
        return _prefill_call(self.media, layer, sequences, **options)

    def register_region(self, registration: Registration) -> _Call[None]:
        return _Call("POST", registration.path, _nothing, json.dumps(registration.body).encode())

    def unregister_region(self, arena: Arena, name: str) -> _Call[None]:
        method, path = arena.unregistration(name)
        return _Call(method, path, _nothing)


_SEND_CHUNK = 1 << 20
"""Bodies go out in 1 MiB views: httpx would copy a bytearray into bytes, and httpcore
(the async client's transport) re-slices what a socket send leaves over, which is
quadratic on one large buffer (62 MB: ~200 MB/s in one piece, ~320 MB/s in 1 MiB pieces,
on loopback)."""


def _chunks(body: Body) -> Iterator[memoryview]:
    for piece in body if isinstance(body, list) else [memoryview(body)]:
        view = piece.cast("B")
        for start in range(0, len(view), _SEND_CHUNK):
            yield view[start:start + _SEND_CHUNK]


async def _achunks(body: Body) -> AsyncIterator[memoryview]:
    for chunk in _chunks(body):
        yield chunk


def _client_headers(api_key: Optional[str]) -> dict[str, str]:
    """The headers of every request: the API key, and ``accept-encoding: identity`` (httpx
    asks for gzip by default; a proxy that honours it sends a compressed body under its
    compressed Content-Length, and tensors gain nothing from gzip)."""
    headers = {"accept-encoding": "identity"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def _check_api_key(api_key: Optional[str]) -> None:
    """ValueError for a key no header value can carry (a control character: CR or LF would
    end the header and start another on the requests written by hand)."""
    if api_key is not None and any(ord(c) < 0x20 or ord(c) == 0x7F for c in api_key):
        raise ValueError("api_key holds a control character (CR, LF, ...): no HTTP header can carry it")


def _arena(transport: Transport, ttl_s: float, views: bool) -> Optional[Arena]:
    if transport == "shm":
        return ShmArena(ttl_s, views)
    if transport == "cuda":
        return CudaArena(ttl_s, views)
    if transport != "http":
        raise ValueError(f"transport must be 'http', 'shm' or 'cuda', got {transport!r}")
    return None


class KDAClient:
    """Synchronous client. ``base_url`` of the server; ``api_key`` when it has one;
    ``encoding`` of request and response bodies; ``timeout`` in seconds per request.
    ``transport="shm"``: prefill tensors through shared memory (same host only), the
    region leased for ``shm_ttl_s`` seconds past its last use; ``transport="cuda"``: the
    same through GPU memory shared by CUDA IPC (same GPU; results on it); ``shm_views``:
    results view the region (valid until the next prefill) instead of being copies.
    ``framed_socket``: the server's ``--framed-socket`` path, for the shared memory
    prefills of ``transport="shm"`` or ``"cuda"`` (ValueError with ``transport="http"``)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: Optional[str] = None,
                 encoding: Encoding = "safetensors", timeout: float = 300.0, transport: Transport = "http",
                 shm_ttl_s: float = 300.0, shm_views: bool = False, framed_socket: Optional[str] = None) -> None:
        if framed_socket is not None and transport == "http":
            raise ValueError("framed_socket carries shared memory prefills: it needs transport='shm' or 'cuda'")
        _check_api_key(api_key)
        self._framed = None if framed_socket is None else FramedExchange(framed_socket, api_key, timeout)
        self._calls = _Calls(encoding)
        self._arena = _arena(transport, shm_ttl_s, shm_views)
        self._arena_lock = threading.Lock()  # one region: one shared memory prefill at a time
        self._prepared: "weakref.WeakSet[PreparedPrefill]" = weakref.WeakSet()  # released at close
        self._orphans: deque[tuple[Arena, int, int]] = deque()  # collected unreleased
        self._closed = False  # by `close`: every call refused from then on
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=_client_headers(api_key),
                                  mounts={"http://": StdlibTransport()})
        url = self._http.base_url
        self._small = (SmallExchange(url.host, url.port or 80, url.netloc.decode("ascii"),
                                     url.raw_path.decode("ascii").partition("?")[0], _client_headers(api_key), timeout)
                       if url.scheme == "http" else None)

    def _check_open(self) -> None:
        """ClientClosed once the client is closed."""
        if self._closed:
            raise ClientClosed()

    def _run(self, call: _Call[_T]) -> _T:
        """`_send` on an open client (ClientClosed, before anything is sent, on a closed one)."""
        self._check_open()
        return self._send(call)

    def _send(self, call: _Call[_T]) -> _T:
        """``call``'s request and its parsed answer (KDAError for an error status). Shared
        memory prefills take the framed socket when there is one; small requests over
        http:// `SmallExchange`, the rest httpx."""
        if self._framed is not None and call.content_type == SHM_JSON:
            assert isinstance(call.body, (bytes, bytearray))
            answer = self._framed.request(Op.PREFILL, bytes(call.body))
            return call.read(answer.status, answer.headers, answer.body)
        if self._small is not None and (call.body is None or _body_size(call.body) <= MAX_BODY):
            body = () if call.body is None else call.body if isinstance(call.body, list) else (call.body,)
            answer = self._small.request(call.method, call.path, call.headers(), body)
            return call.read(answer.status, answer.headers, answer.body)
        content = None if call.body is None else _chunks(call.body)
        with self._http.stream(call.method, call.path, content=content, headers=call.headers()) as r, \
                call.decoding(r.status_code, r.headers):  # a body longer or shorter than its length
            buf = _body_buffer(r.headers)
            for chunk in r.iter_bytes():
                buf.add(chunk)
            body = buf.finish()
        return call.read(r.status_code, r.headers, body)

    def alloc(self, count: int = 1, prefix: Optional[Sequence[str]] = None) -> Union[list[str], PrefixAlloc]:
        """``count`` new slots with zero state, all or none (PoolFullError when short). With
        ``prefix`` (prefix cache keys in prompt order) they start from the longest complete
        entry among them, and a `PrefixAlloc` says which."""
        if prefix is not None:
            return self._run(self._calls.alloc_prefix(count, prefix))
        return self._run(self._calls.alloc(count))

    def publish(self, slot: str, key: str) -> dict[str, Any]:
        """Store ``slot``'s state (every layer, equal token counts) as the prefix cache entry
        ``key``; returns the entry (key, tokens, layers, complete, bytes, tier, last_used)."""
        return self._run(self._calls.publish(slot, key))

    def prefix_info(self, key: str) -> dict[str, Any]:
        """The prefix cache entry ``key`` (SlotNotFound, 404, when there is none)."""
        return self._run(self._calls.prefix_info(key))

    def drop_prefix(self, key: str) -> Optional[bool]:
        """Remove the prefix cache entry ``key``; whether there was one (no entry is no
        error; None from a server that does not say)."""
        return self._run(self._calls.drop_prefix(key))

    def free(self, slot: str) -> None:
        self._run(self._calls.free(slot))

    def fork(self, slot: str) -> str:
        """A new slot holding a copy of ``slot``'s state."""
        return self._run(self._calls.fork(slot))

    def slot_info(self, slot: str) -> dict[str, Any]:
        """created, last_used (unix s), tokens_per_layer, state_lost."""
        return self._run(self._calls.slot_info(slot))

    def get_state(self, slot: str) -> torch.Tensor:
        """The slot's state [L, HV, V, K] in the pool dtype."""
        return self._run(self._calls.get_state(slot))

    def put_state(self, slot: str, state: torch.Tensor) -> None:
        """Replace the slot's state with ``state`` [L, HV, V, K] (the pool dtype)."""
        self._run(self._calls.put_state(slot, state))

    def info(self) -> dict[str, Any]:
        """Pool geometry, device, backend, free and used slots."""
        return self._run(self._calls.info())

    def ready(self) -> bool:
        """Whether the server answers /health/ready with 200 (ClientClosed when closed)."""
        self._check_open()
        try:
            return self._http.get("/health/ready").status_code == 200
        except httpx.TransportError:
            return False

    def prefill(
        self, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None, use_qk_l2norm: bool = False,
        use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False, scale: Optional[float] = None,
        return_final_state: bool = True, checkpoints: Optional[Sequence[Sequence[tuple[int, str]]]] = None,
    ) -> PrefillOutput:
        """Prefill ``sequences`` on ``layer``, each ``(slot or None, q, k, v, g, beta)``; see
        the module docstring. g is the log decay unless a gate applies (A_log or
        lower_bound here, or the server's gate parameters for the layer).
        ``checkpoints``: per sequence, ``(offset, key)`` pairs: store the slot's state at
        ``offset`` tokens of this layer (its tokens before plus a multiple of 64 into the
        sequence, or the sequence's end) in the prefix cache under ``key``."""
        self._check_open()
        options = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                       use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval, scale=scale,
                       return_final_state=return_final_state, checkpoints=checkpoints)
        arena = self._arena
        if arena is None:
            return self._run(self._calls.prefill(layer, sequences, **options))
        if arena.geometry is None:
            arena.geometry = self._run(self._calls.geometry())
        plan = _shm_prefill(arena, layer, sequences, **options)
        with self._arena_lock:
            if not arena.fits(plan.need):
                self._register(arena, plan.need)
            try:
                return self._run(plan.call(arena))
            except BadRequest as e:
                if not is_unknown_region(e.problem):
                    raise
            arena.forget()  # the server lost the region (a restart, the lease ran out): register a new one, once
            self._register(arena, plan.need)
            return self._run(plan.call(arena))

    def prepare(
        self, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None, use_qk_l2norm: bool = False,
        use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False, scale: Optional[float] = None,
        return_final_state: bool = True,
    ) -> PreparedPrefill:
        """Prepare a prefill of ``sequences`` (``(slot, q, k, v, g, beta)``, every slot an
        existing one; the tensors give the shapes and dtypes, nothing runs) on ``layer``,
        with the options of `prefill` (A_log and dt_bias are taken now, once), to run step
        after step with new inputs (`PreparedPrefill.run`): one small frame per step, and on
        a GPU server one CUDA graph replayed. Needs ``framed_socket`` (ValueError without);
        its own region, released with it (`PreparedPrefill.release`, or a ``with`` block)."""
        self._check_open()
        if self._framed is None or self._arena is None:
            raise ValueError(_NO_FRAMED_SOCKET)
        self._release_orphans()
        if self._arena.geometry is None:
            self._arena.geometry = self._run(self._calls.geometry())
        arena, plan, slots = _prepared_layout(self._arena, layer, sequences, A_log=A_log, dt_bias=dt_bias,
                                       lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                                       use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
                                       scale=scale, return_final_state=return_final_state)
        self._register(arena, plan.need)
        try:
            answer, connection = self._framed.request_on(Op.PREPARE,
                                                         arena.fill(plan.tensors, plan.places, plan.options))
            number = _prepared_number(answer)
        except BaseException:
            self._drop(arena)
            raise
        prepared = PreparedPrefill(self._framed, arena, plan.places, slots, plan.lengths, number, _finished,
                                   partial(self._drop, arena), connection, self._orphans, lambda: self._closed)
        self._prepared.add(prepared)
        return prepared

    def _release_orphans(self) -> None:
        """Release the prepared prefills garbage-collected unreleased (quietly, as `_drop`)."""
        while True:
            try:
                arena, connection, number = self._orphans.popleft()
            except IndexError:
                return
            try:
                if self._framed is not None:
                    with suppress(httpx.TransportError, KDAError):
                        _finished(self._framed.request(Op.RELEASE, PREPARED_ID.pack(number), connection))
            finally:
                self._drop(arena)

    def _register(self, arena: Arena, need: int) -> None:
        """Register a new region of ``need`` bytes for ``arena`` (refused once the client is
        closed), then unregister the one it replaces (sent even should the client close
        meanwhile: no region may stay registered)."""
        registration = arena.create(need)
        try:
            self._run(self._calls.register_region(registration))
        except BaseException:
            arena.abandon()
            raise
        old = arena.registered()
        if old is not None:
            self._send(self._calls.unregister_region(arena, old))

    def _drop(self, arena: Arena) -> None:
        """Close ``arena`` and unregister its region on the server (quietly: its lease reclaims
        it), the client closed or not."""
        name = arena.close()
        if name is not None:
            with suppress(httpx.TransportError, KDAError):
                self._send(self._calls.unregister_region(arena, name))

    def close(self) -> None:
        """Release the prepared prefills still alive, unregister the shared memory region (if
        any) and close the connections. From then on every call, and every run of a prepared
        prefill, raises ClientClosed before anything is sent; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            for prepared in list(self._prepared):
                with suppress(httpx.TransportError, KDAError):
                    prepared.release()
            self._release_orphans()
            if self._arena is not None:
                with self._arena_lock:  # after a shared memory prefill under way: its region goes too
                    self._drop(self._arena)
        finally:
            if self._framed is not None:
                self._framed.close()
            if self._small is not None:
                self._small.close()
            self._http.close()

    def __enter__(self) -> "KDAClient":
        """The client, for a block that closes it (ClientClosed when it is closed already)."""
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKDAClient:
    """`KDAClient`'s asyncio twin: the same methods, as coroutines (``framed_socket`` too,
    through `kda_client.framed.AsyncFramedExchange`)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: Optional[str] = None,
                 encoding: Encoding = "safetensors", timeout: float = 300.0, transport: Transport = "http",
                 shm_ttl_s: float = 300.0, shm_views: bool = False, framed_socket: Optional[str] = None) -> None:
        if framed_socket is not None and transport == "http":
            raise ValueError("framed_socket carries shared memory prefills: it needs transport='shm' or 'cuda'")
        _check_api_key(api_key)
        self._framed = None if framed_socket is None else AsyncFramedExchange(framed_socket, api_key, timeout)
        self._calls = _Calls(encoding)
        self._arena = _arena(transport, shm_ttl_s, shm_views)
        self._arena_lock = asyncio.Lock()  # one region: one shared memory prefill at a time
        self._prepared: "weakref.WeakSet[AsyncPreparedPrefill]" = weakref.WeakSet()  # as `KDAClient`'s
        self._orphans: deque[tuple[Arena, int, int]] = deque()
        self._closed = False  # by `aclose`, as `KDAClient`'s
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_client_headers(api_key))

    def _check_open(self) -> None:
        """ClientClosed once the client is closed."""
        if self._closed:
            raise ClientClosed()

    async def _run(self, call: _Call[_T]) -> _T:
        """`_send` on an open client (ClientClosed, before anything is sent, on a closed one)."""
        self._check_open()
        return await self._send(call)

    async def _send(self, call: _Call[_T]) -> _T:
        """`KDAClient._send`, awaited (httpx's default transport for every HTTP request)."""
        if self._framed is not None and call.content_type == SHM_JSON:  # as `KDAClient._send`
            assert isinstance(call.body, (bytes, bytearray))
            answer = await self._framed.request(Op.PREFILL, bytes(call.body))
            return call.read(answer.status, answer.headers, answer.body)
        content = None if call.body is None else _achunks(call.body)
        async with self._http.stream(call.method, call.path, content=content, headers=call.headers()) as r:
            with call.decoding(r.status_code, r.headers):  # as `KDAClient._send`
                buf = _body_buffer(r.headers)
                async for chunk in r.aiter_bytes():
                    buf.add(chunk)
                body = buf.finish()
        return call.read(r.status_code, r.headers, body)

    async def alloc(self, count: int = 1, prefix: Optional[Sequence[str]] = None) -> Union[list[str], PrefixAlloc]:
        if prefix is not None:
            return await self._run(self._calls.alloc_prefix(count, prefix))
        return await self._run(self._calls.alloc(count))

    async def publish(self, slot: str, key: str) -> dict[str, Any]:
        return await self._run(self._calls.publish(slot, key))

    async def prefix_info(self, key: str) -> dict[str, Any]:
        return await self._run(self._calls.prefix_info(key))

    async def drop_prefix(self, key: str) -> Optional[bool]:
        return await self._run(self._calls.drop_prefix(key))

    async def free(self, slot: str) -> None:
        await self._run(self._calls.free(slot))

    async def fork(self, slot: str) -> str:
        return await self._run(self._calls.fork(slot))

    async def slot_info(self, slot: str) -> dict[str, Any]:
        return await self._run(self._calls.slot_info(slot))

    async def get_state(self, slot: str) -> torch.Tensor:
        return await self._run(self._calls.get_state(slot))

    async def put_state(self, slot: str, state: torch.Tensor) -> None:
        await self._run(self._calls.put_state(slot, state))

    async def info(self) -> dict[str, Any]:
        return await self._run(self._calls.info())

    async def ready(self) -> bool:
        """`KDAClient.ready`, awaited."""
        self._check_open()
        try:
            return (await self._http.get("/health/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def prefill(
        self, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None, use_qk_l2norm: bool = False,
        use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False, scale: Optional[float] = None,
        return_final_state: bool = True, checkpoints: Optional[Sequence[Sequence[tuple[int, str]]]] = None,
    ) -> PrefillOutput:
        """`KDAClient.prefill`, awaited."""
        self._check_open()
        options = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                       use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval, scale=scale,
                       return_final_state=return_final_state, checkpoints=checkpoints)
        arena = self._arena
        if arena is None:
            return await self._run(self._calls.prefill(layer, sequences, **options))
        if arena.geometry is None:
            arena.geometry = await self._run(self._calls.geometry())
        plan = _shm_prefill(arena, layer, sequences, **options)
        async with self._arena_lock:
            if not arena.fits(plan.need):
                await self._register(arena, plan.need)
            try:
                return await self._run(plan.call(arena))
            except BadRequest as e:
                if not is_unknown_region(e.problem):
                    raise
            arena.forget()  # the server lost the region (a restart, the lease ran out): register a new one, once
            await self._register(arena, plan.need)
            return await self._run(plan.call(arena))

    async def prepare(
        self, layer: int, sequences: Sequence[SequenceInput], *, A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None, use_qk_l2norm: bool = False,
        use_beta_sigmoid: bool = False, allow_neg_eigval: bool = False, scale: Optional[float] = None,
        return_final_state: bool = True,
    ) -> AsyncPreparedPrefill:
        """`KDAClient.prepare` for asyncio: an `AsyncPreparedPrefill` (``await run(...)``,
        ``await release()`` or ``async with``)."""
        self._check_open()
        if self._framed is None or self._arena is None:
            raise ValueError(_NO_FRAMED_SOCKET)
        await self._release_orphans()
        if self._arena.geometry is None:
            self._arena.geometry = await self._run(self._calls.geometry())
        arena, plan, slots = _prepared_layout(self._arena, layer, sequences, A_log=A_log, dt_bias=dt_bias,
                                       lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                                       use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
                                       scale=scale, return_final_state=return_final_state)
        await self._register(arena, plan.need)
        try:
            answer, connection = await self._framed.request_on(Op.PREPARE,
                                                               arena.fill(plan.tensors, plan.places, plan.options))
            number = _prepared_number(answer)
        except BaseException:
            await self._drop(arena)
            raise
        prepared = AsyncPreparedPrefill(self._framed, arena, plan.places, slots, plan.lengths, number, _finished,
                                        partial(self._drop, arena), connection, self._orphans, lambda: self._closed)
        self._prepared.add(prepared)
        return prepared

    async def _release_orphans(self) -> None:
        """`KDAClient._release_orphans`, awaited."""
        while True:
            try:
                arena, connection, number = self._orphans.popleft()
            except IndexError:
                return
            try:
                if self._framed is not None:
                    with suppress(httpx.TransportError, KDAError):
                        _finished(await self._framed.request(Op.RELEASE, PREPARED_ID.pack(number), connection))
            finally:
                await self._drop(arena)

    async def _register(self, arena: Arena, need: int) -> None:
        """`KDAClient._register`, awaited."""
        registration = arena.create(need)
        try:
            await self._run(self._calls.register_region(registration))
        except BaseException:
            arena.abandon()
            raise
        old = arena.registered()
        if old is not None:
            await self._send(self._calls.unregister_region(arena, old))

    async def _drop(self, arena: Arena) -> None:
        """`KDAClient._drop`, awaited."""
        name = arena.close()
        if name is not None:
            with suppress(httpx.TransportError, KDAError):
                await self._send(self._calls.unregister_region(arena, name))

    async def aclose(self) -> None:
        """`KDAClient.close`, awaited."""
        if self._closed:
            return
        self._closed = True
        try:
            for prepared in list(self._prepared):
                with suppress(httpx.TransportError, KDAError):
                    await prepared.release()
            await self._release_orphans()
            if self._arena is not None:
                async with self._arena_lock:  # as `KDAClient.close`
                    await self._drop(self._arena)
        finally:
            if self._framed is not None:
                await self._framed.aclose_connection()
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncKDAClient":
        """`KDAClient.__enter__`, awaited."""
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

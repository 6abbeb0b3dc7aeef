"""``POST /prefill``: JSON or safetensors bodies (by Content-Type; the reply by Accept,
default the request's), or tensors by reference to registered shared memory
(``application/vnd.kda.shm+json``, `service.shm.prefill`) where the deployment has a
region registry. Every response carries ``Server-Timing: decode, validate, kernel,
encode`` (milliseconds), so a client can tell transport time from compute. The slots a
prefill created are freed again when its client leaves before the response is out
(`DeliveryGuard`, `service.http.abandon`)."""
from __future__ import annotations

import time
from typing import Optional

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ...core.api import CoreAPI
from ...core.inputs import PrefillResult
from ...core.worker import off_loop
from ...errors import ServiceError, UnsupportedMediaType
from ...shm.prefill import (
    SHM_JSON, PrefillShmRequest, PrefillShmResponse, host_bytes, input_refs, parse_shm_request, read_request,
    region_names, write_result,
)
from ...shm.registry import ShmRegistry
from ...wire.buffers import WarmBuffers
from ...wire.media import ENCODINGS, JSON, SAFETENSORS, negotiate, request_encoding
from ...wire.prefill import decode_prefill_json, decode_prefill_safetensors, encode_prefill_json, prefill_safetensors_pieces
from ...wire.schema import PrefillJSONRequest, PrefillJSONResponse
from ..abandon import Abandonment
from ..body import read_body
from ..openapi import PREFILL_BINARY, both_encodings, error_responses, ref
from ..responses import DeliveryGuard, PiecesResponse, server_timing
from ..tracing import Phase, Stopwatch

_RESPONSES = {
    200: {"description": "outputs o [T, HV, V] and final states [N, HV, V, K]; encoding by Accept (default: the "
                         "request's). A shared memory request gets PrefillShmResponse (JSON): the outputs are in its "
                         "regions", "content": {
              **both_encodings(PrefillJSONResponse, "safetensors with o, final_state and __metadata__.response = "
                                                    "{\"slots\": [...]}"),
              JSON: {"schema": {"oneOf": [ref(PrefillJSONResponse), ref(PrefillShmResponse)]}}}},
    **error_responses(400, 404, 406, 408, 409, 413, 415, 422, 503)}
_BODY = {"requestBody": {"required": True, "content": {
    **both_encodings(PrefillJSONRequest, PREFILL_BINARY), SHM_JSON: {"schema": ref(PrefillShmRequest)}}}}


def _no_shared_memory() -> UnsupportedMediaType:
    return UnsupportedMediaType(
        f"{SHM_JSON}: this deployment reads no shared memory (a sharded deployment has no region registry: "
        f"regions registered with one ingress replica would be unknown to the others); send the tensors in the "
        f"body as {JSON} or {SAFETENSORS}")


def add_prefill_route(router: APIRouter, core: CoreAPI, left: Abandonment, regions: Optional[ShmRegistry]) -> None:
    """``POST /prefill`` on ``core``; shared memory requests read ``regions`` (None: refused, 415)."""
    shm_inputs = WarmBuffers()  # host buffers shared memory inputs are copied out into

    @router.post("/prefill", responses=_RESPONSES, openapi_extra=_BODY,
                 summary="Chunked KDA prefill of a batch of sequences on one layer, in place on their slots")
    async def prefill(request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"), (*ENCODINGS, SHM_JSON))
        if encoding == SHM_JSON:
            if regions is None:
                raise _no_shared_memory()
            return await prefill_shm(request, regions)
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=encoding)
        body = await read_body(request)
        decode = decode_prefill_json if encoding == JSON else decode_prefill_safetensors
        clock = Stopwatch()
        inputs = await off_loop(decode, body, nbytes=len(body))
        decoded = clock.phase("decode")
        core_start = time.time_ns()
        result = await left.made(core.prefill(inputs), _allocated)
        core_end = time.time_ns()
        if result.allocated and (gone := await left.check(request, result.allocated)):
            return gone
        size = result.o.numel() * result.o.element_size()
        clock.restart()
        if reply == JSON:
            pieces = [memoryview(await off_loop(encode_prefill_json, result, nbytes=size))]
        else:
            pieces = prefill_safetensors_pieces(result)
        timing = server_timing([decoded, *_core_phases(result, core_start, core_end), clock.phase("encode")])
        if result.allocated:
            return DeliveryGuard(pieces, reply, lambda: left.release(result.allocated), timing)
        return PiecesResponse(pieces, reply, timing)

    async def prefill_shm(request: Request, registry: ShmRegistry) -> Response:
        """/prefill with tensors in shared memory: the regions stay mapped from the bounds
        checks until the outputs are written."""
        negotiate(request.headers.get("accept"), (JSON,), default=JSON)
        parsed = parse_shm_request(await read_body(request))
        with registry.lease(region_names(parsed)) as leased:
            clock = Stopwatch()
            plan = await off_loop(read_request, parsed, leased, core, shm_inputs,
                                  nbytes=host_bytes(input_refs(parsed), leased))
            decoded = clock.phase("decode")
            core_start = time.time_ns()
            result = await left.made(core.prefill(plan.inputs), _allocated)
            core_end = time.time_ns()
            if result.allocated and (gone := await left.check(request, result.allocated)):
                return gone
            clock.restart()
            try:
                doc = await off_loop(write_result, plan, result, leased,
                                     nbytes=host_bytes((plan.o, plan.final_state), leased))
            except ServiceError:  # the outputs cannot reach the client: nor may the slots made for it
                for slot_id in result.allocated:
                    await core.free(slot_id)
                raise
        timing = server_timing([decoded, *_core_phases(result, core_start, core_end), clock.phase("encode")])
        return JSONResponse(doc, headers=timing)


def _allocated(result: PrefillResult) -> list[str]:
    return result.allocated


def _core_phases(result: PrefillResult, start_ns: int, end_ns: int) -> tuple[Phase, Phase]:
    """The core's phases of a prefill it ran from ``start_ns`` to ``end_ns``: validation
    first (it starts with the call), the launch last (it ends with the call); the batcher's
    wait lies between."""
    return Phase("validate", start_ns, result.validate_s), Phase.ending("kernel", end_ns, result.kernel_s)

"""The OpenAPI pieces of the REST routes: problem+json error responses, bodies in the two
encodings (JSON and safetensors), and an app's schema completed with the models only
referenced from hand-declared bodies (/prefill and the state routes read their raw body
themselves, so FastAPI cannot see those models)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ..shm.prefill import PrefillShmRequest, PrefillShmResponse
from ..wire.media import JSON, PROBLEM, SAFETENSORS
from ..wire.schema import PrefillJSONRequest, PrefillJSONResponse, PrefillOptions, Problem, StateJSON

_REF = "#/components/schemas/{model}"
_BINARY = {"type": "string", "format": "binary"}
_HAND_DECLARED = (PrefillJSONRequest, PrefillJSONResponse, PrefillOptions, PrefillShmRequest, PrefillShmResponse,
                  StateJSON, Problem)

PREFILL_BINARY = ("safetensors with tensors q [T,H,K], k [T,H,K], v [T,HV,V], g [T,HV,K], beta [T,HV] "
                  "(optional A_log [HV], dt_bias [HV,K]) and __metadata__.request = PrefillOptions as JSON")
STATE_BINARY = "safetensors with tensor state [L,HV,V,K] in the pool dtype"


def ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to ``model``'s schema among the components."""
    return {"$ref": _REF.format(model=model.__name__)}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for error ``codes`` (and 401, 422: any route may give them), all problem+json."""
    return {code: {"description": "problem details (RFC 9457)", "content": {PROBLEM: {"schema": ref(Problem)}}}
            for code in sorted({401, 422, *codes})}


def both_encodings(model: type[BaseModel], binary: str) -> dict[str, Any]:
    """OpenAPI content in the two encodings: JSON ``model`` and a safetensors body (``binary`` describes it)."""
    return {JSON: {"schema": ref(model)}, SAFETENSORS: {"schema": {**_BINARY, "description": binary}}}


def install_openapi(app: FastAPI) -> None:
    """Make ``app``'s schema FastAPI's plus the hand-declared bodies' models (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _HAND_DECLARED:
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

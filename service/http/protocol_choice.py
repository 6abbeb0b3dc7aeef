"""Which HTTP protocol ``kda-serve`` gives uvicorn: `service.http.protocol.KDAHttpConnection`
when it imports and the private parts of uvicorn's httptools protocol it builds on are
where it expects them, else uvicorn's stock ``HttpToolsProtocol``, with the reason.

`service.http.protocol` subclasses ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol``
and reads the fields of its ``RequestResponseCycle``, none of which uvicorn documents;
pyproject.toml caps uvicorn at the minors the tests ran. A uvicorn outside that range can
move them: the import then fails (a name gone) or a hook listed below is missing, and the
server still serves, on the stock protocol, without what the subclass adds (bodies read
whole into reused buffers, the header, idle and size limits, HTTP framing errors as
problem+json). `choose_protocol` says which one and why.
"""
from __future__ import annotations

import asyncio
from typing import Optional

PROTOCOL_MODULE = "service.http.protocol"

# Methods of HttpToolsProtocol that KDAHttpProtocol overrides or calls.
PROTOCOL_METHODS = (
    "__init__", "connection_made", "connection_lost", "eof_received", "pause_writing", "resume_writing",
    "data_received", "on_message_begin", "on_headers_complete", "on_body", "on_message_complete",
    "on_response_complete", "_start_asgi_task", "_unset_keepalive_if_required",
)
# Fields KDAHttpProtocol reads on itself, set by those methods (stored names in their code).
PROTOCOL_FIELDS = ("parser", "cycle", "pipeline", "timeout_keep_alive", "logger", "loop", "transport", "flow",
                   "url", "headers")
# Fields of RequestResponseCycle its whole-body ``receive`` reads and writes.
CYCLE_FIELDS = ("body", "more_body", "message_event", "response_complete", "disconnected",
                "waiting_for_100_continue", "transport", "flow", "scope")


def _stored_names(cls: type, methods: tuple[str, ...]) -> set[str]:
    """Every name the code of ``cls``'s ``methods`` refers to (attribute stores included)."""
    names: set[str] = set()
    for name in methods:
        code = getattr(getattr(cls, name, None), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def missing_hooks(protocol_cls: type, cycle_cls: type) -> list[str]:
    """The hooks of uvicorn's ``protocol_cls`` (HttpToolsProtocol) and ``cycle_cls``
    (RequestResponseCycle) that `KDAHttpProtocol` needs and does not find; [] when all are there."""
    missing = [f"HttpToolsProtocol.{m}" for m in PROTOCOL_METHODS if not callable(getattr(protocol_cls, m, None))]
    assigned = _stored_names(protocol_cls, ("__init__", "connection_made", "on_message_begin"))
    missing += [f"HttpToolsProtocol.{f}" for f in PROTOCOL_FIELDS if f not in assigned]
    cycle_names = _stored_names(cycle_cls, ("__init__",))
    missing += [f"RequestResponseCycle.{f}" for f in CYCLE_FIELDS if f not in cycle_names]
    return missing


def _stock() -> type[asyncio.BaseProtocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def choose_protocol() -> tuple[type[asyncio.BaseProtocol], Optional[str]]:
    """(the protocol class to give uvicorn as ``http=``, None) when kda-serve's own one
    can serve; (uvicorn's stock httptools protocol, why not) otherwise."""
    try:
        from .protocol import KDAHttpConnection
    except (ImportError, AttributeError) as e:  # a private name of uvicorn moved or went
        return _stock(), f"{PROTOCOL_MODULE} does not import with uvicorn {_uvicorn_version()}: {e}"
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    missing = missing_hooks(HttpToolsProtocol, RequestResponseCycle)
    if missing:
        return _stock(), f"uvicorn {_uvicorn_version()} lacks the hooks {PROTOCOL_MODULE} overrides: {', '.join(missing)}"
    return KDAHttpConnection, None


def fallback_warning(reason: str) -> str:
    """The log line for serving on the stock protocol."""
    return (f"serving with uvicorn's stock httptools protocol ({reason}): request bodies are not read whole into "
            "reused buffers, the header, idle and size limits (--header-timeout-s, --max-header-kb, "
            "--first-request-timeout-s) are not enforced, and HTTP framing errors are plain text and uncounted; "
            "install a uvicorn within pyproject.toml's range to restore them")


def _uvicorn_version() -> str:
    import uvicorn

    return uvicorn.__version__

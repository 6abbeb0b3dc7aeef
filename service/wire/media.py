"""Media types of the API and the Content-Type / Accept decisions made on them."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import NotAcceptable, UnsupportedMediaType

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"
PROBLEM = "application/problem+json"
ENCODINGS = (SAFETENSORS, JSON)


def media_type(header: Optional[str]) -> Optional[str]:
    """``"Application/JSON; charset=utf-8"`` -> ``"application/json"``; None when absent."""
    if header is None:
        return None
    return header.split(";", 1)[0].strip().lower() or None


def request_encoding(content_type: Optional[str], allowed: Sequence[str] = ENCODINGS) -> str:
    """The body's media type when it is one of ``allowed``; else UnsupportedMediaType (415)."""
    kind = media_type(content_type)
    if kind not in allowed:
        raise UnsupportedMediaType(
            f"Content-Type must be one of {list(allowed)}, got {content_type!r}", field="Content-Type"
        )
    return kind


def _ranges(accept: str) -> list[tuple[str, float]]:
    """Accept header -> [(media range, q)], malformed q-values read as 0."""
    out = []
    for item in accept.split(","):
        kind, *params = (p.strip() for p in item.split(";"))
        if not kind:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        out.append((kind.lower(), q))
    return out


def negotiate(accept: Optional[str], offered: Sequence[str], default: str) -> str:
    """The response media type: of ``offered``, the one the Accept header ranks highest
    (the most specific matching range sets its q); ``default`` when Accept is absent, and
    on ties. NotAcceptable (406) when Accept rules out every offer."""
    if accept is None or not accept.strip():
        return default
    best, best_q = None, 0.0
    ranked = sorted(offered, key=lambda m: m != default)  # default first: it wins ties
    ranges = _ranges(accept)
    for offer in ranked:
        kind = offer.split("/")[0]
        matches = [(0 if r == offer else 1 if r == f"{kind}/*" else 2, q)
                   for r, q in ranges if r in (offer, f"{kind}/*", "*/*")]
        if matches:
            q = min(matches)[1]
            if q > best_q:
                best, best_q = offer, q
    if best is None:
        raise NotAcceptable(f"Accept {accept!r} allows none of {list(offered)}", field="Accept")
    return best

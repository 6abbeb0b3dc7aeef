"""`EncodedSlashGuard`: a request target with an encoded slash (``%2F``) outside a prefix key
names no route: 404, as an unknown path.

The server decodes the request target into the ASGI ``path`` before Starlette routes on it,
so ``/slots%2F<id>`` routed as ``/slots/<id>`` and ``/slots/<id>%2Fstate`` as
``/slots/<id>/state``: a GET read a slot's metadata or its state, a DELETE freed the slot.
By RFC 3986 (section 2.2) an encoded slash is data, not a delimiter, and no route but
``/prefix/{key}`` takes a parameter that may hold a "/" (a slot id, a region name, a model
name cannot), so such a target names nothing. A prefix key is any string, "/" included,
sent as ``%2F`` by clients that quote it: everything after a literal ``/prefix/`` is the key
and passes (``/prefix%2F<key>`` does not).

The check reads the ASGI ``raw_path`` (the target as received), so it holds with
`service.http.protocol.KDAHttpProtocol`, uvicorn's stock protocol and behind Ray Serve
alike. It is the app's first route, not a middleware: it answers after the API key check,
through the app's own not-found (the same problem+json), and the metrics count it as
``unmatched``.
"""
from __future__ import annotations

from typing import Any

from starlette.datastructures import URLPath
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Receive, Scope, Send

ENCODED_SLASH = b"%2f"
"""An encoded slash, lower-cased (``%2F`` and ``%2f`` are the same)."""

KEY_PATHS = (b"/prefix/",)
"""The paths whose rest is one parameter that may hold "/" (`service.http.routes.prefix`)."""


def route_raw_path(scope: Scope) -> bytes:
    """The request target as received, without its query, below the app's root path: a
    server that strips the root path (uvicorn's ``--root-path``) leaves it out of
    ``raw_path``, one that does not (Ray Serve's route prefix) leaves it in."""
    raw = scope["raw_path"].partition(b"?")[0]
    root = scope.get("root_path", "").encode()
    if root and raw.startswith(root) and raw[len(root):len(root) + 1] == b"/":
        return raw[len(root):]
    return raw


def has_stray_encoded_slash(scope: Scope) -> bool:
    """Whether the request target holds an encoded slash outside a prefix key (a server
    that gives no ``raw_path`` has decoded it: nothing is known, nothing refused)."""
    if scope["type"] != "http" or not scope.get("raw_path"):
        return False
    path = route_raw_path(scope)
    return ENCODED_SLASH in path.lower() and not path.startswith(KEY_PATHS)


class EncodedSlashGuard(BaseRoute):
    """A route matching every request `has_stray_encoded_slash` finds, answered as an
    unknown path (see the module docstring); install it first among the app's routes."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return (Match.FULL, {}) if has_stray_encoded_slash(scope) else (Match.NONE, {})

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise HTTPException(status_code=404)

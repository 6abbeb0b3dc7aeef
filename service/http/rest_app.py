"""`create_rest_app`: a FastAPI app serving the REST API over a core, with the middleware
and error handling every deployment wears: problem+json for every error (a 500 for what
escapes a route, with ``Connection: close``), the body limit and timeout, the API key when
one is set, a 404 for an encoded slash outside a prefix key (`service.http.encoded_slash`),
per-route metrics in ``core.metrics``, and request ids and trace context
(`service.http.request_id`: ``X-Request-ID``, ``traceparent``, OpenTelemetry spans);
``POST /prefill`` reaches its endpoint past FastAPI's routing (`service.http.fast_prefill`).
The single-process app (`service.http.app`) and the Ray Serve ingress
(`service.ray_serve.ingress`) are this app plus their own routes."""
from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Callable, Optional

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline

from ..config import Settings
from ..core.api import CoreAPI
from ..shm.registry import ShmRegistry
from .encoded_slash import EncodedSlashGuard
from .fast_prefill import PrefillFastPath
from .middleware import AuthMiddleware, BodyLimitMiddleware, InternalErrors, MetricsMiddleware
from .openapi import install_openapi
from .problem_details import install_problem_handlers
from .request_id import RequestIdMiddleware
from .routes import rest_router
from ..version import __version__

DOCS_ASSETS = "/docs/assets"


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_rest_app(core: CoreAPI, settings: Settings, *, title: str, summary: str,
                    regions: Optional[ShmRegistry] = None, server_cancels: bool = False,
                    lifespan: Optional[Lifespan] = None) -> FastAPI:
    """The app serving `service.http.routes.rest_router` over ``core`` (``app.state.core``);
    ``settings`` give the API key, body limit, body timeout and deadline; ``regions``: the shared
    memory registry /prefill reads (None: refused); ``server_cancels``: the server cancels
    the request of a client that left (`rest_router`); ``lifespan``: FastAPI's."""
    # /docs and /redoc from the Swagger UI and ReDoc files fastapi-offline packages (served under DOCS_ASSETS), no
    # CDN: the docs work on an offline cluster. No online validator badge either.
    app = FastAPIOffline(title=title, version=__version__, summary=summary, lifespan=lifespan, static_url=DOCS_ASSETS,
                         swagger_ui_parameters={"validatorUrl": None},
                         redirect_slashes=False)  # "/slots/" is a 404, not a redirect outside the documented statuses
    app.state.core = core
    install_problem_handlers(app)
    router = rest_router(core, regions, server_cancels)
    # innermost: POST /prefill skips FastAPI's routing, inside every guarantee of the middleware below
    app.add_middleware(PrefillFastPath, route=_prefill_route(router), handlers=app.exception_handlers)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       deadline_s=settings.body_deadline_s)
    if settings.api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=lambda: core.metrics)
    app.add_middleware(InternalErrors)  # a 500 problem with Connection: close for what escapes a route
    app.add_middleware(RequestIdMiddleware)  # outermost: every response gets X-Request-ID and traceparent
    app.router.routes.insert(0, EncodedSlashGuard())  # first: a stray %2F matches no route below (404)
    app.include_router(router)
    install_openapi(app)
    return app


def _prefill_route(router: APIRouter) -> APIRoute:
    """``router``'s ``POST /prefill``."""
    return next(r for r in router.routes if isinstance(r, APIRoute) and r.path == "/prefill" and "POST" in r.methods)

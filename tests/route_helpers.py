"""Where an app's routes come from: every `APIRoute` an app serves (through routers it
includes, however FastAPI nests them), and every route path registered in the source of
`service/` by decorator, per module; and whether a core class implements
`service.core.api.CoreAPI` with its exact signatures."""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path
from typing import Any, Iterator

from fastapi import FastAPI
from fastapi.routing import APIRoute

from service.core.api import CoreAPI

SERVICE = Path(__file__).resolve().parents[1] / "service"
_VERBS = {"get", "post", "put", "delete", "patch", "head", "options"}


def api_routes(app: FastAPI) -> list[APIRoute]:
    """Every `APIRoute` of ``app``, included routers walked (FastAPI >= 0.137 keeps an
    included router as one node holding the original)."""
    def walk(routes: list) -> Iterator[APIRoute]:
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            elif hasattr(route, "original_router"):
                yield from walk(route.original_router.routes)
    return list(walk(app.routes))


def endpoints(app: FastAPI) -> dict[tuple[str, str], tuple[str, str]]:
    """(method, path) -> (module, qualified name) of the endpoint serving it; a path
    served twice is an error."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for route in api_routes(app):
        for method in route.methods:
            key = (method, route.path)
            assert key not in found, f"{method} {route.path} is served twice"
            found[key] = (route.endpoint.__module__, route.endpoint.__qualname__)
    return found


def registered_in_source() -> dict[tuple[str, str], list[str]]:
    """(METHOD, path) -> the modules under service/ whose code registers it with a route
    decorator (``@x.get("/path", ...)``)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SERVICE.rglob("*.py")):
        module = ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                        and decorator.func.attr in _VERBS and decorator.args
                        and isinstance(decorator.args[0], ast.Constant) and isinstance(decorator.args[0].value, str)):
                    found.setdefault((decorator.func.attr.upper(), decorator.args[0].value), []).append(module)
    return found


def core_api_methods() -> list[str]:
    """The names of `CoreAPI`'s operations."""
    return sorted(name for name, member in vars(CoreAPI).items()
                  if inspect.isfunction(member) and not name.startswith("_"))


def assert_implements_core_api(cls: type) -> None:
    """``cls`` has every `CoreAPI` operation as a coroutine function with the protocol's
    parameters (names, kinds, defaults) and type hints, return type included."""
    for name in core_api_methods():
        want, got = inspect.signature(getattr(CoreAPI, name)), inspect.signature(getattr(cls, name))
        assert inspect.iscoroutinefunction(getattr(cls, name)), f"{cls.__name__}.{name} is not a coroutine function"
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{cls.__name__}.{name}{got}"
        assert typing.get_type_hints(getattr(cls, name)) == typing.get_type_hints(getattr(CoreAPI, name)), \
            f"{cls.__name__}.{name}{got}"


def assert_core_attributes(core: Any) -> None:
    """``core`` has `CoreAPI`'s attributes."""
    for attribute in typing.get_type_hints(CoreAPI):
        assert hasattr(core, attribute), f"{type(core).__name__} lacks {attribute}"

"""What may import what (docs/ARCHITECTURE.md, "Layers"): each room's imports of the
project's own packages, read from the source with `ast`, stay inside the rules below.
A new module that reaches across a room fails here, with the offending import named."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "state_store", "tensor_io", "service", "kda_client")

# room -> rooms of ours it may import (a room is a top-level package, or service.<folder>)
ALLOWED: dict[str, set[str]] = {
    "tensor_io": set(),
    "kernels": set(),
    "state_store": {"tensor_io"},
    "service.errors": set(),
    "service.version": set(),
    "service.logs": set(),
    "service.config": {"kernels", "service.errors", "service.version"},
    "service.wire": {"tensor_io", "service.errors", "service.core.inputs"},
    "service.core": {"kernels", "state_store", "tensor_io", "service.config", "service.errors", "service.wire",
                     "service.version"},
    "service.shm": {"service.core", "service.errors", "service.wire", "tensor_io"},
    "service.kserve": {"service.core", "service.shm", "service.wire", "service.errors", "service.config",
                       "service.http.body", "state_store", "tensor_io"},
    "service.framed": {"service.core", "service.shm", "service.wire", "service.errors"},
    "service.http": {"service.core", "service.shm", "service.wire", "service.errors", "service.config",
                     "service.kserve", "service.framed", "state_store", "tensor_io", "kernels", "service.version"},
    "service.ray_serve": {"service.core", "service.http", "service.wire", "service.errors", "service.config",
                          "state_store", "tensor_io", "service.logs", "service.version"},
    "service.cli": {"service.config", "service.http", "service.kserve", "service.framed", "service.errors",
                    "service.core", "service.logs", "service.version", "state_store"},
    "service.client": {"kda_client"},
    "service": set(),
    "kda_client": {"service.wire", "service.core.inputs", "service.errors", "tensor_io"},
}
FRAMEWORKS_BANNED = {"kda_client": {"fastapi", "starlette", "uvicorn", "triton"},
                     "service.core": {"fastapi", "starlette", "uvicorn"},
                     "service.framed": {"fastapi", "starlette", "uvicorn"},
                     "service.wire": {"fastapi", "starlette", "uvicorn", "triton"},
                     "state_store": {"fastapi", "starlette", "uvicorn", "triton"},
                     "kernels": {"fastapi", "starlette", "uvicorn"}}


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "service" or len(parts) == 1:
        return parts[0]
    return f"service.{parts[1]}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def _allows(room: str, target: str) -> bool:
    target_room = _room(target)
    if target_room == room:
        return True
    return any(target == rule or target.startswith(rule + ".") or target_room == rule
               for rule in ALLOWED[room])


SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_room_has_a_rule() -> None:
    rooms = {_room(_module_name(p)) for p in SOURCES}
    assert rooms <= set(ALLOWED), f"rooms without a rule in ALLOWED: {sorted(rooms - set(ALLOWED))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_stay_inside_the_layer_rules(path: Path) -> None:
    room = _room(_module_name(path))
    ours = [(line, t) for line, t in _imports(path) if t.split(".")[0] in PACKAGES]
    # "from service.core import inputs" names a module: judge the deepest module it names
    wrong = sorted({(line, t) for line, t in ours if not _allows(room, t)
                    and not any(_allows(room, other) and other.startswith(t + ".") for _, other in ours)})
    banned = sorted({(line, t) for line, t in _imports(path)
                     if t.split(".")[0] in FRAMEWORKS_BANNED.get(room, set())})
    assert not wrong, f"{room} may not import: {wrong}"
    assert not banned, f"{room} may not import frameworks: {banned}"

"""Request data is decoded only as JSON or safetensors: no module of ``service/`` or
``state_store/`` can unpickle, ``torch.load``, ``eval`` or otherwise execute what a client
sends (the class of bug behind vLLM's CVE-2025-62164). Checked on the syntax tree of every
source file, so docstrings that name the forbidden calls do not count and aliases do."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "state_store")
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                     "jsonpickle", "copyreg"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
# (module, attribute): calls that deserialize objects or code, wherever the module is imported as.
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("torch.jit", "load"), ("torch.serialization", "load"),
                        ("numpy", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
                        ("pandas", "read_pickle"), ("importlib", "import_module")}


def sources() -> list[Path]:
    files = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    assert len(files) > 20, files
    return files


def violations(path: Path) -> list[str]:
    """What in ``path`` could turn request bytes into code or objects."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> the module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                aliases[local] = alias.name if alias.asname else local
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if (node.module, alias.name) in FORBIDDEN_ATTRIBUTES:
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS and func.id not in aliases:
                found.append(f"line {node.lineno}: {func.id}(...)")
            elif isinstance(func, ast.Attribute):
                owner = _dotted(func.value, aliases)
                if owner is not None and (owner, func.attr) in FORBIDDEN_ATTRIBUTES:
                    found.append(f"line {node.lineno}: {owner}.{func.attr}(...)")
    return sorted(found, key=lambda v: int(v.split()[1].rstrip(":")))


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``np.load``'s owner ``np`` -> ``numpy``; ``torch.jit`` -> ``torch.jit``."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, aliases)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unpickling_torch_load_or_eval(path):
    assert violations(path) == []


def test_the_check_sees_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle as p\nimport torch as t\nimport numpy as np\nfrom torch import load\n"
                   "t.load(b)\nnp.load(b, allow_pickle=True)\neval('1')\nt.jit.load(b)\n"
                   '"""torch.load and pickle in a docstring are fine"""\n')
    assert [v.split(":")[0] for v in violations(bad)] == [
        "line 1", "line 4", "line 5", "line 6", "line 7", "line 8"]

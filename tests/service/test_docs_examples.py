"""What the docs state, checked against the tree, the settings and a live server, with each
claim read from the doc's own text (so a test fails when a doc drifts from the code):

- every repository path README.md and docs/*.md name exists;
- docs/ARCHITECTURE.md's rooms: every package has a row, and the rows that list their
  room's modules (`service/core/`, `service/http/`, `service/shm/`, `service/framed/`, the
  top of `service/`) list every one;
- every default a doc gives a flag (``--flag (N)``, ``--flag`` (default N)) is `Settings`';
- docs/PREFIX_CACHE.md's size of one entry of the default pool and its form of KServe's
  ``checkpoints`` parameter, on a server with the default pool;
- docs/RELIABILITY.md's exit status for a snapshot refused at start.

(README's ``<!-- run -->`` blocks run in tests/operations/test_readme.py, its flag names in
tests/operations/test_cli_review.py.) Servers listen on a free port of 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch
from server_harness import ROOT, free_port, server_python_path, start_server

from service.config import INLINE_LAUNCH_TOKENS_CPU, Settings

DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README, ARCHITECTURE = DOCS["README.md"], DOCS["docs/ARCHITECTURE.md"]
PREFIX_CACHE, RELIABILITY = DOCS["docs/PREFIX_CACHE.md"], DOCS["docs/RELIABILITY.md"]
ROOTS = ("service", "kernels", "state_store", "tensor_io", "kda_client", "tests", "bench", "scripts", "docs")
DEFAULTS = {f"--{name.replace('_', '-')}": value for name, value in vars(Settings()).items()}


def test_every_path_the_docs_name_exists() -> None:
    missing = [(doc, path) for doc, text in DOCS.items()
               for path in sorted(set(re.findall(rf"\b((?:{'|'.join(ROOTS)})/[\w./-]*\w)", text)))
               if not (ROOT / path).exists() and not (ROOT / f"{path}.py").exists()]
    assert missing == []


def _rooms() -> dict[str, str]:
    """ARCHITECTURE.md's rooms table: each room (`service/http/`, "top of `service/`") -> its job."""
    rows = re.findall(r"^\| (`[\w/]+/`|top of `service/`) \| (.*?) \|", ARCHITECTURE, re.MULTILINE)
    return {room[1:-1] if room.startswith("`") else room: job for room, job in rows}


def _modules(folder: Path) -> set[str]:
    return {p.stem if p.is_file() else p.name + "/" for p in folder.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}


def test_the_architecture_page_has_a_room_for_every_package() -> None:
    rooms = _rooms()
    packages = {f"{top}/" for top in ("kernels", "state_store", "tensor_io", "kda_client")}
    packages |= {f"service/{sub}" for sub in _modules(ROOT / "service") if sub.endswith("/")}
    assert packages - rooms.keys() == set()


@pytest.mark.parametrize("room", ["service/core/", "service/http/", "service/shm/", "service/framed/",
                                  "top of `service/`"])
def test_the_architecture_page_names_every_module_of_a_listed_room(room: str) -> None:
    job = _rooms()[room]
    folder = ROOT / ("service" if room.startswith("top of") else room)
    named = set(re.findall(r"`(\w+)\.py`", job)) | set(re.findall(r"`(\w+/)`", job))
    unnamed = {m for m in _modules(folder) if not m.endswith("/") or not room.startswith("top of")} - named
    if room.startswith("top of"):
        unnamed -= {"client"}  # `service.client` is named in the kda_client row: it re-exports the client
    assert unnamed == set(), f"{room}: modules docs/ARCHITECTURE.md does not name"


def _documented_defaults() -> list[tuple[str, str, str]]:
    """(doc, flag, default as written) for ``--flag (N...)``, ``--flag` (default N...)`` and
    ``--flag N` (`KDA_FLAG`, default N...)``."""
    found = []
    for doc, text in DOCS.items():
        for flag, value in re.findall(r"(--[a-z][a-z0-9-]+)(?: [A-Z])?`?\s\((?:`KDA_\w+`, )?(?:default \**)?([\d.]+|\w+(?=[|:]))", text):
            if flag in DEFAULTS:
                found.append((doc, flag, value))
    return found


def test_the_defaults_the_docs_give_are_the_settings_defaults() -> None:
    found = _documented_defaults()
    assert {("docs/RELIABILITY.md", "--max-shm-mb"), ("docs/PREFIX_CACHE.md", "--prefix-cache-mb"),
            ("README.md", "--log-format")} <= {(doc, f) for doc, f, _ in found}
    wrong = []
    for doc, flag, value in found:
        default = DEFAULTS[flag]
        if flag == "--inline-launch-tokens":
            default = INLINE_LAUNCH_TOKENS_CPU  # "(256 on the CPU, 16384 on a GPU)"
        if default is None or isinstance(default, bool):
            continue
        same = float(value) == default if isinstance(default, (int, float)) else value == default
        if not same:
            wrong.append((doc, flag, value, default))
    assert wrong == []


def _kda_serve(args: list[str], log: Path) -> subprocess.Popen:
    """kda-serve started with ``args`` on a free port of 127.0.0.1 (not waited for)."""
    out = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(free_port()),
                                 "--log-level", "warning", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": server_python_path()})
    finally:
        out.close()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """kda-serve with no pool flags (the Quickstart's pool), its URL."""
    server = start_server([], tmp_path_factory.mktemp("docs") / "kda-serve.log")
    yield server.url
    assert server.stop() == 0, server.log_text()


def _tokens(url: str, T: int) -> dict[str, torch.Tensor]:
    info = httpx.get(f"{url}/info").json()
    HV, K, V = info["num_heads"], info["head_k_dim"], info["head_v_dim"]
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(T, HV, K, generator=gen), "k": torch.randn(T, HV, K, generator=gen) / K ** 0.5,
            "v": torch.randn(T, HV, V, generator=gen), "g": -torch.rand(T, HV, K, generator=gen),
            "beta": torch.rand(T, HV, generator=gen)}


def test_one_entry_of_the_default_pool_is_the_size_documented(default_server: str) -> None:
    from kda_client import KDAClient

    kib = int(re.search(r"the default 2-layer pool: (\d+) KiB", PREFIX_CACHE).group(1))
    with KDAClient(default_server) as kda:
        slot = kda.alloc(1)[0]
        try:
            entry = kda.publish(slot, "docs-entry-size")
            assert entry["layers"] == 2 and entry["bytes"] == kib * 1024, entry
        finally:
            kda.free(slot)
            kda.drop_prefix("docs-entry-size")


def test_kserve_checkpoints_in_the_documented_form_are_stored(default_server: str) -> None:
    """PREFIX_CACHE.md's KServe bullet: ``checkpoints``, a JSON string of the form it shows."""
    bullet = PREFIX_CACHE[PREFIX_CACHE.index("- KServe v2"):]
    form = re.search(r"`checkpoints`, a JSON\s+string `(\[.*?\])`", bullet, re.DOTALL).group(1)
    checkpoints = json.loads(form.replace(", ...", "").replace('"..."', '"docs-kserve"').replace(": n", ": 64"))
    tensors = _tokens(default_server, 64)
    for layer in (0, 1):
        inputs = [{"name": name, "shape": list(t.shape), "datatype": "FP32", "data": t.flatten().tolist()}
                  for name, t in tensors.items()]
        params = {"layer": layer, "sequence_id": 4242, "sequence_start": layer == 0, "sequence_end": layer == 1,
                  "checkpoints": json.dumps(checkpoints)}
        response = httpx.post(f"{default_server}/v2/models/kda/infer", json={"inputs": inputs, "parameters": params})
        assert response.status_code == 200, response.text
    entry = httpx.get(f"{default_server}/prefix/docs-kserve").json()
    assert (entry["tokens"], entry["complete"]) == (64, True), entry
    assert httpx.delete(f"{default_server}/prefix/docs-kserve").status_code == 204


def test_a_snapshot_refused_at_start_exits_as_documented(tmp_path: Path) -> None:
    row = next(line for line in RELIABILITY.splitlines() if line.startswith("| the snapshot at start"))
    status = int(re.search(r"exit status (\d+)", row).group(1))
    snapshot = tmp_path / "pool.snapshot"
    snapshot.write_bytes(b"not a snapshot\n")
    process = _kda_serve(["--snapshot-path", str(snapshot)], tmp_path / "log")
    assert process.wait(60) == status, (tmp_path / "log").read_text()
    assert snapshot.read_bytes() == b"not a snapshot\n"  # "overwrites nothing"

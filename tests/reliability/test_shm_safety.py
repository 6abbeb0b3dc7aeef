"""Shared memory never faults the server: a region whose object the client truncates is
refused with a 400 (over ``POST /prefill`` and ``/v2``), never a SIGBUS; registration opens
no symbolic link and nothing but a regular file; the number of regions and their bytes are
capped (``--max-shm-regions``, ``--max-shm-mb``); a mapping the kernel refuses is a 400.

The unit cases that read a truncated object directly run in a child process, so that a
fault kills the child (and fails the test), not pytest.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import httpx
import pytest
import torch
from reliability_helpers import GEOMETRY_ARGS, HV, K, ROOT, V, WholePool, assert_problem, make_sequence, start_server

MAX_REGIONS = 6
MAX_MB = 16
SHM_JSON = "application/vnd.kda.shm+json"


class ShmObject:
    """A POSIX shared memory object of ``size`` bytes made as a client would, with the
    test's own fd to write it through."""

    def __init__(self, size: int) -> None:
        self.name = f"kda-safety-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = f"/dev/shm/{self.name}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)
        self.size = size

    def put(self, offset: int, t: torch.Tensor) -> dict[str, Any]:
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        os.pwrite(self.fd, data, offset)
        return {"region": self.name, "offset": offset, "byte_size": len(data)}

    def registration(self, byte_size: int | None = None) -> dict[str, Any]:
        return {"name": self.name, "key": "/" + self.name, "byte_size": self.size if byte_size is None else byte_size}

    def close(self) -> None:
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server([*GEOMETRY_ARGS, "--max-shm-regions", str(MAX_REGIONS), "--max-shm-mb", str(MAX_MB)],
                       tmp_path_factory.mktemp("shm-safety") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture
def pool(server: Any) -> Iterator[WholePool]:
    whole = WholePool(server.url)
    yield whole
    whole.close()


@pytest.fixture
def obj() -> Iterator[ShmObject]:
    o = ShmObject(1 << 20)
    yield o
    o.close()


def _rest_request(o: ShmObject, slot: str, T: int, gen: torch.Generator) -> dict[str, Any]:
    doc: dict[str, Any] = {"layer": 0, "sequences": [{"slot": slot, "length": T}]}
    offset = 0
    for name, t in zip(("q", "k", "v", "g", "beta"), make_sequence(T, gen)):
        ref = o.put(offset, t)
        doc[name] = {"dtype": "float32", "shape": list(t.shape), "shm": ref}
        offset += -(-ref["byte_size"] // 64) * 64
    doc["outputs"] = {"o": {"region": o.name, "offset": offset, "byte_size": T * HV * V * 4},
                      "final_state": {"region": o.name, "offset": offset + (64 << 10), "byte_size": HV * V * K * 4}}
    return doc


def _v2_request(o: ShmObject, slot: str, T: int, gen: torch.Generator) -> dict[str, Any]:
    inputs, offset = [], 0
    for name, t in zip(("q", "k", "v", "g", "beta"), make_sequence(T, gen)):
        ref = o.put(offset, t)
        inputs.append({"name": name, "datatype": "FP32", "shape": list(t.shape), "parameters": {
            "shared_memory_region": o.name, "shared_memory_offset": offset, "shared_memory_byte_size": ref["byte_size"]}})
        offset += -(-ref["byte_size"] // 64) * 64
    return {"inputs": inputs, "parameters": {"slot": slot}, "outputs": [{"name": "o"}, {"name": "final_state"}]}


def _alive(server: Any) -> None:
    assert server.process.poll() is None, server.log_text()
    assert httpx.get(f"{server.url}/health/live", timeout=10).status_code == 200


@pytest.mark.parametrize("front", ["rest", "v2"])
def test_truncated_object_is_a_400_not_a_crash(server: Any, pool: WholePool, obj: ShmObject,
                                               gen: torch.Generator, front: str) -> None:
    """Register, then truncate the object to 0 (as ``truncate -s 0``), then prefill from it:
    a 400 in the front end's own error form, the server alive and the pool unchanged."""
    slot = pool.http.post("/slots").json()["slots"][0]
    pool.add(slot)
    try:
        doc = _rest_request(obj, slot, 9, gen) if front == "rest" else _v2_request(obj, slot, 9, gen)
        register = "/shm/regions" if front == "rest" else f"/v2/systemsharedmemory/region/{obj.name}/register"
        body = obj.registration() if front == "rest" else {"key": "/" + obj.name, "offset": 0, "byte_size": obj.size}
        assert pool.http.post(register, json=body).status_code in (200, 201)
        before = pool.image()
        os.truncate(obj.path, 0)
        if front == "rest":
            r = pool.http.post("/prefill", content=json.dumps(doc), headers={"content-type": SHM_JSON})
            problem = assert_problem(r, 400)
            assert "shrank" in problem["detail"] or "holds" in problem["detail"], problem
        else:
            r = pool.http.post("/v2/models/kda/infer", json=doc)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
            assert "holds" in r.json()["error"] or "shrank" in r.json()["error"], r.text
        _alive(server)
        assert pool.image() == before
    finally:
        pool.http.delete(f"/shm/regions/{obj.name}")
        pool.http.delete(f"/slots/{slot}")
        pool.discard(slot)


def _child(script: str, *args: str) -> list[str]:
    """Run ``script`` with ``args`` in a child process (a fault kills the child, not pytest)
    that must exit 0; the words it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout[-1000:], done.stderr[-3000:])
    return done.stdout.split()


_DIRECT = textwrap.dedent("""
    import os, sys, torch
    from service.errors import InvalidRequest
    from service.shm.registry import ShmRegistry
    from service.shm.tensors import ShmInput, ShmRef, copy_out
    from service.wire.buffers import WarmBuffers
    name = sys.argv[1]
    registry = ShmRegistry()
    region = registry.register_system("r", "/" + name, 0, 1 << 20)
    os.truncate("/dev/shm/" + name, 4096)
    outcomes = []
    for what, call in [
        ("read_into", lambda: region.read_into(8192, memoryview(bytearray(4096)))),
        ("copy_out", lambda: copy_out({"q": ShmInput(ShmRef(region="r", offset=8192, byte_size=4096),
                                                     torch.float32, [1024])},
                                      {"r": region}, WarmBuffers(), torch.device("cpu"), ())),
        ("check", lambda: region.check(0, 4096, "x")),
    ]:
        try:
            call()
            outcomes.append(what + ":no error")
        except InvalidRequest as e:
            outcomes.append(what + ":400")
    region.write(65536, torch.ones(1024))  # outputs after a launch: never a fault
    outcomes.append("write:%d" % os.stat("/dev/shm/" + name).st_size)
    registry.close()
    print(" ".join(outcomes))
""")


def test_reads_of_a_truncated_object_raise_in_the_process(obj: ShmObject) -> None:
    """Past the bounds checks (a truncation racing the copy): each read raises a 400 error
    and a write extends the object, in a child process that must not die of SIGBUS."""
    outcomes = _child(_DIRECT, obj.name)
    assert outcomes == ["read_into:400", "copy_out:400", "check:400", f"write:{65536 + 4096}"], outcomes


def test_symlink_and_non_regular_objects_are_refused(server: Any, tmp_path: Any) -> None:
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"\0" * 4096)
    link = f"/dev/shm/kda-safety-link-{secrets.token_hex(4)}"
    folder = f"/dev/shm/kda-safety-dir-{secrets.token_hex(4)}"
    fifo = f"/dev/shm/kda-safety-fifo-{secrets.token_hex(4)}"
    os.symlink(target, link)
    os.mkdir(folder)
    os.mkfifo(fifo)
    try:
        for path, why in ((link, "symbolic link"), (folder, "regular file"), (fifo, "regular file")):
            key = "/" + os.path.basename(path)
            r = httpx.post(f"{server.url}/shm/regions", json={"name": "x", "key": key, "byte_size": 16}, timeout=10)
            assert why in assert_problem(r, 400)["detail"], (path, r.text)
            v2 = httpx.post(f"{server.url}/v2/systemsharedmemory/region/x/register",
                            json={"key": key, "offset": 0, "byte_size": 16}, timeout=10)
            assert v2.status_code == 400 and why in v2.json()["error"], v2.text
        assert target.read_bytes() == b"\0" * 4096
        assert httpx.get(f"{server.url}/shm/regions").json() == []
    finally:
        os.unlink(link)
        os.rmdir(folder)
        os.unlink(fifo)


def test_region_count_and_bytes_are_capped(server: Any) -> None:
    """``--max-shm-regions`` regions at most, ``--max-shm-mb`` bytes at most (a sparse
    128 TiB object included): the next registration is a 400 naming the flag; unregistering
    makes room again."""
    objects = [ShmObject(4096) for _ in range(MAX_REGIONS + 1)]
    sparse = ShmObject(128 << 40)
    big = ShmObject((MAX_MB << 20) + 4096)
    url = f"{server.url}/shm/regions"
    try:
        for o in objects[:MAX_REGIONS]:
            assert httpx.post(url, json=o.registration()).status_code == 201
        r = httpx.post(url, json=objects[-1].registration())
        assert "--max-shm-regions" in assert_problem(r, 400)["detail"]
        assert httpx.delete(f"{url}/{objects[0].name}").status_code == 204
        for o in (sparse, big):
            r = httpx.post(url, json=o.registration())
            assert "--max-shm-mb" in assert_problem(r, 400)["detail"], r.text
        assert httpx.post(url, json=objects[-1].registration()).status_code == 201
        assert len(httpx.get(url).json()) == MAX_REGIONS
    finally:
        for o in objects:
            httpx.delete(f"{url}/{o.name}")
        for o in (*objects, sparse, big):
            o.close()
    _alive(server)


def test_a_mapping_the_kernel_refuses_is_a_400() -> None:
    """With the byte cap out of the way, a sparse 128 TiB object (more than the address
    space: mmap's ENOMEM) is an InvalidRequest, not an OSError (a 500)."""
    from service.errors import InvalidRequest
    from service.shm.registry import ShmRegistry

    sparse = ShmObject(128 << 40)
    registry = ShmRegistry(max_bytes=1 << 62)
    try:
        with pytest.raises(InvalidRequest, match="cannot be mapped"):
            registry.register_system("huge", "/" + sparse.name, 0, sparse.size)
        assert registry.status("system") == []
    finally:
        registry.close()
        sparse.close()


_GPU_PRELUDE = textwrap.dedent("""
    import os, sys, torch

    def reread(region):
        back = torch.empty(4096, dtype=torch.uint8, device="cuda")
        region.read_into_tensor(65536, back)
        torch.cuda.synchronize()
        same = torch.equal(back.view(torch.float32).cpu(), torch.arange(1024, dtype=torch.float32))
        return "reread:ok" if same else "reread:stale"
""")  # begins the GPU scripts: ``reread``, what a write of arange(1024) at 65536 reads back as

_DIRECT_GPU = _GPU_PRELUDE + textwrap.dedent("""
    from service.errors import InvalidRequest
    from service.shm.registry import ShmRegistry
    registry = ShmRegistry()
    outcomes = []
    for name, pin_first in zip(sys.argv[1:], (False, True)):
        region = registry.register_system(name, "/" + name, 0, 1 << 20)
        dest = torch.empty(4096, dtype=torch.uint8, device="cuda")
        if pin_first:
            region.read_into_tensor(8192, dest)  # page-locks the mapping
        os.truncate("/dev/shm/" + name, 4096)
        try:
            region.read_into_tensor(8192, dest)
            torch.cuda.synchronize()
            outcomes.append("read:ok")  # pinned pages outlive the truncation: stale bytes, no fault
        except InvalidRequest:
            outcomes.append("read:400")  # never pinned: read through the file, a short read
        region.write(65536, torch.arange(1024, dtype=torch.float32, device="cuda"))
        outcomes.append("write:ok")
        outcomes.append(reread(region))  # through the file, or pinned afresh
    registry.close()
    print(" ".join(outcomes))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_copies_of_a_truncated_object_never_fault() -> None:
    """The GPU paths: a truncated object is never read by the CPU nor by DMA through a
    mapping pinned before the truncation (the copy goes through the file: a 400); writes
    from the device never fault and read back as written."""
    objects = [ShmObject(1 << 20), ShmObject(1 << 20)]
    try:
        outcomes = _child(_DIRECT_GPU, *(o.name for o in objects))
        # each region truncated before the read (never pinned, or pinned before): the read is
        # refused, the write grows the object back through the file, and reading it back
        # gives what was written (no stale pinned pages)
        assert outcomes == ["read:400", "write:ok", "reread:ok"] * 2, outcomes
    finally:
        for o in objects:
            o.close()


_HELD_GPU = _GPU_PRELUDE + textwrap.dedent("""
    from service.errors import InvalidRequest
    from service.shm.registry import ShmRegistry
    registry = ShmRegistry()
    name = sys.argv[1]
    region = registry.register_system(name, "/" + name, 0, 1 << 20)
    device = torch.device("cuda", 0)
    dest = torch.empty(4096, dtype=torch.uint8, device=device)
    say = lambda word: print(word, flush=True)  # each step as it passes: a fault shows where
    with region.graph_hold():
        held = region.device_bytes(8192, 4096, device)  # a prepared prefill's graph copies from these
        say("held:pinned" if held is not None and held.is_pinned() else "held:none")
        os.truncate("/dev/shm/" + name, 4096)
        try:
            region.read_into_tensor(8192, dest)
            say("read:ok")
        except InvalidRequest:
            say("read:400")
        say("device_bytes:none" if region.device_bytes(8192, 4096, device) is None else "device_bytes:some")
        say("still:pinned" if held.is_pinned() else "still:unpinned")  # registered until the hold ends
        region.write(65536, torch.arange(1024, dtype=torch.float32, device=device))  # through the file: grows it
        say("write:ok")
    say("after:pinned" if held.is_pinned() else "after:unpinned")
    say(reread(region))  # the file's bytes, not the stale pages
    registry.close()
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_hold_keeps_pinned_pages_through_a_truncation() -> None:
    """A prepared prefill's hold (`Region.graph_hold`) through a truncation: the pages pinned
    before it stay registered while held (unregistering them under a graph that copies from
    them would break its replays) and nothing else uses them (reads go through the file: a
    400; no new `device_bytes`); once the hold ends they are unregistered and what was
    written through the file reads back, not the stale pages. (The prepared prefill itself
    checks the object's size before each run: tests/transport/test_transport_prepared.py.)"""
    obj = ShmObject(1 << 20)
    try:
        outcomes = _child(_HELD_GPU, obj.name)
        assert outcomes == ["held:pinned", "read:400", "device_bytes:none", "still:pinned", "write:ok", "after:unpinned",
                            "reread:ok"], outcomes
    finally:
        obj.close()

"""The client side of the shared memory transports (``KDAClient(url, transport="shm")``,
and ``transport="cuda"``: `CudaArena`).

`ShmArena` owns one POSIX shared memory region per client: it is created under
``/dev/shm``, mapped here as a torch uint8 tensor, registered with the server (``POST
/shm/regions``, with a lease of ``ttl_s`` seconds renewed by every request), and then
its name is unlinked at once. From then on the memory lives exactly as long as the two
mappings: a client that exits or crashes leaves nothing in /dev/shm, and the server's
mapping goes when the client unregisters (`close`) or, failing that, when the lease runs
out. A request that needs more room replaces the region with a larger one.

Per prefill the inputs are copied once into the region (packed, 64-byte aligned), the
request names them, and the server writes ``o`` and ``final_state`` behind them. Results
are copies by default; with ``views=True`` they view the region (no copy) and stay valid
only until the next prefill on the same client overwrites it.
"""
from __future__ import annotations

import base64
import json
import math
import os
import secrets
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union
from urllib.parse import quote

import torch

from service.wire.tensors import JSON_DTYPES, JSON_NAMES

SHM_JSON = "application/vnd.kda.shm+json"
SHM_DIR = "/dev/shm"
ALIGN = 64
UNKNOWN_REGION = "unknown-shared-memory-region"
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Geometry:
    """What the client must know of the pool to size the outputs: HV, V, K and the state dtype."""

    num_heads: int
    head_v_dim: int
    head_k_dim: int
    state_dtype: torch.dtype

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> "Geometry":
        return cls(info["num_heads"], info["head_v_dim"], info["head_k_dim"], JSON_DTYPES[info["state_dtype"]])


@dataclass(frozen=True)
class Placed:
    """A tensor's place in the region."""

    offset: int
    dtype: torch.dtype
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return _aligned(math.prod(self.shape) * self.dtype.itemsize)

    def ref(self, region: str, base: int, nbytes: int) -> dict[str, Any]:
        return {"region": region, "offset": base + self.offset, "byte_size": nbytes}


@dataclass(frozen=True)
class Registration:
    """How to register a created region: POST ``body`` (JSON) to ``path``."""

    path: str
    body: dict[str, Any]


@dataclass
class _Mapped:
    """A created region: its registry name, the memory, where the memory starts in what the
    server maps (CUDA: in torch's allocator block; else 0), and its registration."""

    name: str
    memory: torch.Tensor
    base: int
    registration: Registration

    @property
    def size(self) -> int:
        return self.memory.numel()


class _Arena:
    """One client's region and the requests that use it: the layout, the copy in and the
    reading of results, shared by `ShmArena` (POSIX) and `CudaArena` (GPU memory).

    The methods build what to send; the client sends it (`KDAClient` and
    `AsyncKDAClient` drive the same arena). ``ttl_s``: the lease the server keeps the
    region mapped for without a request; ``views``: results view the region."""

    def __init__(self, ttl_s: float, views: bool) -> None:
        self.ttl_s = ttl_s
        self.views = views
        self.geometry: Optional[Geometry] = None
        self._region: Optional[_Mapped] = None
        self._pending: Optional[_Mapped] = None

    def fits(self, nbytes: int) -> bool:
        return self._region is not None and self._region.size >= nbytes

    def forget(self) -> None:
        """The server no longer knows the region (restarted, or its lease ran out): the
        next request registers a new one."""
        self._region = None

    def registered(self) -> Optional[str]:
        """The pending region is registered: make it current. Returns the name of the
        region it replaces, to unregister, or None."""
        pending, self._pending = self._pending, None
        assert pending is not None, "registered() without create()"
        old, self._region = self._region, pending
        return None if old is None else old.name

    def abandon(self) -> None:
        """Registration failed: drop the pending region."""
        self._pending = None

    def close(self) -> Optional[str]:
        """Drop the region (its memory goes when no view of it is left); its name, to unregister."""
        self.abandon()
        old, self._region = self._region, None
        return None if old is None else old.name

    # -- requests ------------------------------------------------------------------------

    def layout(self, tensors: dict[str, Sequence[torch.Tensor]], lengths: Sequence[int],
               return_final_state: bool) -> tuple[dict[str, Placed], int]:
        """Where each input (the parts of one packed tensor, in order) and output goes, and
        the bytes needed."""
        assert self.geometry is not None, "layout() before the geometry is known"
        g = self.geometry
        places, offset = {}, 0
        for name, parts in tensors.items():  # one part (A_log, dt_bias: any shape, the server checks it) as it is
            shape = list(parts[0].shape) if len(parts) == 1 else [sum(int(p.shape[0]) for p in parts),
                                                                  *parts[0].shape[1:]]
            places[name] = Placed(offset, parts[0].dtype, shape)
            offset += places[name].nbytes
        T = sum(lengths)
        places["o"] = Placed(offset, tensors["v"][0].dtype, [T, g.num_heads, g.head_v_dim])
        offset += places["o"].nbytes
        if return_final_state:
            places["final_state"] = Placed(offset, g.state_dtype, [len(lengths), g.num_heads, g.head_v_dim,
                                                                    g.head_k_dim])
            offset += places["final_state"].nbytes
        return places, offset

    def fill(self, tensors: dict[str, Sequence[torch.Tensor]], places: dict[str, Placed],
             options: dict[str, Any]) -> bytes:
        """Copy the inputs into the region (one copy each, from the host or any device); the
        request body naming them."""
        assert self._region is not None, "fill() without a region"
        name = self._region.name
        doc = dict(options)
        for key, parts in tensors.items():
            place = places[key]
            size = self._copy_in(place, parts)
            doc[key] = {"dtype": JSON_NAMES[place.dtype], "shape": place.shape,
                        "shm": place.ref(name, self._region.base, size)}
        self._written()
        outputs = {key: places[key].ref(name, self._region.base, places[key].nbytes)
                   for key in ("o", "final_state") if key in places}
        doc["outputs"] = outputs
        return json.dumps(doc, separators=(",", ":")).encode("ascii")

    def put(self, tensors: dict[str, torch.Tensor], places: dict[str, Placed]) -> None:
        """Copy each tensor of ``tensors`` (from the host or any device) to its place, as
        laid out before (a prepared prefill's next inputs); readable by the server on return."""
        for key, t in tensors.items():
            place = places[key]
            if list(t.shape) != place.shape or t.dtype != place.dtype:
                raise ValueError(f"{key} must be {JSON_NAMES[place.dtype]}{place.shape} as prepared, got "
                                 f"{JSON_NAMES.get(t.dtype, t.dtype)}{list(t.shape)}")
            self._copy_in(place, [t])
        self._written()

    def read(self, place: Placed) -> torch.Tensor:
        """The tensor at ``place`` (a copy unless ``views``)."""
        assert self._region is not None
        t = self._region.memory[place.offset:place.offset + place.nbytes]
        t = t[:math.prod(place.shape) * place.dtype.itemsize].view(place.dtype).view(place.shape)
        return t if self.views else t.clone()

    def _copy_in(self, place: Placed, parts: Sequence[torch.Tensor]) -> int:
        """``parts`` copied one after the other from ``place``'s offset; their bytes."""
        assert self._region is not None
        memory, offset = self._region.memory, place.offset
        for part in parts:
            n = part.numel() * place.dtype.itemsize
            if n:
                memory[offset:offset + n].view(place.dtype).view(part.shape).copy_(part)
            offset += n
        return offset - place.offset

    def _written(self) -> None:
        """The inputs' bytes are in the region, readable by the server (nothing to wait
        for in host memory)."""

    def result(self, doc: dict[str, Any], key: str) -> Optional[torch.Tensor]:
        """Output ``key`` of a response document, read from the region (a copy unless
        ``views``). ValueError (KeyError, TypeError) for a reference that is not one to
        ``key``'s bytes in this client's region."""
        spec = doc.get(key)
        if spec is None:
            return None
        assert self._region is not None
        ref, dtype, shape = spec["shm"], JSON_DTYPES[spec["dtype"]], spec["shape"]
        if ref["region"] != self._region.name:
            raise ValueError(f"the server wrote {key} into region {ref['region']!r}, not this client's")
        start, size = ref["offset"] - self._region.base, ref["byte_size"]
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise ValueError(f"{key}: shape {shape!r:.80} is not a list of sizes")
        if type(size) is not int or size != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{key}: shape {shape} of {spec['dtype']} needs {math.prod(shape) * dtype.itemsize} "
                             f"bytes, byte_size is {size!r:.40}")
        if type(start) is not int or not 0 <= start <= self._region.size - size:
            raise ValueError(f"{key}: byte_size {size} at offset {ref['offset']!r:.40} is outside the region")
        t = self._region.memory[start:start + size].view(dtype).view(shape)
        return t if self.views else t.clone()


class ShmArena(_Arena):
    """A POSIX shared memory region: created under /dev/shm, mapped here, registered with
    ``POST /shm/regions`` and unlinked at once (see the module docstring)."""

    def create(self, nbytes: int) -> Registration:
        """Create and map a region of at least ``nbytes`` (1.25x headroom); its
        registration, to send before `registered`."""
        size = _region_size(nbytes)
        name = f"kda-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._pending = _Mapped(name, memory, 0, Registration(
            "/shm/regions", {"name": name, "key": "/" + name, "byte_size": size, "ttl_s": self.ttl_s}))
        return self._pending.registration

    @staticmethod
    def unregistration(name: str) -> tuple[str, str]:
        """(method, path) that unregisters region ``name``."""
        return "DELETE", f"/shm/regions/{quote(name, safe='')}"

    def registered(self) -> Optional[str]:
        """As `_Arena.registered`, and the region's name is unlinked (the two mappings keep
        the memory)."""
        assert self._pending is not None, "registered() without create()"
        os.unlink(os.path.join(SHM_DIR, self._pending.name))
        return super().registered()

    def abandon(self) -> None:
        """Registration failed: drop the pending region (unlinked, unmapped when unreferenced)."""
        if self._pending is not None:
            os.unlink(os.path.join(SHM_DIR, self._pending.name))
        super().abandon()


class CudaArena(_Arena):
    """A region of this process's GPU memory (``KDAClient(url, transport="cuda")``),
    shared through a CUDA IPC handle and registered with the KServe v2 CUDA shared memory
    extension (``POST /v2/cudasharedmemory/region/{name}/register``, with this server's
    ``ttl_s`` lease). Inputs may be host or device tensors; the server copies them out
    device to device, and writes o and final_state into the region from its own GPU, so
    results arrive as tensors on this GPU.

    The memory is a torch allocation on the current CUDA device; its IPC handle is torch's
    own (the one torch.multiprocessing sends), so the server maps the allocator's whole
    block and offsets count from the block's start. The server must see the same GPU under
    the same device id. torch keeps a shared block until process exit, so a region replaced
    by a larger one stays allocated (size the first request large); one the server forgot
    (its lease ran out, or it restarted) or refused is registered again as it is.
    Not with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torch then shares
    another kind of handle)."""

    def __init__(self, ttl_s: float, views: bool) -> None:
        super().__init__(ttl_s, views)
        self._lost: Optional[_Mapped] = None  # memory the server forgot or refused, still ours

    def create(self, nbytes: int) -> Registration:
        """A region of at least ``nbytes`` on the GPU: the one the server forgot when it is
        large enough (a new allocation would leak the old: torch keeps shared blocks until
        exit), else a new one (1.25x headroom); its registration, to send before `registered`."""
        lost, self._lost = self._lost, None
        if lost is not None and lost.size >= nbytes:
            self._pending = lost
            return lost.registration
        device = torch.device("cuda", torch.cuda.current_device())
        size = _region_size(nbytes)
        memory = torch.empty(size, dtype=torch.uint8, device=device)
        handle, base = cuda_ipc_handle(memory)
        name = f"kda-cuda-{os.getpid()}-{secrets.token_hex(6)}"
        self._pending = _Mapped(name, memory, base, Registration(
            f"/v2/cudasharedmemory/region/{quote(name, safe='')}/register",
            {"raw_handle": {"b64": base64.b64encode(handle).decode("ascii")}, "device_id": device.index,
             "byte_size": base + size, "ttl_s": self.ttl_s}))
        return self._pending.registration

    def forget(self) -> None:
        """As `_Arena.forget`, keeping the memory to register again."""
        self._lost = self._region or self._lost
        super().forget()

    def abandon(self) -> None:
        """Registration failed: keep the pending memory for the next attempt."""
        self._lost = self._pending or self._lost
        super().abandon()

    @staticmethod
    def unregistration(name: str) -> tuple[str, str]:
        """(method, path) that unregisters region ``name``."""
        return "POST", f"/v2/cudasharedmemory/region/{quote(name, safe='')}/unregister"

    def close(self) -> Optional[str]:
        name = super().close()
        self._lost = None
        return name

    def _written(self) -> None:
        """The copies in are asynchronous: the server must not read before they are done."""
        assert self._region is not None
        torch.cuda.synchronize(self._region.memory.device)


def cuda_ipc_handle(memory: torch.Tensor) -> tuple[bytes, int]:
    """(the cudaIpcMemHandle_t of the allocation holding CUDA tensor ``memory``, the byte
    offset of ``memory``'s storage in it): torch's own handle, the one torch.multiprocessing
    sends, which opens the caching allocator's whole block."""
    _, shared, _, offset, *_ = memory.untyped_storage()._share_cuda_()
    return raw_ipc_handle(shared), offset


def raw_ipc_handle(shared: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t in the handle torch shares: the bytes themselves up to
    torch 2.4; from 2.5 a version byte and a type byte come first, ``c`` for cudaMalloc
    memory and ``e`` for expandable segments (a handle of another kind, not served here)."""
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) == CUDA_IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    kind = "expandable segments (unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for transport='cuda')" \
        if shared[1:2] == b"e" else f"an unknown kind ({len(shared)} bytes)"
    raise RuntimeError(f"torch shared this CUDA memory with a handle of {kind}, not a cudaIpcMemHandle_t")


def _region_size(nbytes: int) -> int:
    return max(_aligned(nbytes + nbytes // 4), 1 << 20)


def split_sequences(sequences: Sequence[Sequence[Any]], names: Sequence[str]
                    ) -> tuple[list[Optional[str]], dict[str, list[torch.Tensor]]]:
    """(slots, tensors by name) of ``(slot, q, k, v, g, beta)`` tuples."""
    slots: list[Optional[str]] = []
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for i, seq in enumerate(sequences):
        if len(seq) != len(names) + 1:
            raise ValueError(f"sequences[{i}] must be (slot, {', '.join(names)}), got {len(seq)} items")
        slots.append(seq[0])
        for name, t in zip(names, seq[1:]):
            parts[name].append(t)
    return slots, parts


Arena = Union[ShmArena, CudaArena]


def is_unknown_region(problem: dict[str, Any]) -> bool:
    """Whether an error's problem document says the region is not registered (the server
    restarted, or the lease ran out)."""
    return str(problem.get("type", "")).endswith(UNKNOWN_REGION)

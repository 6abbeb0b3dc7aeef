"""Registered shared memory regions of one app, shared by every transport that passes
tensors this way (the KServe v2 system and CUDA shared memory extensions, and ``POST
/prefill`` with `service.shm.prefill`): system (POSIX) and CUDA regions share one
namespace of region names.

A region's name holds no "/" (the per-name routes, a status or an unregister, take it as
one URL segment). A request names a region, an offset and a byte size for each tensor it
passes this way; every such reference is bounds-checked against the region here. Inputs
are copied out of a region once (on a CPU server into host memory; on a GPU server into
its GPU memory, from a system region by DMA, the mapping being page-locked on first use),
so nothing the kernels see can change or vanish under them; outputs are copied in after
the launch.

A request holds a `lease` on the regions it names from decoding to its response, so an
unregister arriving meanwhile takes the name away at once but unmaps the memory only
when the last such request is done. `close` (at shutdown) unmaps everything. The
memory itself belongs to the client: it is never unlinked or freed here.

A region may be registered with a lease (``ttl_s``): each request that uses it renews it,
and `expire` unregisters the regions idle past their lease, so a client that died without
unregistering leaves no mapping behind for long.

A system region never faults the process, whatever the client does to its object: the
object is opened without following a symbolic link and must be a regular file; its size is
checked (fstat) at every use, and the host copies in and out go through the file
(``preadv``/``pwritev``), never through the mapping, so an object truncated mid-copy makes
a short read (a 400), not a SIGBUS. The mapping serves only DMA to and from a GPU, once
page-locked (pinned pages outlive a truncation; an unpinned mapping is never touched by
the CPU). The registry holds at most ``max_regions`` regions and ``max_bytes`` bytes of
system regions (``--max-shm-regions``, ``--max-shm-mb``).

Writing the outputs comes after the launch has committed the slots' new states, so it must
not fail then: before the launch, each output's bytes are reserved (`SystemRegion.reserve`:
past the process's file size limit is a 400; pages the object does not have yet are
allocated with ``posix_fallocate``, so a full /dev/shm is a 400 before anything changed).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource
import stat
import threading
import time
from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from tensor_io.views import tensor_bytes

from ..core.staging import copy_stream, drain_copy_streams, on_stream
from .cuda_ipc import IpcMappings, IpcMemory, unavailable_reason
from ..errors import InvalidRequest

log = logging.getLogger("kda_serve.shm")
SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps POSIX shared memory objects
SYSTEM, CUDA = "system", "cuda"
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.ENODEV})
"""posix_fallocate's answers for a filesystem that cannot allocate ahead: nothing is reserved."""


class UnknownRegion(InvalidRequest):
    """A request or status call names a region that is not registered (HTTP 400, as Triton)."""

    slug = "unknown-shared-memory-region"
    title = "Unknown shared memory region"


class RegionLimit(InvalidRequest):
    """A registration past the registry's caps on regions or mapped bytes (HTTP 400)."""

    slug = "shared-memory-limit"
    title = "Shared memory limit reached"


DEFAULT_MAX_REGIONS = 256
DEFAULT_MAX_BYTES = 32 << 30


class _Region(ABC):
    """A registered region of ``byte_size`` bytes; ``users`` counts the requests leasing it;
    ``ttl_s`` (None: no lease) is how long it may stay unused before `ShmRegistry.expire`
    unregisters it, counted from ``last_used`` (time.monotonic)."""

    kind: str

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.users = 0
        self.closing = False
        self.ttl_s: Optional[float] = None
        self.last_used = time.monotonic()

    def check(self, offset: int, nbytes: int, field: str) -> None:
        """That [offset, offset + nbytes) lies inside the region."""
        if offset < 0 or offset + nbytes > self.byte_size:
            raise InvalidRequest(f"{field}: bytes [{offset}, {offset + nbytes}) fall outside shared memory region "
                                 f"{self.name!r} of {self.byte_size} bytes", field=field)

    def reserve(self, offset: int, nbytes: int, field: str) -> None:
        """Make a later `write` of ``nbytes`` bytes at ``offset`` (bounds checked by the
        caller) unable to fail for want of room, or refuse it now (InvalidRequest naming
        ``field``): called before the launch. Nothing to do here (a CUDA region's memory is
        allocated already)."""

    def lend(self, offset: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        """The ``nbytes`` bytes at ``offset`` as a uint8 tensor on ``device`` to read in place
        (bounds checked by the caller), or None: the caller copies them out. Only a CUDA
        region of a server started with ``--cuda-ipc-zero-copy`` lends its bytes."""
        return None

    def device_bytes(self, offset: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        """The ``nbytes`` bytes at ``offset`` as a uint8 tensor for copies the caller queues
        on ``device`` itself (a prepared prefill's, inside its CUDA graph; bounds checked by
        the caller), or None: copies go through `read_into_tensor` and `write`. A CUDA region
        on ``device`` has them (device memory), and a system region inside `graph_hold`
        whose mapping is page-locked (host memory the device reaches by DMA)."""
        return None

    @contextmanager
    def graph_hold(self) -> Iterator[None]:
        """Keep the bytes `device_bytes` hands out in this block valid until it ends (a
        prepared prefill's life: its graph copies from and to them at every run)."""
        yield

    @abstractmethod
    def read_into(self, offset: int, dest: memoryview) -> None:
        """Copy the ``dest.nbytes`` bytes at ``offset`` into host memory ``dest`` (bounds
        checked by the caller)."""

    @abstractmethod
    def write(self, offset: int, t: torch.Tensor) -> None:
        """Store ``t``'s bytes at ``offset`` (bounds checked by the caller)."""

    @abstractmethod
    def status(self) -> dict[str, Union[str, int]]:
        """The region as the extension's status call lists it."""

    @abstractmethod
    def close(self) -> None:
        """Unmap the region."""


class SystemRegion(_Region):
    """Bytes [offset, offset + byte_size) of the POSIX shared memory object ``key``: its
    file kept open for the copies, and mapped read-write for DMA to and from a GPU."""

    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._fd = _open_object(key)
        try:
            self._require_size(os.fstat(self._fd).st_size, "byte_size")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            self._base = offset - start
            try:
                self._map = mmap.mmap(self._fd, self._base + byte_size, offset=start)
            except (OSError, OverflowError, ValueError) as e:
                raise InvalidRequest(f"shared memory key {key!r}: {byte_size} bytes at offset {offset} cannot be "
                                     f"mapped ({e})", field="byte_size") from None
        except BaseException:
            os.close(self._fd)
            raise
        self._host: Optional[torch.Tensor] = None  # uint8 over the mapping, for copies to and from a GPU
        self._pinned = False  # the mapping is page-locked with CUDA (cudaHostRegister)
        self._pin_lock = threading.Lock()
        self._graph_holds = 0  # `graph_hold` blocks open: graphs copy from and to the pinned pages
        self._stale = False  # truncated while held: the pinned pages stay registered, unused by others

    def _require_size(self, size: int, field: str) -> None:
        if self.offset + self.byte_size > size:
            raise InvalidRequest(f"{field}: shared memory key {self.key!r} holds {size} bytes, fewer than offset "
                                 f"{self.offset} + byte_size {self.byte_size} (the object shrank, or was never that "
                                 f"large)", field=field)

    def check(self, offset: int, nbytes: int, field: str) -> None:
        """That [offset, offset + nbytes) lies inside the region, and the object still
        holds the whole region (fstat: a client may have truncated it since)."""
        super().check(offset, nbytes, field)
        self._require_size(os.fstat(self._file()).st_size, field)

    def reserve(self, offset: int, nbytes: int, field: str) -> None:
        """Before the launch, what `write` needs to succeed: the bytes lie below this process's
        file size limit (RLIMIT_FSIZE: a write past it fails with EFBIG), and the object has
        pages for them: unless it has every page already (fstat's ``st_blocks``: one call,
        the common case), they are allocated with ``posix_fallocate`` (no byte changes).
        InvalidRequest (400) naming ``field`` when the limit or the filesystem (ENOSPC: a
        full /dev/shm) refuses. A filesystem that cannot allocate ahead (EOPNOTSUPP, EINVAL)
        leaves the bytes unreserved: a write that then finds no room is still a 400, after
        the launch. A client that frees the object's pages while its request runs can make
        the write fail as well."""
        if nbytes <= 0:
            return
        fd, start = self._file(), self.offset + offset
        self._within_file_limit(start + nbytes, field)
        st = os.fstat(fd)
        if st.st_blocks * 512 >= st.st_size:  # st_blocks counts 512-byte units: no page missing
            return
        try:
            os.posix_fallocate(fd, start, nbytes)
        except OSError as e:
            if e.errno in _NO_FALLOCATE:
                return
            raise InvalidRequest(f"{field}: the outputs could not be written into shared memory region {self.name!r} "
                                 f"(reserving {nbytes} bytes at offset {offset}: {e.strerror}); nothing ran",
                                 field=field) from None

    def _within_file_limit(self, end: int, field: str) -> None:
        """That the object's bytes before ``end`` lie within this process's RLIMIT_FSIZE."""
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and end > limit:
            raise InvalidRequest(f"{field}: the outputs could not be written into shared memory region {self.name!r}: "
                                 f"they end at byte {end} of key {self.key!r}, past this server's file size limit "
                                 f"(RLIMIT_FSIZE, {limit} bytes); nothing ran", field=field)

    def _file(self) -> int:
        """The object's fd; ValueError once the region is closed (its number may be another
        file's by then)."""
        if self._fd < 0:
            raise ValueError(f"shared memory region {self.name!r} is closed")
        return self._fd

    def _pread(self, offset: int, dest: memoryview) -> None:
        """``dest.nbytes`` bytes at region ``offset`` into ``dest``, through the file: an
        object truncated meanwhile makes a short read (InvalidRequest), not a fault."""
        fd = self._file()
        position, done = self.offset + offset, 0
        while done < dest.nbytes:
            n = os.preadv(fd, [dest[done:]], position + done)
            if n == 0:
                raise InvalidRequest(f"shared memory key {self.key!r} shrank to {os.fstat(fd).st_size} bytes "
                                     f"while region {self.name!r} was read", field="shared_memory_region")
            done += n

    def read_into(self, offset: int, dest: memoryview) -> None:
        with dest.cast("B") as flat:
            self._pread(offset, flat)

    def read_into_tensor(self, offset: int, dest: torch.Tensor) -> None:
        """Copy the ``dest.numel()`` bytes at ``offset`` into the uint8 tensor ``dest`` on a
        GPU (bounds checked by the caller), on the device's copy stream: straight from the
        mapping when it is page-locked (one DMA), else read through the file into host
        memory first. The copy may be in flight on return: synchronize the stream before
        the client may write the region again."""
        if not dest.numel():
            return
        mapping = self._pinned_view(dest.device)
        if mapping is not None:
            source = mapping[self._base + offset:self._base + offset + dest.numel()]
        else:
            source = torch.empty(dest.numel(), dtype=torch.uint8)
            self._pread(offset, memoryview(source.numpy()))
        with on_stream(copy_stream(dest.device)):
            dest.copy_(source, non_blocking=self._pinned)

    def write(self, offset: int, t: torch.Tensor) -> None:
        """``t`` (on the host, or on a GPU and complete: the launch synchronized) stored at
        ``offset``, in place when this returns: from a GPU into the page-locked mapping,
        else through the file (an object truncated meanwhile grows back; nothing faults).
        InvalidRequest when the file refuses the bytes anyway (`reserve` ran before the
        launch, but the filesystem could not allocate ahead, or the client freed the pages)."""
        mapping = self._pinned_view(t.device) if t.is_cuda else None
        if mapping is not None:
            begin = self._base + offset
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            stream = copy_stream(t.device)
            with on_stream(stream):
                mapping[begin:begin + data.numel()].copy_(data, non_blocking=True)
            stream.synchronize()  # in place before the response says so
            return
        data = memoryview(tensor_bytes(t))
        fd, position, done = self._file(), self.offset + offset, 0
        try:
            while done < data.nbytes:
                done += os.pwritev(fd, [data[done:]], position + done)
        except OSError as e:
            raise InvalidRequest(f"the outputs could not be written into shared memory region {self.name!r}: "
                                 f"{e.strerror}", field="outputs") from None

    def _pinned_view(self, device: torch.device) -> Optional[torch.Tensor]:
        """The whole mapping as a uint8 host tensor, page-locked with CUDA the first time
        (portable: for every device); None when pinning was refused (a memlock limit) or
        the object no longer holds the region (checked here, at every use: a mapping pinned
        before a truncation is dropped): the CPU never touches an unpinned mapping, copies
        go through the file instead. A truncation racing this check and the copy is not
        guarded: a 4 KiB copy from pages pinned before a truncation killed a test process
        with SIGBUS on the H200 (bench/RESULTS.md, 2026-12-04 fifth session, run 3)."""
        with self._pin_lock:
            if os.fstat(self._file()).st_size < self.offset + self.byte_size:
                self._unpin()  # truncated: pages past the end are gone from the mapping, and pages
                return None  # written through the file from now on are not the pinned ones
            if self._stale:
                return None
            if self._host is None:
                self._host = torch.frombuffer(self._map, dtype=torch.uint8)
                with torch.cuda.device(device):
                    code = torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), self._host.numel(),
                                                                _CUDA_HOST_REGISTER_PORTABLE)
                self._pinned = _cuda_success(code)
                if not self._pinned:
                    _clear_cuda_error()
                    log.warning("shared memory region %r could not be page-locked (%s): its copies to and from "
                                "the GPU go through host memory", self.name, code)
            return self._host if self._pinned else None

    def status(self) -> dict[str, Union[str, int]]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def device_bytes(self, offset: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        if device.type != "cuda" or self._graph_holds == 0:
            return None
        mapping = self._pinned_view(device)
        return None if mapping is None else mapping[self._base + offset:self._base + offset + nbytes]

    @contextmanager
    def graph_hold(self) -> Iterator[None]:
        """While held, a truncation (`_pinned_view`) leaves the pinned pages registered (the
        graphs that copy from and to them stay valid) but unused by anything else; they are
        unregistered when the last hold ends. The holder checks the object's size before each
        run (`check`: a 400) and never copies once it shrank."""
        with self._pin_lock:
            self._graph_holds += 1
        try:
            yield
        finally:
            with self._pin_lock:
                self._graph_holds -= 1
                if self._graph_holds == 0 and self._stale:
                    self._stale = False
                    self._unpin()

    def _unpin(self) -> None:
        """Drop the page-locked view (unregistered with CUDA, once no copy is in flight from
        or to it; only marked stale while a `graph_hold` lasts); the next use pins afresh."""
        if self._graph_holds > 0 and self._host is not None:
            self._stale = True
            return
        if self._host is not None:
            if self._pinned:
                drain_copy_streams()
                torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
                self._pinned = False
            self._host = None  # its export of the mapping ends here, so the mapping can close

    def close(self) -> None:
        try:
            with self._pin_lock:
                self._unpin()
            self._map.close()
        finally:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)


def _open_object(key: str) -> int:
    """A read-write fd of the POSIX shared memory object ``key``: a symbolic link is not
    followed and anything but a regular file is refused (InvalidRequest)."""
    path = os.path.join(SHM_DIR, _object_name(key))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(path):
            raise InvalidRequest(f"shared memory key {key!r} is a symbolic link: not followed", field="key") from None
        if os.path.isdir(path):
            raise InvalidRequest(f"shared memory key {key!r} is not a regular file", field="key") from None
        raise InvalidRequest(f"unable to open shared memory key {key!r}: {e.strerror}", field="key") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidRequest(f"shared memory key {key!r} is not a regular file", field="key")
    return fd


class CudaRegion(_Region):
    """``byte_size`` bytes of another process's device memory: the start of the allocation
    that ``memory`` (shared with other regions naming the same allocation) maps. Copies
    run on the device's `copy_stream`, so none waits for a kernel launch in flight. With
    ``in_place`` it lends its bytes to readers on its own device (`lend`) instead."""

    kind = CUDA

    def __init__(self, name: str, memory: IpcMemory, byte_size: int, release: Callable[[IpcMemory], None],
                 in_place: bool = False) -> None:
        super().__init__(name, byte_size)
        self.device_id = memory.device.index
        self._tensor = memory.view(byte_size)
        self._memory = memory
        self._release = release
        self._in_place = in_place

    def lend(self, offset: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        return self.device_bytes(offset, nbytes, device) if self._in_place else None

    def device_bytes(self, offset: int, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        return self._tensor[offset:offset + nbytes] if device == self._memory.device else None

    def read_into(self, offset: int, dest: memoryview) -> None:
        if dest.nbytes:
            with on_stream(copy_stream(self._memory.device)):
                torch.frombuffer(dest, dtype=torch.uint8).copy_(self._tensor[offset:offset + dest.nbytes])

    def read_into_tensor(self, offset: int, dest: torch.Tensor) -> None:
        """Copy the ``dest.numel()`` bytes at ``offset`` into the uint8 tensor ``dest`` on
        any device (bounds checked by the caller), on the copy streams of both devices;
        the copy may be in flight on return."""
        if dest.numel():
            with _copy_streams(self._memory.device, dest.device):
                dest.copy_(self._tensor[offset:offset + dest.numel()])

    def write(self, offset: int, t: torch.Tensor) -> None:
        """``t`` (on the host, or on a GPU and complete: the launch synchronized) stored at
        ``offset``, in place when this returns."""
        with _copy_streams(self._memory.device, t.device) as streams:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self._tensor[offset:offset + data.numel()].copy_(data)
        for stream in streams:
            stream.synchronize()  # in place before the response says so

    def status(self) -> dict[str, Union[str, int]]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def close(self) -> None:
        drain_copy_streams()  # a request's inputs may still be on their way out of the client's memory
        del self._tensor
        self._release(self._memory)


@contextmanager
def _copy_streams(*devices: torch.device) -> Iterator[list[torch.cuda.Stream]]:
    """Each distinct CUDA device among ``devices`` on its `copy_stream` for the block (a
    copy between two GPUs runs on the source device's current stream); the streams."""
    streams: list[torch.cuda.Stream] = []
    with ExitStack() as stack:
        for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
            stream = copy_stream(device)
            stack.enter_context(on_stream(stream))
            streams.append(stream)
        yield streams


Region = Union[SystemRegion, CudaRegion]
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused cudaHostRegister: left set, the
    next kernel launch check in torch (which reads cudaGetLastError) would raise it.
    torch.cuda.cudart() binds no cudaGetLastError, so it is called in the libcudart this
    process loaded (found in /proc/self/maps); where none is found, nothing is done."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def _cuda_success(code: object) -> bool:
    """Whether a torch.cuda.cudart() call's return value is cudaSuccess."""
    return int(getattr(code, "value", code)) == 0


def _object_name(key: str) -> str:
    """The shared memory object of ``key`` as shm_open finds it: leading slashes dropped,
    then one plain file name."""
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidRequest(f"shared memory key {key!r} must be a name like '/my_region' (no other '/')",
                             field="key")
    return name


class ShmRegistry:
    """The regions registered with one app, by name (system and CUDA share the names).

    Used from the event loop only. ``cuda_reason`` says why CUDA regions cannot be
    registered in this process (None where they can). At most ``max_regions`` regions
    (system and CUDA) and ``max_bytes`` bytes of system regions are mapped at a time,
    counting those unregistered while a request or a prepared prefill still uses them
    (mapped, on a GPU page-locked, until it lets go); a registration past either is
    refused (400) before anything is opened.
    """

    def __init__(self, max_regions: int = DEFAULT_MAX_REGIONS, max_bytes: int = DEFAULT_MAX_BYTES,
                 cuda_in_place: bool = False) -> None:
        self._regions: dict[str, Region] = {}
        self._retiring: set[Region] = set()  # unregistered, still mapped for the requests that use them
        self._ipc = IpcMappings()
        self.cuda_reason = unavailable_reason()
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.cuda_in_place = cuda_in_place  # CUDA regions lend their bytes in place (--cuda-ipc-zero-copy)

    def register_system(self, name: str, key: str, offset: int, byte_size: int,
                        ttl_s: Optional[float] = None) -> SystemRegion:
        """Map ``byte_size`` bytes at ``offset`` of POSIX shared memory ``key`` as region
        ``name``; with ``ttl_s`` it is unregistered after that long unused (see `expire`)."""
        self._free_name(name)
        self._room_for(byte_size)
        region = SystemRegion(name, key, offset, byte_size)
        region.ttl_s = ttl_s
        self._regions[name] = region
        log.info("registered system shared memory region %r (key %r, offset %d, %d bytes)", name, key, offset,
                 byte_size)
        return region

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                      ttl_s: Optional[float] = None) -> None:
        """The first ``byte_size`` bytes of the CUDA allocation ``raw_handle`` names as region
        ``name`` (the handle opened once however many regions name it); with ``ttl_s`` it
        is unregistered after that long unused (see `expire`)."""
        self.require_cuda()
        self._free_name(name)
        self._room_for(0)
        memory = self._ipc.acquire(raw_handle, device_id)
        try:
            region = CudaRegion(name, memory, byte_size, self._ipc.release, in_place=self.cuda_in_place)
        except BaseException:
            self._ipc.release(memory)
            raise
        region.ttl_s = ttl_s
        self._regions[name] = region
        log.info("registered CUDA shared memory region %r (device %d, %d bytes)", name, device_id, byte_size)

    def _room_for(self, system_bytes: int) -> None:
        """That one more region, of ``system_bytes`` mapped bytes, fits the caps (regions
        unregistered but still in use count: they are mapped until released)."""
        held = [*self._regions.values(), *self._retiring]
        if len(held) >= self.max_regions:
            retiring = f", {len(self._retiring)} of them unregistered but still in use" if self._retiring else ""
            raise RegionLimit(f"{len(held)} shared memory regions are mapped{retiring}, the most this server "
                              f"holds (--max-shm-regions {self.max_regions}); unregister one (and release what "
                              "uses it) first", field="name")
        mapped = sum(r.byte_size for r in held if r.kind == SYSTEM)
        if mapped + system_bytes > self.max_bytes:
            raise RegionLimit(f"registering {system_bytes} bytes would map {mapped + system_bytes} bytes of system "
                              f"shared memory, more than this server maps (--max-shm-mb: {self.max_bytes} bytes)",
                              field="byte_size")

    def require_cuda(self) -> None:
        """InvalidRequest (400) saying why, where CUDA shared memory cannot work."""
        if self.cuda_reason is not None:
            raise InvalidRequest(self.cuda_reason)

    def _free_name(self, name: str) -> None:
        """That ``name`` can name a new region: not taken, and no "/" in it (an encoded slash
        names no route, `service.http.encoded_slash`, so no per-name route, status or
        unregister, could reach it); InvalidRequest (400) naming the field otherwise."""
        if "/" in name:
            raise InvalidRequest(f"name: a shared memory region's name cannot hold '/' (no URL could name it), "
                                 f"got {name!r}", field="name")
        if name in self._regions:
            raise InvalidRequest(f"shared memory region {name!r} is already registered ({self._regions[name].kind}); "
                                 "unregister it first", field="name")

    def status(self, kind: str, name: Optional[str] = None) -> list[dict[str, Union[str, int]]]:
        """Status of region ``name`` of ``kind``, or of every region of ``kind``."""
        if name is None:
            return [r.status() for r in self._regions.values() if r.kind == kind]
        return [self._get(name, kind).status()]

    def unregister(self, kind: str, name: Optional[str] = None) -> None:
        """Forget region ``name`` of ``kind`` (every region of ``kind`` when None); an
        unknown name is a no-op, as in Triton. Memory a request still uses is unmapped
        when that request is done."""
        names = [n for n, r in self._regions.items() if r.kind == kind and (name is None or n == name)]
        for n in names:
            region = self._regions.pop(n)
            region.closing = True
            if region.users == 0:
                self._close(region)
            else:
                self._retiring.add(region)
            log.info("unregistered %s shared memory region %r", kind, n)

    def expire(self) -> list[str]:
        """Unregister the regions whose lease ran out (unused for ``ttl_s``); their names."""
        now = time.monotonic()
        gone = [r for r in self._regions.values()
                if r.ttl_s is not None and r.users == 0 and now - r.last_used > r.ttl_s]
        for region in gone:
            log.info("shared memory region %r unused for %.1f s (its lease): unregistering", region.name,
                     now - region.last_used)
            self.unregister(region.kind, region.name)
        return [r.name for r in gone]

    def _get(self, name: str, kind: Optional[str] = None) -> Region:
        region = self._regions.get(name)
        if region is None or (kind is not None and region.kind != kind):
            what = f"{kind} shared memory region" if kind else "shared memory region"
            raise UnknownRegion(f"unknown {what} {name!r}: register it first", field="shared_memory_region")
        return region

    @contextmanager
    def lease(self, names: Iterable[str]) -> Iterator[dict[str, Region]]:
        """The named regions, kept mapped until the block ends; UnknownRegion for a name
        that is not registered (nothing leased then)."""
        regions = {name: self._get(name) for name in set(names)}
        for region in regions.values():
            region.users += 1
        try:
            yield regions
        finally:
            now = time.monotonic()
            for region in regions.values():
                region.users -= 1
                region.last_used = now
                if region.closing and region.users == 0:
                    self._retiring.discard(region)
                    self._close(region)

    def close(self) -> None:
        """Unmap every region (shutdown): the clients' memory is left as it is."""
        for kind in (SYSTEM, CUDA):
            self.unregister(kind)

    @staticmethod
    def _close(region: Region) -> None:
        try:
            region.close()
        except (OSError, RuntimeError, BufferError) as e:
            log.warning("unmapping shared memory region %r failed: %s", region.name, e)

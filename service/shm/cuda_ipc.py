"""CUDA IPC memory of another process (the CUDA shared memory extension), opened with
cuda-python's runtime bindings (``cuda.bindings.runtime``, the package tritonclient's own
``tritonclient.utils.cuda_shared_memory`` uses to make such handles).

A client allocates device memory, takes a ``cudaIpcMemHandle_t`` of it and registers the
handle's 64 raw bytes (base64); `IpcMemory` opens it here (once per handle: `IpcMappings`),
checks the registered size against the allocation, and views it as a torch uint8 tensor
on that device, without a copy. The client must have finished writing before it
sends a request that reads the region (the protocol's rule, as in Triton).
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
from typing import Any, Callable, Optional

import torch

from ..errors import InvalidRequest

log = logging.getLogger("kda_serve.cuda_ipc")

NO_CUDA = "CUDA shared memory needs a CUDA device; this server has none (use system shared memory)"
NO_CUDA_PYTHON = ("CUDA shared memory needs the cuda-python package on the server "
                  "(pip install cuda-python); use system shared memory meanwhile")


def unavailable_reason() -> Optional[str]:
    """Why CUDA IPC cannot work in this process, or None when it can."""
    if not torch.cuda.is_available():
        return NO_CUDA
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return NO_CUDA_PYTHON
    return None


class _CudaArray:
    """The smallest object torch.as_tensor takes as device memory (``__cuda_array_interface__``)."""

    def __init__(self, pointer: int, byte_size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (byte_size,), "typestr": "|u1", "data": (pointer, False), "strides": None, "version": 3,
        }


class IpcMemory:
    """An opened IPC handle: the client's whole allocation, ``size`` bytes on
    ``cuda:device_id`` from ``pointer``. `view` gives uint8 tensors over it without a copy;
    `close` unmaps it (the client's memory stays the client's)."""

    def __init__(self, raw_handle: bytes, device_id: int) -> None:
        from cuda.bindings import driver  # present: see unavailable_reason
        from cuda.bindings import runtime as cudart

        self._cudart = cudart
        if len(raw_handle) != cudart.CUDA_IPC_HANDLE_SIZE:
            raise InvalidRequest(f"raw_handle must hold a {cudart.CUDA_IPC_HANDLE_SIZE}-byte cudaIpcMemHandle_t, "
                                 f"got {len(raw_handle)} bytes", field="raw_handle")
        if device_id >= torch.cuda.device_count():
            raise InvalidRequest(f"device_id {device_id} out of range: this server sees "
                                 f"{torch.cuda.device_count()} CUDA device(s)", field="device_id")
        handle = cudart.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, len(raw_handle))
        self.key = (device_id, bytes(raw_handle))
        self.device = torch.device("cuda", device_id)
        with torch.cuda.device(self.device):
            torch.cuda.init()  # the primary context the IPC mapping lives in
            err, pointer = cudart.cudaIpcOpenMemHandle(handle, cudart.cudaIpcMemLazyEnablePeerAccess)
            if err != cudart.cudaError_t.cudaSuccess:
                raise InvalidRequest(f"cudaIpcOpenMemHandle failed: {self._error_name(err)} (the handle must come "
                                     f"from cudaIpcGetMemHandle in another process, on device {device_id})",
                                     field="raw_handle")
            self.pointer = int(pointer)
            err, _, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(self.pointer))
        self.size: Optional[int] = int(size) if err == driver.CUresult.CUDA_SUCCESS else None
        if self.size is None:
            log.warning("cuMemGetAddressRange failed on an opened IPC handle (%s): registered sizes go unchecked", err)

    def view(self, byte_size: int) -> torch.Tensor:
        """uint8 [byte_size] over the allocation's first bytes; InvalidRequest (400) when the
        allocation is smaller (a kernel reading past it would fault the whole server)."""
        if self.size is not None and byte_size > self.size:
            raise InvalidRequest(f"byte_size {byte_size} exceeds the {self.size} bytes of the CUDA allocation the "
                                 "handle names", field="byte_size")
        return torch.as_tensor(_CudaArray(self.pointer, byte_size), device=self.device)

    def _error_name(self, err: Any) -> str:
        return self._cudart.cudaGetErrorName(err)[1].decode()

    def close(self) -> None:
        """Unmap the client's memory (no view of it may be used after); RuntimeError if CUDA refuses."""
        with torch.cuda.device(self.device):
            (err,) = self._cudart.cudaIpcCloseMemHandle(self.pointer)
        if err != self._cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaIpcCloseMemHandle failed: {self._error_name(err)}")


class IpcMappings:
    """The IPC handles opened in this process, one mapping per (device, handle): CUDA opens
    a handle once per context, and two regions can name one allocation (torch shares its
    allocator's whole blocks, so two tensors of one block share a handle). A mapping is
    opened by its first region and closed with its last. ``opener`` opens a handle (tests
    pass a stand-in)."""

    def __init__(self, opener: Callable[[bytes, int], IpcMemory] = IpcMemory) -> None:
        self._opener = opener
        self._open: dict[tuple[int, bytes], tuple[IpcMemory, int]] = {}  # key -> (mapping, regions using it)

    def acquire(self, raw_handle: bytes, device_id: int) -> IpcMemory:
        """The mapping of ``raw_handle`` on ``device_id``, opened on first use."""
        key = (device_id, bytes(raw_handle))
        memory, users = self._open.get(key) or (self._opener(raw_handle, device_id), 0)
        self._open[key] = (memory, users + 1)
        return memory

    def release(self, memory: IpcMemory) -> None:
        """One user fewer of ``memory``; closed when none is left."""
        _, users = self._open[memory.key]
        if users > 1:
            self._open[memory.key] = (memory, users - 1)
            return
        del self._open[memory.key]
        memory.close()

    def __len__(self) -> int:
        return len(self._open)

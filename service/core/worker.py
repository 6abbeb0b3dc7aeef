"""`DeviceWorker`: the one thread that touches pool memory and launches kernels.

Kernel launches, allocation (zeroing rows), fork, state reads and writes, idle sweeps and
snapshots all run here, one at a time in submission order. So launches are serialized, no
pool row is read while a launch writes it, a sweep never lands between resolving a slot's
row and the launch on it, and the event loop never blocks on the device.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

_T = TypeVar("_T")


def as_on_the_device_thread(device: torch.device, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on the calling thread as the device thread (`DeviceWorker`) runs it:
    grad mode off (the kernels' entry then enters no `torch.no_grad` of its own) and, on a
    CPU, one intra-op thread: small launches of tiny ops, where a second thread contends
    more than it helps (a 64-token launch at HV = 2, K = 16: 1.9 against 3.4-4.3 ms inside
        a server on a loaded 2-core machine; the self-test 20x slower). The calling thread's
    grad mode and thread count (OpenMP's is per thread) are restored after. A plain call, not a context manager:
    a generator's context costs ~5 us of a lone small launch."""
    one_thread, grad = device.type == "cpu", torch.is_grad_enabled()
    threads = torch.get_num_threads() if one_thread else 0
    if one_thread:
        torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    try:
        return fn(*args)
    finally:
        if one_thread:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)


def _device_thread_setup(device: torch.device) -> None:
    """The device thread's start: grad mode off for good (nothing there needs autograd, and
    the kernels' entry then enters no `torch.no_grad` per launch); on CUDA ``device``
    made current."""
    torch.set_grad_enabled(False)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the CUDA device current now
    (`torch.cuda.set_device` refuses a device without an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceWorker:
    """The thread for ``device``, grad mode off there; on CUDA it makes that device current
    there, so kernels that use the current device (Triton's launcher, streams) see the
    right one.

    `run_inline` runs work on the caller's thread (the event loop) instead, only while the
    thread is idle: nothing submitted is queued or running, so the order stays the
    submission order and pool memory is still touched by one thread at a time."""

    def __init__(self, device: torch.device) -> None:
        self._device = device = _indexed(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kda-device",
                                            initializer=_device_thread_setup, initargs=(device,))
        # each counter is written by one thread only: submitted and cancelled by the loop, finished by the worker
        self._submitted = 0
        self._finished = 0
        self._cancelled = 0  # submitted, then cancelled before they started: never finished

    def _counted(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        finally:
            self._finished += 1

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the device thread, awaited from the event loop. Cancelling the
        caller before the thread starts it cancels it (it never runs); once started it runs
        to its end."""
        job = self._executor.submit(self._counted, functools.partial(fn, *args))
        self._submitted += 1  # once accepted (a closed executor raises above)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel():  # never started, never to finish: `idle` must not wait for it
                self._cancelled += 1
            raise

    @property
    def idle(self) -> bool:
        """Whether everything submitted with `run` has finished (read on the loop, which is
        the only thread that submits: an idle worker stays idle until the loop submits)."""
        return self._submitted == self._finished + self._cancelled

    def run_inline(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the calling thread (the event loop) as the device thread runs it
        (`as_on_the_device_thread`; on CUDA with the device made current); only while `idle`
        (ValueError otherwise): small launches skip two thread hops."""
        if not self.idle:
            raise ValueError("run_inline while the device thread has work")
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):
                return as_on_the_device_thread(self._device, fn, *args)
        return as_on_the_device_thread(self._device, fn, *args)

    def close(self) -> None:
        """Finish queued work and stop the thread."""
        self._executor.shutdown(wait=True)


INLINE_BYTES = 1 << 20
"""Work on more bytes than this (decoding, validating, encoding) leaves the event loop."""


async def off_loop(fn: Callable[..., _T], *args: Any, nbytes: int) -> _T:
    """``fn(*args)``: inline for small inputs, on a thread of the default pool for large
    ones (torch and base64 release the GIL), so a big request never stalls the loop."""
    if nbytes <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)

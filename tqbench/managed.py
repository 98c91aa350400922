"""Managed memory on MLX's CUDA backend: host views of evaluated MLX arrays, and moving their pages in bulk.

A page-in used to be `pool[slot] = mx.array(bytes)`: a host copy into a fresh MLX buffer, then a slice update that
copies it again into the pool. On MLX's CUDA backend every array lives in managed (unified) memory, and a GPU kernel
that reads bytes the host just wrote pulls them over page by page on demand: measured on an H200, that made a page-in
cost about as much as reading the expert from disk. So the streamer now copies a read expert directly into its slot
through a writable host view of the pool array (MLX's buffer protocol: same memory, no copy) and, on CUDA, asks the
driver to migrate the slot's pages to the GPU in one bulk transfer (`cuMemPrefetchAsync`, about 49 GB/s there) instead
of faulting them in. The prefetch is only a hint: where it is unavailable or fails, the pages still arrive on demand.
The other direction is the same: the converter moves a produced array's pages to the host in one transfer before its
bytes are hashed and written (faulting them over ran at about 2.3 GB/s, a bulk prefetch at about 10).

Writing into an array behind MLX's back is safe only while no pending computation reads it: the streamer writes a
slot only after every earlier use of the pool has been evaluated (routing a layer evaluates all before it).
"""

from __future__ import annotations

import ctypes
import threading

import mlx.core as mx
import numpy as np


def host_view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated array's own memory (bfloat16 as its raw uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    v = np.asarray(memoryview(a))
    if not v.flags.writeable or not v.flags.c_contiguous or v.shape != tuple(a.shape):
        raise RuntimeError("this MLX build gives no writable view of an array's memory")
    return v


class GpuPrefetch:
    """Migrates written host ranges of managed memory to the GPU (CUDA only; a no-op elsewhere)."""

    CU_DEVICE_CPU = -1

    def __init__(self, enabled: bool | None = None):
        if enabled is None:
            enabled = on_cuda()
        self.lib = None
        self.error: str | None = None
        self.calls = 0
        self._local = threading.local()
        if enabled:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
                lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
                self.lib = lib
            except (OSError, AttributeError) as e:
                self.error = f"no CUDA driver prefetch: {e}"

    @property
    def active(self) -> bool:
        return self.lib is not None

    def _bind(self) -> bool:
        """Make the device's primary context current on this thread (the driver API needs one)."""
        if getattr(self._local, "bound", False):
            return True
        ctx = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
            r = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
            if r != 0 or self.lib.cuCtxSetCurrent(ctx) != 0:
                self._fail(f"no CUDA context on this thread (error {r})")
                return False
        self._local.bound = True
        return True

    def to_gpu(self, view: np.ndarray) -> None:
        """Start moving `view`'s pages to GPU 0 (asynchronous; the GPU's next read of them waits for it)."""
        self._move(view, 0)

    def to_host(self, view: np.ndarray) -> None:
        """Start moving `view`'s pages to host memory (asynchronous; a host read of them waits for it)."""
        self._move(view, self.CU_DEVICE_CPU)

    def _move(self, view: np.ndarray, device: int) -> None:
        if self.lib is None or view.nbytes == 0 or not self._bind():
            return
        r = self.lib.cuMemPrefetchAsync(view.ctypes.data, view.nbytes, device, None)
        if r != 0:
            self._fail(f"cuMemPrefetchAsync returned {r}")
        self.calls += 1

    def _fail(self, why: str) -> None:
        self.error, self.lib = why, None  # a hint that fails once is not tried again


_default: GpuPrefetch | None = None


def default_prefetch() -> GpuPrefetch:
    """One GpuPrefetch for the process (the driver library is loaded once, on first use)."""
    global _default
    if _default is None:
        _default = GpuPrefetch()
    return _default


def on_cuda() -> bool:
    """Whether MLX's default device is a GPU of its CUDA build."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device().type == mx.gpu
    except AttributeError:
        return False

"""Managed memory on MLX's CUDA backend: host views of evaluated MLX arrays, moving their pages in bulk, and copying
bytes into them by DMA.

A page-in used to be `pool[slot] = mx.array(bytes)`: a host copy into a fresh MLX buffer, then a slice update that
copies it again into the pool. On MLX's CUDA backend every array lives in managed (unified) memory, and a GPU kernel
that reads bytes the host just wrote pulls them over page by page on demand: measured on an H200, that made a page-in
cost about as much as reading the expert from disk. So the streamer now copies a read expert directly into its slot
through a writable host view of the pool array (MLX's buffer protocol: same memory, no copy) and, on CUDA, asks the
driver to migrate the slot's pages to the GPU in one bulk transfer (`cuMemPrefetchAsync`, about 49 GB/s there) instead
of faulting them in. The prefetch is only a hint: where it is unavailable or fails, the pages still arrive on demand.
The streamer now goes one step further on CUDA (DmaCopy): the GPU's copy engines write a slot from pinned host memory
where its pages are, so they never migrate at all.
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


class _Driver:
    """The CUDA driver library (loaded once per object) and, per thread, the device's primary context made current
    (the driver API needs one). A call that fails once turns the object off for good: these are speed paths, and
    the caller's portable path still runs."""

    def __init__(self, enabled: bool | None):
        if enabled is None:
            enabled = on_cuda()
        self.lib = None
        self.error: str | None = None
        self.calls = 0
        self._local = threading.local()
        if enabled:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
                self._declare(lib)
                self.lib = lib
            except (OSError, AttributeError) as e:
                self.error = f"no CUDA driver: {e}"

    def _declare(self, lib) -> None:
        """Set the argument types of the calls this class makes (AttributeError: the driver lacks one)."""

    @property
    def active(self) -> bool:
        return self.lib is not None

    def _bind(self) -> bool:
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

    def _fail(self, why: str) -> None:
        self.error, self.lib = why, None


class GpuPrefetch(_Driver):
    """Migrates written host ranges of managed memory to the GPU (CUDA only; a no-op elsewhere)."""

    CU_DEVICE_CPU = -1

    def __init__(self, enabled: bool | None = None):
        super().__init__(enabled)

    def _declare(self, lib) -> None:
        lib.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

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


class DmaCopy(_Driver):
    """Copies between host buffers and managed arrays by the GPU's copy engines (CUDA only; inactive elsewhere).

    The streamer's first way to fill a slot was a host memcpy through its managed pages: the slot's pages migrated to
    the host first, were written there at the speed of page faults, and migrated back (on the H200 a host-tier hit
    cost 6.6 ms per 11 MB expert that way). A copy from pinned host memory to the slot's pages where they are (on
    the GPU) is one DMA transfer at PCIe speed, and the slot's pages never move. Each thread copies on a stream of
    its own and waits for it (`wait`), so a copy is complete in GPU memory before the engine thread runs anything
    that reads the slot. Source and destination must not change while a copy runs (the streamer's rules for slots
    and staging buffers already say so). `pin` page-locks a host range once; an unpinned range still copies, through
    the driver's own staging, slower."""

    CU_STREAM_NON_BLOCKING = 1

    def __init__(self, enabled: bool | None = None):
        super().__init__(enabled)
        self.pinned: list[tuple[int, int]] = []  # (address, bytes) registered by pin, released by unpin_all
        self.pinned_bytes = 0
        self._pin_lock = threading.Lock()
        self._streams: list = []  # every thread's stream, destroyed by close

    def _declare(self, lib) -> None:
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]

    def _stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            if not self._bind():
                return None
            handle = ctypes.c_void_p()
            r = self.lib.cuStreamCreate(ctypes.byref(handle), self.CU_STREAM_NON_BLOCKING)
            if r != 0:
                self._fail(f"cuStreamCreate returned {r}")
                return None
            stream = self._local.stream = handle
            with self._pin_lock:
                self._streams.append(handle)
        return stream

    def copy(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """Queue a copy of `src`'s bytes into `dst` (both C-contiguous, the same size) on this thread's stream.
        Returns False when it could not (then the caller copies the bytes itself); `wait` before using `dst`."""
        if self.lib is None or dst.nbytes != src.nbytes:
            return False
        stream = self._stream()
        if stream is None:
            return False
        r = self.lib.cuMemcpyAsync(dst.ctypes.data, src.ctypes.data, dst.nbytes, stream)
        if r != 0:
            self.lib.cuStreamSynchronize(stream)  # the copies queued before this one end before the caller's own
            self._fail(f"cuMemcpyAsync returned {r}")
            return False
        self.calls += 1
        return True

    def wait(self) -> bool:
        """Wait until this thread's queued copies are done. False if they failed (the caller redoes them itself)."""
        stream = getattr(self._local, "stream", None)
        if self.lib is None or stream is None:
            return self.lib is not None
        r = self.lib.cuStreamSynchronize(stream)
        if r != 0:
            self._fail(f"cuStreamSynchronize returned {r}")
            return False
        return True

    def pin(self, view: np.ndarray) -> bool:
        """Page-lock `view`'s memory (whole pages of it, none pinned before) so copies from and to it are DMA at full
        speed. Returns whether it is pinned."""
        if self.lib is None or view.nbytes == 0 or not self._bind():
            return False
        address = view.ctypes.data
        with self._pin_lock:
            r = self.lib.cuMemHostRegister_v2(address, view.nbytes, 0)
            if r != 0:
                return False  # e.g. over the locked-memory limit: copies still work, from pageable memory
            self.pinned.append((address, view.nbytes))
            self.pinned_bytes += view.nbytes
        return True

    def close(self) -> None:
        """Release every pinned range and every thread's stream (once the threads that copy are done)."""
        self.unpin_all()
        with self._pin_lock:
            if self.lib is not None:
                for stream in self._streams:
                    self.lib.cuStreamDestroy_v2(stream)
            self._streams.clear()

    def unpin_all(self) -> None:
        """Release every range `pin` locked (before the memory is freed)."""
        with self._pin_lock:
            if self.lib is not None:
                for address, _ in self.pinned:
                    self.lib.cuMemHostUnregister(address)
            self.pinned.clear()
            self.pinned_bytes = 0


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

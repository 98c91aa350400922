"""An MLX-owned byte arena that helper threads read source tensors into, handed out in first-in first-out order.

Reading a tensor into Python bytes and then `mx.array(bytes)` copies every byte once more on the MLX thread (on an
H200's managed memory about 2 GB/s: most of what decoding a source cost the converter). With the arena, a helper
thread `preadv`s straight into the arena's memory through a writable host view, and the MLX thread takes a view of
those bytes (a slice of the arena: no copy). On CUDA the MLX thread asks the driver to move a region's pages to the
host before the read and to the GPU when it is collected, in bulk, instead of faulting them over page by page.

Regions are reserved in order and freed in order: a region may be written again only after `release()`, which the
caller calls once every computation that read the collected tensors has been evaluated. The arena is made on the MLX
thread; helper threads only write bytes into its host view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from tqbench.managed import GpuPrefetch, default_prefetch, host_view

ALIGN = 4096  # regions start on page boundaries (a dtype view of any region is aligned)


@dataclass(kw_only=True)
class Region:
    start: int
    end: int
    collected: bool = False  # the MLX thread took its view (or it was discarded): freed at the next release()


class Arena:
    def __init__(self, capacity: int, prefetch: GpuPrefetch | None = None):
        self.capacity = -(-capacity // ALIGN) * ALIGN
        self.array = mx.zeros((self.capacity,), mx.uint8)
        self.view = host_view(self.array)
        self.prefetch = prefetch if prefetch is not None else default_prefetch()
        self._live: deque[Region] = deque()  # reserved regions, oldest first
        self._head = 0  # where the next region starts, unless it has to wrap to 0

    @property
    def used(self) -> int:
        """Bytes reserved, counted from the oldest live region to the head (wasted wrap space included)."""
        if not self._live:
            return 0
        tail = self._live[0].start
        return self._head - tail if self._head > tail else self.capacity - tail + self._head

    def reserve(self, nbytes: int) -> Region | None:
        """A region of `nbytes` for a helper thread to fill, or None when the arena has no room before the oldest
        live region. On CUDA its pages start moving to the host now (the read writes them there)."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        start = self._fit(size)
        if start is None:
            return None
        r = Region(start=start, end=start + nbytes)
        self._live.append(r)
        self._head = start + size
        self.prefetch.to_host(self.view[r.start:r.end])
        return r

    def _fit(self, size: int) -> int | None:
        if size > self.capacity:
            return None
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0].start
        if self._head > tail:  # live bytes run tail..head: room after the head, or from 0 up to the tail
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None  # wrapped: live bytes run tail..end, 0..head

    def target(self, r: Region) -> memoryview:
        """The region's host memory, for a helper thread's read."""
        return memoryview(self.view[r.start:r.end])

    def collect(self, r: Region, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
        """The region's bytes as an MLX array (a view of the arena); on CUDA its pages start moving to the GPU."""
        r.collected = True
        self.prefetch.to_gpu(self.view[r.start:r.end])
        a = self.array[r.start:r.end]
        return (a.view(dtype) if dtype != mx.uint8 else a).reshape(shape)

    def release(self) -> int:
        """Free the oldest regions whose tensors were collected: only call once nothing pending reads them.
        Returns how many were freed."""
        n = 0
        while self._live and self._live[0].collected:
            self._live.popleft()
            n += 1
        return n


def mlx_dtype(safetensors_dtype: str) -> mx.Dtype | None:
    """The MLX dtype that holds a safetensors dtype's bytes as stored (fp8 and E8M0 as uint8), or None."""
    return _MLX.get(safetensors_dtype)


_MLX = {"U8": mx.uint8, "I8": mx.int8, "F8_E4M3": mx.uint8, "F8_E5M2": mx.uint8, "F8_E8M0": mx.uint8,
        "U16": mx.uint16, "I16": mx.int16, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
        "I32": mx.int32, "F32": mx.float32}

"""A slot pool: MLX arrays with one slot per expert for the layers of one signature, which (layer, expert) each slot
holds, and the byte copies into and out of a slot's memory (no MLX call, so a read worker makes them): on CUDA by the
GPU's copy engines where the slot's pages are (tqbench.managed.DmaCopy), elsewhere (and if that fails) by numpy.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from tqbench.managed import DmaCopy, GpuPrefetch, host_view
from tqbench.stream.cache import SlotCache
from tqbench.stream.store import LayerLayout, part_array

MLX_DTYPES = {"U32": mx.uint32, "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "U8": mx.uint8}


class Pool:
    """Slot arrays for layers of one signature, and which (layer, expert) each slot holds."""

    def __init__(self, layout: LayerLayout, slots: int, policy: str, prefetch: GpuPrefetch,
                 dma: DmaCopy | None = None):
        self.parts = layout.parts
        self.nbytes = layout.nbytes
        self.arrays = {(p.projection, p.param): mx.zeros((slots, *p.shape), dtype=MLX_DTYPES[p.dtype])
                       for p in layout.parts}
        mx.eval(list(self.arrays.values()))
        # the arrays' own memory: page-ins copy into it (the arrays are never replaced, so the views stay valid)
        self.views = {k: host_view(a) for k, a in self.arrays.items()}
        self.prefetch = prefetch
        self.dma = dma if dma is not None else DmaCopy(enabled=False)
        self.cache = SlotCache(slots, policy)

    @property
    def slots(self) -> int:
        return self.cache.capacity

    def to_host(self, slot: int) -> None:
        """Start moving a slot's pages to host memory ahead of a write into it (CUDA without DMA copies; a no-op
        elsewhere: a DMA copy writes the pages where they are)."""
        if self.dma.active:
            return
        for v in self.views.values():
            self.prefetch.to_host(v[slot])

    def copy_in(self, slot: int, buf: np.ndarray) -> float:
        """Copy one expert from a staging buffer into `slot` of every part's array. Numpy only (np.copyto releases the
        GIL), so a read worker runs it. The caller guarantees that no pending computation reads the pool (see
        tqbench.managed) and that nothing else writes this slot or `buf` meanwhile. Returns the seconds it took."""
        t0 = time.perf_counter()
        self._copy([(self.views[(p.projection, p.param)][slot], part_array(buf, p)) for p in self.parts])
        return time.perf_counter() - t0

    def copy_out(self, slot: int, buf: np.ndarray) -> float:
        """Copy the expert in `slot` into `buf` (laid out as a staging buffer): copy_in's reverse, for the host tier.
        Same rules as copy_in. Returns the seconds it took."""
        t0 = time.perf_counter()
        self._copy([(part_array(buf, p), self.views[(p.projection, p.param)][slot]) for p in self.parts])
        return time.perf_counter() - t0

    def _copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy each (destination, source) pair's bytes: all by DMA, waited for, or else all by numpy."""
        if self.dma.active and all(self.dma.copy(dst, src) for dst, src in pairs) and self.dma.wait():
            return
        for dst, src in pairs:
            np.copyto(dst, src, casting="no")

    def move(self, slot: int, source: np.ndarray, out: np.ndarray | None) -> float:
        """Save the slot's expert into `out` (a host slot; None: it vanishes), then copy `source` in. Returns the
        seconds it took."""
        return (self.copy_out(slot, out) if out is not None else 0.0) + self.copy_in(slot, source)

    def to_gpu(self, slot: int) -> float:
        """Start moving a written slot's pages to the GPU (CUDA without DMA copies; a no-op elsewhere). Engine thread,
        after copy_in. Returns the seconds spent asking (timing only)."""
        if self.dma.active:
            return 0.0
        t0 = time.perf_counter()
        for v in self.views.values():
            self.prefetch.to_gpu(v[slot])
        return time.perf_counter() - t0

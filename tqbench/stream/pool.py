"""A slot pool: MLX arrays with one slot per expert for the layers of one signature, which (layer, expert) each slot
holds, and the byte copies into and out of a slot's memory (numpy only, so a read worker makes them).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from tqbench.managed import GpuPrefetch, host_view
from tqbench.stream.cache import SlotCache
from tqbench.stream.store import LayerLayout, part_array

MLX_DTYPES = {"U32": mx.uint32, "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "U8": mx.uint8}


class Pool:
    """Slot arrays for layers of one signature, and which (layer, expert) each slot holds."""

    def __init__(self, layout: LayerLayout, slots: int, policy: str, prefetch: GpuPrefetch):
        self.parts = layout.parts
        self.nbytes = layout.nbytes
        self.arrays = {(p.projection, p.param): mx.zeros((slots, *p.shape), dtype=MLX_DTYPES[p.dtype])
                       for p in layout.parts}
        mx.eval(list(self.arrays.values()))
        # the arrays' own memory: page-ins copy into it (the arrays are never replaced, so the views stay valid)
        self.views = {k: host_view(a) for k, a in self.arrays.items()}
        self.prefetch = prefetch
        self.cache = SlotCache(slots, policy)

    @property
    def slots(self) -> int:
        return self.cache.capacity

    def to_host(self, slot: int) -> None:
        """Start moving a slot's pages to host memory ahead of a write into it (CUDA; a no-op elsewhere)."""
        for v in self.views.values():
            self.prefetch.to_host(v[slot])

    def copy_in(self, slot: int, buf: np.ndarray) -> float:
        """Copy one expert from a staging buffer into `slot` of every part's array. Numpy only (np.copyto releases the
        GIL), so a read worker runs it. The caller guarantees that no pending computation reads the pool (see
        tqbench.managed) and that nothing else writes this slot or `buf` meanwhile. Returns the seconds it took."""
        t0 = time.perf_counter()
        for p in self.parts:
            np.copyto(self.views[(p.projection, p.param)][slot], part_array(buf, p), casting="no")
        return time.perf_counter() - t0

    def copy_out(self, slot: int, buf: np.ndarray) -> float:
        """Copy the expert in `slot` into `buf` (laid out as a staging buffer): copy_in's reverse, for the host tier.
        Same rules as copy_in. Returns the seconds it took."""
        t0 = time.perf_counter()
        for p in self.parts:
            np.copyto(part_array(buf, p), self.views[(p.projection, p.param)][slot], casting="no")
        return time.perf_counter() - t0

    def move(self, slot: int, source: np.ndarray, out: np.ndarray | None) -> float:
        """Save the slot's expert into `out` (a host slot; None: it vanishes), then copy `source` in. Returns the
        seconds it took."""
        return (self.copy_out(slot, out) if out is not None else 0.0) + self.copy_in(slot, source)

    def to_gpu(self, slot: int) -> float:
        """Start moving a written slot's pages to the GPU (CUDA; a no-op elsewhere). Engine thread, after copy_in.
        Returns the seconds spent asking (timing only)."""
        t0 = time.perf_counter()
        for v in self.views.values():
            self.prefetch.to_gpu(v[slot])
        return time.perf_counter() - t0

"""The host-RAM expert tier: where experts evicted from the GPU's slot pools go instead of vanishing, on a machine
whose GPU memory is not its RAM (CUDA). A GPU miss found here is a host-to-GPU copy (a memcpy into the slot, then
the slot's bulk prefetch) instead of a disk read.

The tier is exclusive with the GPU pools: an expert lives in one of them, so 6 GB of GPU and 24 GB of host hold 30 GB
of distinct experts. An expert enters when a page-in evicts it from a GPU slot (its bytes are copied out of the slot,
whose pages are moving to the host for the new expert's write anyway) and leaves when a GPU miss takes it back.
Its victims are the least recently evicted (LRU over admissions): the GPU's policy already kept the experts it valued.

Bytes only (numpy): the streamer's workers copy, the engine thread decides. On unified memory (Apple silicon, the
CPU) there is one tier: the budget for this one is then 0 unless asked for, and the faces say so.
"""

from __future__ import annotations

import mmap
from typing import Callable

import numpy as np

from tqbench.stream.cache import SlotCache

HOST_POLICY = "lru"


class HostTier:
    """`capacity` slots of `slot_bytes` each in one anonymous mapping (pages are committed as they are written), each
    slot starting on a page of its own, and which (layer, expert) each holds. `pin` (DmaCopy.pin on CUDA): called once
    on each slot's pages before its first use, so copies to and from the GPU run at DMA speed."""

    def __init__(self, budget_bytes: int, slot_bytes: int, pin: Callable[[np.ndarray], bool] | None = None):
        self.slot_bytes = slot_bytes
        self.capacity = budget_bytes // slot_bytes
        if self.capacity < 1:
            raise ValueError(f"a host tier of {budget_bytes:,} bytes cannot hold one expert ({slot_bytes:,} bytes)")
        self.cache = SlotCache(self.capacity, HOST_POLICY)
        stride = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # page-aligned slots: each pinned on its own
        self.arena = np.frombuffer(mmap.mmap(-1, self.capacity * stride), dtype=np.uint8).reshape(self.capacity, stride)
        self.pin = pin
        self.pinned = np.zeros(self.capacity, dtype=bool) if pin is not None else None
        self.admitted = 0  # experts moved here from a GPU slot
        self.dropped = 0  # experts evicted from here (gone from both tiers)

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def bytes_held(self) -> int:
        return len(self.cache) * self.slot_bytes

    def slot(self, index: int, nbytes: int) -> np.ndarray:
        """A host slot's first `nbytes`: an expert's buffer, laid out as the store reads it (part offsets from 0).
        Engine thread (it pins the slot on first use)."""
        if self.pinned is not None and not self.pinned[index]:
            self.pinned[index] = True  # tried once: an unpinned slot still copies, slower
            self.pin(self.arena[index])
        return self.arena[index, :nbytes]

    def take(self, keys: list, locked: set) -> dict:
        """Host slots for `keys` (evicted from the GPU, none of them here), as many as there is room for without
        evicting a key in `locked` (experts being copied out of this tier). Returns {key: slot index}; the keys left
        out vanish, as without a host tier."""
        keys = [k for k in keys if k not in self.cache]
        room = self.capacity - len(locked)
        keys = keys[:max(0, room)]
        if not keys:
            return {}
        before = self.cache.evictions
        slots = self.cache.place_many(keys, 0, locked)
        self.dropped += self.cache.evictions - before
        self.admitted += len(keys)
        return dict(zip(keys, slots))

    def release(self, keys: list) -> None:
        """Forget keys a GPU slot took back (their copies are done)."""
        for key in keys:
            self.cache.drop(key)

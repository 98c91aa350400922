"""The host-RAM expert tier: where experts evicted from the GPU's slot pools go instead of vanishing, on a machine
whose GPU memory is not its RAM (CUDA). A GPU miss found here is a host-to-GPU copy (by DMA from the slot's pinned
pages, tqbench.managed.DmaCopy) instead of a disk read.

The tier is exclusive with the GPU pools: an expert lives in one of them, so 6 GB of GPU and 24 GB of host hold 30 GB
of distinct experts. An expert enters when a page-in evicts it from a GPU slot (its bytes are copied out of the slot
before the new expert's are copied in) and leaves when a GPU miss takes it back.
Its victims are the least recently evicted (LRU over admissions): the GPU's policy already kept the experts it valued.

Page-locking a slot costs about as much as copying it (measured on an H100: ~4 ms per 11 MB expert), so the slots are
pinned ahead of use by a thread of their own, in the order they are handed out; a slot needed before the thread got
to it is pinned where it is needed. Bytes only (numpy and the CUDA driver, no MLX): the streamer's workers copy, the
engine thread decides. On unified memory (Apple silicon, the
CPU) there is one tier: the budget for this one is then 0 unless asked for, and the faces say so.
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable

import numpy as np

from tqbench.stream.cache import SlotCache

HOST_POLICY = "lru"
UNPINNED, PINNING, PINNED = 0, 1, 2  # a slot's pin state (PINNED also when pinning failed or none was asked)


class HostTier:
    """`capacity` slots of `slot_bytes` each in one anonymous mapping (pages are committed as they are written), each
    slot starting on a page of its own, and which (layer, expert) each holds. `pin` (DmaCopy.pin on CUDA): called once
    on each slot's pages before its first use (by a thread of its own, slot 0 first: SlotCache hands free slots out in
    that order), so copies to and from the GPU run at DMA speed. `close` stops that thread."""

    def __init__(self, budget_bytes: int, slot_bytes: int, pin: Callable[[np.ndarray], bool] | None = None):
        self.slot_bytes = slot_bytes
        self.capacity = budget_bytes // slot_bytes
        if self.capacity < 1:
            raise ValueError(f"a host tier of {budget_bytes:,} bytes cannot hold one expert ({slot_bytes:,} bytes)")
        self.cache = SlotCache(self.capacity, HOST_POLICY)
        stride = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # page-aligned slots: each pinned on its own
        self.arena = np.frombuffer(mmap.mmap(-1, self.capacity * stride), dtype=np.uint8).reshape(self.capacity, stride)
        self.pin = pin
        self.admitted = 0  # experts moved here from a GPU slot
        self.dropped = 0  # experts evicted from here (gone from both tiers)
        self._pin_state = np.full(self.capacity, PINNED if pin is None else UNPINNED, dtype=np.uint8)
        self._pin_changed = threading.Condition()
        self._closing = False
        self._pinner = None
        if pin is not None:
            self._pinner = threading.Thread(target=self._pin_ahead, name="tqbench-pin", daemon=True)
            self._pinner.start()

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def bytes_held(self) -> int:
        return len(self.cache) * self.slot_bytes

    def slot(self, index: int, nbytes: int) -> np.ndarray:
        """A host slot's first `nbytes`: an expert's buffer, laid out as the store reads it (part offsets from 0).
        Engine thread: a slot not pinned yet is pinned here first (or waited for, if the pinning thread has it)."""
        if self._pin_state[index] != PINNED:
            self._pin_slot(index)
        return self.arena[index, :nbytes]

    def _pin_slot(self, index: int) -> None:
        with self._pin_changed:
            if self._pin_state[index] == PINNING:
                self._pin_changed.wait_for(lambda: self._pin_state[index] == PINNED)
            if self._pin_state[index] == PINNED:
                return
            self._pin_state[index] = PINNING
        try:
            self.pin(self.arena[index])  # tried once: a slot that could not be pinned still copies, slower
        finally:
            with self._pin_changed:
                self._pin_state[index] = PINNED
                self._pin_changed.notify_all()

    def _pin_ahead(self) -> None:
        for index in range(self.capacity):
            if self._closing:
                return
            self._pin_slot(index)

    def close(self) -> None:
        """Stop pinning ahead (the slots pinned so far stay pinned until DmaCopy.unpin_all)."""
        self._closing = True
        if self._pinner is not None:
            self._pinner.join()

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

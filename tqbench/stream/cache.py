"""Which experts a slot pool holds: a fixed number of slots, a replacement policy, a pinned set. Pure bookkeeping
(no MLX, no I/O): the streamer asks where an expert is and where to put one.

Keys are (layer, expert). Policies:
- `lru`: least recently used.
- `lrfu` (the default): Least Recently/Frequently Used (Lee et al. 1999). Each key's combined recency-frequency
  value C = sum over its past accesses of 2^(-lam * age); the victim has the smallest C. With lam -> 0 it is LFU, with
  large lam LRU. C decays for every key alike, so the order is kept by the time-invariant key
  log2(C) + lam * t_last, in a heap (lazy deletion): O(log n) per access and per eviction.
Ages count forward passes (tokens), so lam = 0.01 halves an access's weight after 100 tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable, Iterable

Key = tuple[int, int]  # (layer, expert)


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable, now: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch_cold(self, key: Hashable, now: int) -> None:
        """Resident, but first in line for eviction (an expert only a prefill needed)."""
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, locked: set) -> Hashable | None:
        for key in self._order:
            if key not in locked:
                return key
        return None


class LRFU:
    """Keeps the combined value of every key it has seen, resident or not (an expert evicted and needed again comes
    back with its history: without it a frequent expert evicted once competes as a newcomer and LRFU degrades to
    FIFO). History is one small entry per (layer, expert) of the model."""

    name = "lrfu"

    def __init__(self, lam: float = 0.01) -> None:
        self.lam = lam
        self._state: dict[Hashable, tuple[float, int]] = {}  # key -> (log2 C at t_last, t_last)
        self._resident: set[Hashable] = set()
        self._cold: set[Hashable] = set()  # resident keys only a prefill has used
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def _priority(self, key: Hashable) -> float:
        log_c, t = self._state[key]
        return log_c + self.lam * t

    def touch(self, key: Hashable, now: int) -> None:
        old = self._state.get(key)
        if old is None:
            log_c = 0.0  # C = 1
        else:
            log_c0, t0 = old
            decayed = log_c0 - self.lam * (now - t0)  # log2 of C * 2^(-lam * age)
            log_c = math.log2(1.0 + 2.0 ** decayed) if decayed > -60 else 0.0
        self._state[key] = (log_c, now)
        self._resident.add(key)
        self._cold.discard(key)
        self._seq += 1
        heapq.heappush(self._heap, (log_c + self.lam * now, self._seq, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries now and then
            self._heap = [(-1e18 if k in self._cold else self._priority(k), i, k) for i, k in enumerate(self._resident)]
            heapq.heapify(self._heap)

    def touch_cold(self, key: Hashable, now: int) -> None:
        """Resident, but first in line for eviction; its history (if any) is kept for when decode needs it."""
        self._resident.add(key)
        self._seq += 1
        heapq.heappush(self._heap, (-1e18, self._seq, key))  # below every real priority until touched
        self._cold.add(key)

    def remove(self, key: Hashable) -> None:
        self._resident.discard(key)
        self._cold.discard(key)

    def victim(self, locked: set) -> Hashable | None:
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            prio, _, key = item
            if key not in self._resident:
                continue  # stale
            if key in self._cold:
                if prio != -1e18:
                    continue  # an older entry of a key that is cold now
            elif key not in self._state or abs(self._priority(key) - prio) > 1e-9:
                continue  # stale
            skipped.append(item)  # it stays in the heap until it is removed
            if key not in locked:
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


POLICIES = {"lru": LRU, "lrfu": LRFU}


class SlotCache:
    """`capacity` slots; a key is resident in one slot. Pinned keys are never evicted."""

    def __init__(self, capacity: int, policy: str = "lrfu") -> None:
        if capacity < 1:
            raise ValueError("a slot cache needs at least one slot")
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}: choose {', '.join(POLICIES)}")
        self.capacity = capacity
        self.policy = POLICIES[policy]()
        self.slots: dict[Hashable, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.pinned: set[Hashable] = set()
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, key: Hashable, now: int, touch: bool = True) -> int | None:
        """The key's slot, or None; `touch` False leaves the policy as it was (a prefill's hits)."""
        slot = self.slots.get(key)
        if slot is not None and touch:
            self.policy.touch(key, now)
        return slot

    def place(self, key: Hashable, now: int, locked: set, cold: bool = False) -> tuple[int, Hashable | None]:
        """A slot for `key` (not resident): a free one, else the policy's victim among keys not locked or pinned.
        `cold`: admitted for a prefill, first in line for eviction, so a long prompt does not push out the decode
        working set. Returns (slot, evicted key or None)."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.policy.victim(locked | self.pinned)
            if evicted is None:
                raise RuntimeError("every slot is locked or pinned: no room for another expert")
            slot = self.slots.pop(evicted)
            self.policy.remove(evicted)
            self.evictions += 1
        self.slots[key] = slot
        if cold:
            self.policy.touch_cold(key, now)
        else:
            self.policy.touch(key, now)
        return slot, evicted

    def drop(self, key: Hashable) -> None:
        """Forget a resident key and free its slot (a placement whose data never arrived)."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.policy.remove(key)
            self.free.append(slot)

    def pin(self, keys: Iterable[Hashable]) -> None:
        self.pinned.update(keys)

    def seed(self, weights: dict[Hashable, float]) -> None:
        """Start the policy's history from known use (a profile's counts, scaled to the hottest = 8 accesses);
        LRU has no history to seed."""
        if isinstance(self.policy, LRFU) and weights:
            top = max(weights.values())
            for key, w in weights.items():
                if w > 0 and key not in self.policy._state:
                    self.policy._state[key] = (math.log2(8 * w / top), 0)

"""Which experts a slot pool holds: a fixed number of slots, a replacement policy, a pinned set. Pure bookkeeping
(no MLX, no I/O): the streamer asks where an expert is and where to put one.

Keys are (layer, expert). The replacement policies (`lru`, `lrfu`, `lrfu-next`, the default) are
tqbench/stream/policies.py's.
"""

from __future__ import annotations

from typing import Hashable, Iterable

from tqbench.stream.policies import DEFAULT_POLICY, make_policy

Key = tuple[int, int]  # (layer, expert)


class SlotCache:
    """`capacity` slots; a key is resident in one slot. Pinned keys are never evicted."""

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY) -> None:
        if capacity < 1:
            raise ValueError("a slot cache needs at least one slot")
        self.policy = make_policy(policy)
        self.capacity = capacity
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
            evicted = self.policy.victim(locked | self.pinned, now)
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

    def lookup_many(self, keys: list, now: int, touch: bool = True) -> list[int | None]:
        """lookup() of distinct keys (one layer's routed experts), the hits touched together."""
        slots = [self.slots.get(k) for k in keys]
        if touch:
            hits = [k for k, s in zip(keys, slots) if s is not None]
            if hits:
                self.policy.touch_many(hits, now)
        return slots

    def place_many(self, keys: list, now: int, locked: set, cold: bool = False,
                   evicted: list | None = None) -> list[int]:
        """Slots for distinct keys that are not resident (one layer's misses), as place() for each in turn gives them
        (free slots first, then the policy's victims' slots in order), with the victims chosen in one pass before any
        of the keys is touched. Refuses (RuntimeError) before changing anything when there is not room for all.
        `evicted`, if given, is extended with the key each slot held before (None for a free slot)."""
        need = len(keys) - len(self.free)
        victims = self.policy.victims(locked | self.pinned, need, now) if need > 0 else []
        if len(victims) < need:
            raise RuntimeError("every slot is locked or pinned: no room for another expert")
        if evicted is not None:
            evicted.extend([None] * (len(keys) - len(victims)) + victims)
        slots = [self.free.pop() for _ in range(len(keys) - len(victims))]
        for key in victims:
            slots.append(self.slots.pop(key))
            self.policy.remove(key)
            self.evictions += 1
        self.slots.update(zip(keys, slots))
        if cold:
            for key in keys:
                self.policy.touch_cold(key, now)
        else:
            self.policy.touch_many(keys, now)
        return slots

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
        seed = getattr(self.policy, "seed", None)
        if seed is not None and weights:
            seed(weights)

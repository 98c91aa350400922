"""Replacement policies for a slot pool (tqbench/stream/cache.py: SlotCache): which resident key to evict. Pure
bookkeeping (no MLX, no I/O).

Keys are (layer, expert). Policies:
- `lru`: least recently used.
- `lrfu`: Least Recently/Frequently Used (Lee et al. 1999). Each key's combined recency-frequency
  value C = sum over its past accesses of 2^(-lam * age); the victim has the smallest C. With lam -> 0 it is LFU, with
  large lam LRU. C decays for every key alike, so the order is kept by the time-invariant key
  log2(C) + lam * t_last, in a heap (lazy deletion): O(log n) per access and per eviction.
- `lrfu-next` (the default): LRFU at lam 0.02, plus a slow LRFU value (lam 0.001: what the session routes often),
  plus how likely each key is to be routed at its layer's next token, from counts (per layer, learned online from
  decode) of which experts followed which from one token to the next (NextLRFU). One O(resident keys) numpy pass per
  layer call for all of its misses (`SlotCache.place_many`), 2 bytes x experts^2 per layer of counts. On the shipped
  demo's code and chat routing it hits more than `lrfu` at every budget tried and beats the best fixed set at all of
  them (benchmarks/policies.py); its bookkeeping costs 2-3x `lrfu`'s (benchmarks/policy_cost.py: 12-16 ms a token at
  Kimi K3's scale on a 2-core CPU, against the ~8 ms one missed expert takes to read).
Ages count forward passes (tokens), so lam = 0.01 halves an access's weight after 100 tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable

import numpy as np


def one_more_access(log_c: float, age: int, lam: float) -> float:
    """log2 of an LRFU combined value after one more access: 2^log_c decayed by 2^(-lam * age), plus 1 (C = 1 once the
    decayed history is below 2^-60)."""
    decayed = log_c - lam * age
    return math.log2(1.0 + 2.0 ** decayed) if decayed > -60 else 0.0


def seed_values(weights: dict[Hashable, float], known) -> dict[Hashable, float]:
    """log2 of a seeded combined value for each key with positive weight and no history in `known`: the heaviest
    counts as 8 accesses, the others in proportion."""
    if not weights:
        return {}
    top = max(weights.values())
    return {k: math.log2(8 * w / top) for k, w in weights.items() if w > 0 and k not in known}


class _OneByOne:
    """`touch_many` and `victims` for policies whose order of the other keys a touch does not change (LRU, LRFU): the
    same as touching, and choosing victims, one key at a time."""

    def touch_many(self, keys: list, now: int) -> None:
        for key in keys:
            self.touch(key, now)

    def victims(self, locked: set, count: int, now: int | None = None) -> list:
        """Up to `count` keys to evict, in order, none of them in `locked`."""
        chosen: list = []
        locked = set(locked)
        for _ in range(count):
            key = self.victim(locked, now)
            if key is None:
                break
            chosen.append(key)
            locked.add(key)
        return chosen


class LRU(_OneByOne):
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

    def victim(self, locked: set, now: int | None = None) -> Hashable | None:
        for key in self._order:
            if key not in locked:
                return key
        return None


class LRFU(_OneByOne):
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
            log_c = one_more_access(old[0], now - old[1], self.lam)
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

    def seed(self, weights: dict[Hashable, float]) -> None:
        """History for keys without one, from known use (`SlotCache.seed`): C = 8 accesses for the heaviest."""
        for key, c in seed_values(weights, self._state).items():
            self._state[key] = (c, 0)

    def _valid(self, item: tuple[float, int, Hashable]) -> bool:
        """A heap entry that is the key's current one (resident, and cold or at its current priority)."""
        prio, _, key = item
        if key not in self._resident:
            return False
        if key in self._cold:
            return prio == -1e18  # else an older entry of a key that is cold now
        return key in self._state and abs(self._priority(key) - prio) <= 1e-9

    def victim(self, locked: set, now: int | None = None) -> Hashable | None:
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            key = item[2]
            if not self._valid(item):
                continue  # stale
            skipped.append(item)  # it stays in the heap until it is removed
            if key not in locked:
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


class _Layer:
    """One layer's routing history for NextLRFU: the experts of its latest tick (`cur`) and of the tick before
    (`prev`), `counts[a, b]`: the ticks where b followed a (a routed at the layer's tick t - 1, b at t), `uses[a]`: a's
    ticks. The prediction, the mean over a in `cur` of counts[a] / uses[a], is computed when asked for (one product
    of a row vector with `cur`'s rows), not on every touch: a layer is touched once per routed expert and asked once
    per eviction."""

    def __init__(self, index: int) -> None:
        self.index = index  # its row in NextLRFU._p
        self.tick: int | None = None
        self.cur: list[int] = []
        self.cur_set: set[int] = set()
        self.prev_tick: int | None = None
        self.prev = np.zeros(0, dtype=np.intp)
        self.counts = np.zeros((0, 0), dtype=np.uint16)
        self.uses = np.zeros(0, dtype=np.int64)

    def grow(self, expert: int) -> None:
        n = -(-(expert + 1) // 64) * 64  # experts 0..expert fit, in steps of 64
        counts = np.zeros((n, n), dtype=np.uint16)
        m = len(self.uses)
        counts[:m, :m] = self.counts
        self.counts = counts
        self.uses = np.concatenate([self.uses, np.zeros(n - m, dtype=np.int64)])

    def learn(self, e: int, now: int, halve_at: int) -> None:
        if self.tick != now:  # the first touch at this tick: the latest routing becomes the previous one
            self.prev_tick, self.prev = self.tick, np.array(self.cur, dtype=np.intp)
            self.tick, self.cur, self.cur_set = now, [], set()
        if e in self.cur_set:
            return
        if e >= len(self.uses):
            self.grow(e)
        self.uses[e] += 1
        if self.prev_tick == now - 1 and len(self.prev):
            self.counts[self.prev, e] += 1
        self.cur.append(e)
        self.cur_set.add(e)
        if self.uses[e] >= halve_at:
            self.counts[e] //= 2
            self.uses[e] //= 2

    def learn_many(self, experts: list[int], now: int, halve_at: int) -> None:
        """learn() for each of `experts` at tick `now`, in one pass (counts[a, e] does not depend on e's order)."""
        if self.tick != now:
            self.prev_tick, self.prev = self.tick, np.array(self.cur, dtype=np.intp)
            self.tick, self.cur, self.cur_set = now, [], set()
        new = [e for e in dict.fromkeys(experts) if e not in self.cur_set]
        if not new:
            return
        if max(new) >= len(self.uses):
            self.grow(max(new))
        cols = np.array(new, dtype=np.intp)
        if (self.uses[cols] + 1 >= halve_at).any():  # a row is halved between two updates: keep learn()'s order
            for e in new:
                self.learn(e, now, halve_at)
            return
        self.uses[cols] += 1
        if self.prev_tick == now - 1 and len(self.prev):
            self.counts[self.prev[:, None], cols] += 1
        self.cur.extend(new)
        self.cur_set.update(new)

    def predicted(self) -> np.ndarray:
        """Per expert, the mean over the experts `a` of `cur` of counts[a, e] / uses[a]."""
        if not self.cur:
            return np.zeros(len(self.uses))
        rows = np.array(self.cur, dtype=np.intp)
        return (1.0 / self.uses[rows]) @ self.counts[rows] / len(rows)


class NextLRFU:
    """LRFU on two time scales plus a first-order prediction of each layer's next routing. A key (layer, expert) is
    valued V = C(now) + mu * C_slow(now) + beta * p and the victim has the smallest V (cold keys still go first, oldest
    first; ties go to the least recently touched):
    - C: LRFU's combined value at `lam`; C_slow the same at `lam_slow`, a long memory of what the session routes often,
      weighted by mu (default lam_slow / lam: a key routed at a steady rate gets the same from both);
    - p: the mean over the experts `a` of the key's layer's latest tick of counts[a, e] / uses[a], the share of a's
      ticks that e followed (counted from decode touches only, see `_Layer`); keys that are not (layer, int expert)
      get p = 0.
    History (C, C_slow, the counts) is kept for every key seen, resident or not. V changes with time at two rates and
    with every routing, so the victim is an exact minimum over the resident keys, computed with numpy on per-row arrays
    (O(resident keys) per eviction). With mu = beta = 0 it evicts what `lrfu` evicts. Counts are uint16: a source's
    row and its uses are halved when its uses reach 2^15, so no count overflows."""

    name = "lrfu-next"
    HALVE_AT = 1 << 15

    def __init__(self, lam: float = 0.02, beta: float = 100.0, lam_slow: float = 0.001,
                 mu: float | None = None) -> None:
        self.lam = lam
        self.beta = beta
        self.lam_slow = lam_slow
        self.mu = (lam_slow / lam if lam > 0 else 0.0) if mu is None else mu
        self._state: dict[Hashable, tuple[float, int]] = {}  # key -> (log2 C at t_last, t_last)
        self._slow: dict[Hashable, float] = {}  # key -> log2 C_slow at t_last
        self._layers: dict[Hashable, _Layer] = {}
        self._p = np.zeros((0, 0))  # per layer row, per expert: p
        self._width = 0  # the widest layer's experts
        self._stale: set[_Layer] = set()  # layers whose row of _p is out of date
        self._moved: set[int] = set()  # layers (rows of _p) whose p moved since _v was computed
        self._now = 0
        self._seq = 0
        # resident keys, one row each
        self._row: dict[Hashable, int] = {}
        n = 64
        self._keys: list[Hashable | None] = [None] * n
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._log_c = np.zeros(n)
        self._log_s = np.zeros(n)
        self._t = np.zeros(n)
        self._last = np.zeros(n)  # the sequence number of the row's latest touch (ties, and cold order)
        self._layer = np.full(n, -1, dtype=np.intp)  # row in _p, -1: no prediction
        self._expert = np.zeros(n, dtype=np.intp)
        self._cold = np.zeros(n, dtype=bool)
        self._used = np.zeros(n, dtype=bool)
        self._ncold = 0  # rows with _cold set
        # V per row at tick _v_now (inf: no key), kept between evictions of one tick: rows touched since (_dirty)
        # and rows of layers whose prediction moved are recomputed, the rest still hold
        self._v = np.full(n, np.inf)
        self._v_now: int | None = None
        self._dirty: list[int] = []

    # ---- history ----

    def seed(self, weights: dict[Hashable, float]) -> None:
        """History for keys without one, from known use (`SlotCache.seed`): C = C_slow = 8 accesses for the heaviest."""
        for key, c in seed_values(weights, self._state).items():
            self._state[key] = (c, 0)
            self._slow[key] = c

    def _layer_of(self, layer: Hashable) -> _Layer:
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = _Layer(len(self._layers))
            self._stale.add(st)
        return st

    def _learn(self, key: Hashable, now: int) -> None:
        """Count what followed what in the key's layer (a decode touch)."""
        st = self._layer_of(key[0])
        st.learn(int(key[1]), now, self.HALVE_AT)
        self._width = max(self._width, len(st.uses))
        self._stale.add(st)
        self._moved.add(st.index)

    def predicted(self, key: Hashable) -> float:
        """p: how likely `key` is routed at its layer's next tick, from the layer's latest routing."""
        st = self._layers.get(key[0]) if _layer_key(key) else None
        if st is None or not st.cur or int(key[1]) >= len(st.uses):
            return 0.0
        return float(st.predicted()[int(key[1])])

    def value(self, key: Hashable, now: int) -> float:
        """V = C(now) + mu * C_slow(now) + beta * p of a key with history."""
        log_c, t = self._state[key]
        return (2.0 ** (log_c - self.lam * (now - t)) + self.mu * 2.0 ** (self._slow[key] - self.lam_slow * (now - t))
                + self.beta * self.predicted(key))

    # ---- rows ----

    def _place(self, key: Hashable) -> int:
        row = self._row.get(key)
        if row is not None:
            return row
        if not self._free:
            n = len(self._used)
            fill = {"_layer": -1, "_v": np.inf}
            for name in ("_log_c", "_log_s", "_t", "_last", "_layer", "_expert", "_cold", "_used", "_v"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.full(n, fill.get(name, 0), dtype=a.dtype)]))
            self._keys.extend([None] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self._dirty.append(row)
        self._row[key] = row
        self._keys[row] = key
        self._used[row] = True
        st = self._layer_of(key[0]) if _layer_key(key) else None
        self._layer[row] = st.index if st is not None else -1
        self._expert[row] = int(key[1]) if st is not None else 0
        if st is not None:
            self._width = max(self._width, int(key[1]) + 1)  # _p has a column for every resident expert
        return row

    def touch(self, key: Hashable, now: int) -> None:
        old = self._state.get(key)
        if old is None:
            log_c = log_s = 0.0
        else:
            log_c = one_more_access(old[0], now - old[1], self.lam)
            log_s = one_more_access(self._slow[key], now - old[1], self.lam_slow)
        self._state[key] = (log_c, now)
        self._slow[key] = log_s
        if now > self._now:
            self._now = now
        row = self._place(key)
        self._seq += 1
        self._log_c[row], self._log_s[row], self._t[row] = log_c, log_s, now
        self._last[row] = self._seq
        self._ncold -= int(self._cold[row])
        self._cold[row] = False
        self._dirty.append(row)
        if _layer_key(key):
            self._learn(key, now)

    def touch_many(self, keys: list, now: int) -> None:
        """touch() for each of `keys`, with the arithmetic and the learning done once for all of them."""
        if len(keys) < 4 or len(set(keys)) != len(keys):  # a few keys: numpy's per-call cost outweighs the loop
            for key in keys:
                self.touch(key, now)
            return
        if now > self._now:
            self._now = now
        olds = [self._state.get(k) for k in keys]
        known = np.array([o is not None for o in olds])
        age = now - np.array([o[1] if o else now for o in olds], dtype=np.float64)
        log_c = _accumulate(np.array([o[0] if o else 0.0 for o in olds]) - self.lam * age, known)
        log_s = _accumulate(np.array([self._slow[k] if o else 0.0 for k, o in zip(keys, olds)])
                            - self.lam_slow * age, known)
        rows = np.array([self._place(k) for k in keys], dtype=np.intp)
        for key, c, c_slow in zip(keys, log_c.tolist(), log_s.tolist()):
            self._state[key] = (c, now)
            self._slow[key] = c_slow
        self._log_c[rows], self._log_s[rows], self._t[rows] = log_c, log_s, now
        self._last[rows] = self._seq + 1 + np.arange(len(keys))
        self._seq += len(keys)
        self._ncold -= int(self._cold[rows].sum())
        self._cold[rows] = False
        self._dirty.extend(rows.tolist())
        by_layer: dict[Hashable, list[int]] = {}
        for key in keys:
            if _layer_key(key):
                by_layer.setdefault(key[0], []).append(int(key[1]))
        for layer, experts in by_layer.items():
            st = self._layer_of(layer)
            st.learn_many(experts, now, self.HALVE_AT)
            self._width = max(self._width, len(st.uses))
            self._stale.add(st)
            self._moved.add(st.index)

    def touch_cold(self, key: Hashable, now: int) -> None:
        """Resident, but first in line for eviction; its history (if any) is kept for when decode needs it."""
        row = self._place(key)
        self._seq += 1
        self._last[row] = self._seq
        self._ncold += int(not self._cold[row])
        self._cold[row] = True

    def remove(self, key: Hashable) -> None:
        row = self._row.pop(key, None)
        if row is not None:
            self._used[row] = False
            self._ncold -= int(self._cold[row])
            self._cold[row] = False
            self._keys[row] = None
            self._free.append(row)
            self._dirty.append(row)

    def _values(self, rows: np.ndarray, now: int) -> np.ndarray:
        """V of `rows` at `now` (inf where no key)."""
        age = now - self._t[rows]
        v = np.exp2(self._log_c[rows] - self.lam * age)
        if self.mu:
            v += self.mu * np.exp2(self._log_s[rows] - self.lam_slow * age)
        if self.beta and self._layers:
            lay = self._layer[rows]
            has = lay >= 0
            if has.any():
                v[has] += self.beta * self._p[lay[has], self._expert[rows][has]]
        v[~self._used[rows]] = np.inf
        return v

    def victims(self, locked: set, count: int, now: int | None = None) -> list:
        """Up to `count` keys to evict, in order, none in `locked`: cold keys first (oldest first), then the smallest V
        (ties: the least recently touched). What `count` calls of victim(), each removing its key, would choose if
        nothing were touched in between; one pass over the resident rows for all of them."""
        now = self._now if now is None else now
        rows_locked = np.array([r for r in (self._row.get(k) for k in locked) if r is not None], dtype=np.intp)
        chosen: list[int] = []
        if self._ncold:
            cold = self._cold.copy()
            cold[rows_locked] = False
            rows = np.flatnonzero(cold)
            chosen = rows[np.argsort(self._last[rows], kind="stable")][:count].tolist()
        need = count - len(chosen)
        if need > 0:
            v = self._current_values(now).copy()
            v[rows_locked] = np.inf
            v[chosen] = np.inf
            cand = np.flatnonzero(v < np.inf)
            if len(cand) > need:  # the `need` smallest, and every row tied with the last of them
                kth = np.partition(v[cand], need - 1)[need - 1]
                cand = cand[v[cand] <= kth]
            chosen += cand[np.lexsort((self._last[cand], v[cand]))][:need].tolist()
        return [self._keys[r] for r in chosen]

    def victim(self, locked: set, now: int | None = None) -> Hashable | None:
        found = self.victims(locked, 1, now)
        return found[0] if found else None

    def _current_values(self, now: int) -> np.ndarray:
        """V of every row at `now` (inf where no key): recomputed whole at a new tick, else only the rows touched since
        and the rows of layers whose prediction moved."""
        if self.beta and self._layers:
            self._refresh()
        if self._v_now != now:
            self._v = self._values(np.arange(len(self._used)), now)
            self._v_now = now
        else:
            rows = self._dirty
            if self._moved:  # usually one layer: the one being routed
                moved = [np.flatnonzero(self._layer == i) for i in self._moved]
                rows = np.concatenate([*moved, np.asarray(rows, dtype=np.intp)])
            if len(rows):
                rows = np.asarray(rows, dtype=np.intp)
                self._v[rows] = self._values(rows, now)
        self._moved = set()
        self._dirty = []
        return self._v

    def _refresh(self) -> None:
        """Bring `_p` up to date: one row per layer, a column per expert (as wide as the widest layer)."""
        if self._p.shape != (len(self._layers), self._width):
            p = np.zeros((len(self._layers), self._width))
            p[: self._p.shape[0], : self._p.shape[1]] = self._p
            self._p = p
        for st in self._stale:
            self._p[st.index, : len(st.uses)] = st.predicted()
        self._stale = set()


def _accumulate(decayed: np.ndarray, known: np.ndarray) -> np.ndarray:
    """log2(1 + 2^decayed): one more access on a decayed combined value; 0 (C = 1) for keys without history or whose
    history has decayed below 2^-60, as touch() does."""
    out = np.zeros(len(decayed))
    keep = known & (decayed > -60)
    out[keep] = np.log2(1.0 + np.exp2(decayed[keep]))
    return out


def _layer_key(key: Hashable) -> bool:
    """A (layer, int expert) key, the kind NextLRFU predicts."""
    return isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], (int, np.integer)) and key[1] >= 0


POLICIES = {"lru": LRU, "lrfu": LRFU, "lrfu-next": NextLRFU}
DEFAULT_POLICY = "lrfu-next"  # hits more than lrfu at every budget measured, for 2-3x its bookkeeping


def make_policy(name: str):
    """A new policy of the name `name` (a key of POLICIES)."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}: choose {', '.join(POLICIES)}")
    return POLICIES[name]()

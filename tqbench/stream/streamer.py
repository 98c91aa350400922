"""Expert streaming on the engine thread: slot pools in MLX memory, a byte budget, reads and slot copies by worker
threads (they only move bytes; every MLX call, and the GPU prefetch of a written slot, stays on the engine thread).

Each MoE layer's SwitchGLU keeps its own code: its projections' per-expert arrays (weight, scales, biases) are
replaced by slot pools shared by every layer of the same shapes, and the layer is called with slot numbers instead of
expert numbers. So a streamed layer computes exactly what the resident one does, expert for expert. Page-ins write
straight into a pool slot's memory (tqbench/managed.py); nothing is stacked or copied per token.

The budget covers the pools and the staging buffers reads land in (two per worker): nothing is held outside it.
When a layer needs more distinct experts than the pool has slots (a small budget, a long prefill), it runs in
chunks of experts, each chunk's rows selected exactly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from tqbench.events import PageIn
from tqbench.managed import GpuPrefetch, host_view
from tqbench.stream.cache import DEFAULT_POLICY, SlotCache
from tqbench.stream.host import HostTier
from tqbench.stream.stats import LayerTotals, StreamStats
from tqbench.stream.store import ExpertStore, LayerLayout, StoreError, aligned_buffer, part_array

MLX_DTYPES = {"U32": mx.uint32, "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "U8": mx.uint8}


@dataclass(frozen=True)
class StreamConfig:
    budget_bytes: int
    workers: int = 4
    policy: str = DEFAULT_POLICY
    fanout: bool = False  # split one expert's read into several parallel reads
    page_cache: str = "auto"  # "on": buffered reads; "off": bypass (O_DIRECT / F_NOCACHE); "auto": off when the
    # model's files exceed 60% of physical memory (the page cache would only churn), else on
    max_array_bytes: int = 1 << 30  # no slot pool array larger than this (CUDA gathers fail past 2 GiB)
    max_pool_slots: int = 1024  # no pool with more slots (MLX's CUDA gather_mm takes at most 1,024 matrices)
    lookahead: bool = False  # during decode, read layer L+1's likely experts (its router on layer L's input)
    reads_in_flight: int = 0  # at most this many reads at once (0: one per worker); the workers' copies into the
    # slots still run in parallel. Some disks read one request at a time fastest (the lent H200's: random experts at
    # 2.35 GB/s with one reader, 1.62 with four), and a worker that reads then copies leaves the disk idle meanwhile.
    host_budget_bytes: int = 0  # a host-RAM tier for experts evicted from the pools (tqbench.stream.host; 0: none)
    cache_routing: float = 0.0  # margin: in decode, a resident expert within this selection score of an uncached
    # one may take its place (attach.CacheRoutedBlock; 0: off, the model's own routing, untouched)


def read_buffers(workers: int) -> int:
    """Staging buffers for `workers` read threads: two each, so a worker starts its next read while its last one is
    still being copied into a slot (with one each, a layer's fifth miss on four workers waited for a read and a copy).
    The budget counts them: `staging_bytes(...)`."""
    return 2 * max(1, workers)


def staging_bytes(buffer_bytes: int, workers: int) -> int:
    """The budget's staging share: read_buffers(workers) buffers of `buffer_bytes` (ExpertStore.buffer_bytes of the
    largest expert: its bytes, plus 2 * ALIGN for O_DIRECT reads)."""
    return read_buffers(workers) * buffer_bytes


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


class Streamer:
    def __init__(self, store: ExpertStore, config: StreamConfig):
        self.store = store
        self.config = config
        layouts = store.layers
        if not layouts:
            raise StoreError("no routed experts to stream", store.root)
        if config.page_cache not in ("auto", "on", "off"):
            raise ValueError(f"page_cache must be auto, on or off, not {config.page_cache!r}")
        self.direct = store.set_direct(config.page_cache == "off" or (config.page_cache == "auto" and
                                                                       _much_larger_than_ram(store)))
        biggest = max(store.buffer_bytes(n) for n in layouts)
        workers = max(1, config.workers)
        staging = staging_bytes(biggest, workers)
        self.stats = StreamStats(budget_bytes=config.budget_bytes, staging_bytes=staging,
                                 page_cache="off" if self.direct else "on", cache_routing=config.cache_routing)
        # Pools per signature; the budget left after staging is shared in proportion to the experts' bytes. No pool
        # array may exceed config.max_array_bytes (MLX's CUDA gather kernels fail on arrays over 2 GiB), nor hold more
        # than config.max_pool_slots slots (its gather_mm takes at most 1,024 matrices): a signature whose slots would
        # is split into pools that each serve a contiguous run of layers.
        groups: dict[tuple, list[LayerLayout]] = {}
        for lay in layouts.values():
            groups.setdefault(lay.signature, []).append(lay)
        total = sum(len(g) * g[0].nbytes * g[0].experts for g in groups.values())
        room = config.budget_bytes - staging
        self.pools: list[Pool] = []
        self.prefetch = GpuPrefetch()  # CUDA: slot writes migrate to the GPU in bulk
        self.pool_of: dict[int, Pool] = {}
        for group in groups.values():
            group.sort(key=lambda lay: lay.layer)
            per = group[0]
            share = room * len(group) * per.nbytes * per.experts / total
            slots = min(int(share // per.nbytes), len(group) * per.experts)
            if slots < 1:
                raise StoreError(f"the cache budget ({config.budget_bytes:,} bytes) cannot hold one expert "
                                 f"({per.nbytes:,} bytes) plus {read_buffers(workers)} read buffers "
                                 f"({staging:,} bytes)", store.root)
            widest = max(p.nbytes for p in per.parts)  # bytes per slot of the pool's largest array
            cap = min(config.max_array_bytes // widest, config.max_pool_slots)  # slots one pool may have
            if cap < 1:
                raise StoreError(f"one expert's array ({widest:,} bytes) exceeds the pool array limit", store.root)
            n = min(len(group), -(-slots // cap))
            bounds = [i * len(group) // n for i in range(n + 1)]
            # at least one slot per pool, the rest in proportion to the pool's layers
            alloc = [1 + (slots - n) * (bounds[i + 1] - bounds[i]) // len(group) for i in range(n)]
            alloc[-1] += slots - sum(alloc)
            for i in range(n):
                pool = Pool(per, max(1, min(alloc[i], cap)), config.policy, self.prefetch)
                self.pools.append(pool)
                for lay in group[bounds[i]:bounds[i + 1]]:
                    self.pool_of[lay.layer] = pool
        self.stats.slots = sum(p.slots for p in self.pools)
        self.stats.slot_bytes = sum(p.slots * p.nbytes for p in self.pools)
        self.host: HostTier | None = None
        if config.host_budget_bytes > 0:
            widest = max(lay.nbytes for lay in layouts.values())
            if config.host_budget_bytes < widest:
                raise StoreError(f"the host cache ({config.host_budget_bytes:,} bytes) cannot hold one expert "
                                 f"({widest:,} bytes)", store.root)
            self.host = HostTier(config.host_budget_bytes, widest)
            self.stats.host_budget_bytes = config.host_budget_bytes
            self.stats.host_slots = self.host.capacity
        self._workers = workers
        self._buffers = [aligned_buffer(biggest) for _ in range(read_buffers(workers))]
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tqbench-read")
        self._copier = ThreadPoolExecutor(workers, thread_name_prefix="tqbench-host") if self.host is not None else None
        depth = config.reads_in_flight
        self._gate = threading.BoundedSemaphore(depth) if 0 < depth < workers else None
        self.events: list[PageIn] = []
        self.token = 0  # forward passes so far (a decode step or a prefill chunk each)
        self._last_layer = None
        self._tick = 0
        self._prefill = False
        self._guess: tuple[int, mx.array] | None = None  # (next layer, its router's picks on this layer's input)
        self._ahead: dict[int, tuple[np.ndarray, list[Future]]] = {}  # expert -> read in flight for _ahead_layer
        self._ahead_layer: int | None = None
        self._native: dict[int, mx.array] = {}  # layer -> its router's own picks for the call cache routing changed

    # ---- a profile's pins ----

    def preload(self, ranked: list[tuple[int, int]], share: float, weights: dict | None = None) -> int:
        """Pin the hottest experts (`ranked`, hottest first) up to `share` of each pool's slots and read them now,
        outside the miss statistics (their time and bytes are reported as preload). `weights` ((layer, expert) ->
        count) seed the replacement policy's history, so the profile also ranks what stays cached. Returns the
        number of experts pinned."""
        t0 = time.perf_counter()
        caps = {id(p): int(p.slots * share) for p in self.pools}
        chosen: dict[int, list[int]] = {}
        for layer, e in ranked:
            pool = self.pool_of.get(layer)
            if pool is None or caps[id(pool)] <= 0 or e >= self.store.layers[layer].experts:
                continue
            caps[id(pool)] -= 1
            chosen.setdefault(layer, []).append(e)
        if weights:
            for pool in self.pools:
                pool.cache.seed({k: v for k, v in weights.items() if self.pool_of.get(k[0]) is pool})
        pinned = 0
        reads = self.stats.reads
        for layer, experts in sorted(chosen.items()):
            pool = self.pool_of[layer]
            missing = [e for e in experts if (layer, e) not in pool.cache]
            slots: dict[int, int] = {}
            locked = {(layer, e) for e in experts if (layer, e) in pool.cache} | set(pool.cache.pinned)
            self.stats.preload_bytes += self.page_in(layer, pool, missing, slots, locked, timed=False)
            pool.cache.pin((layer, e) for e in experts)
            pinned += len(experts)
        self.stats.pinned = pinned
        self.stats.preload_reads, self.stats.reads = self.stats.reads - reads, reads  # not the session's reads
        self.stats.preload_s = time.perf_counter() - t0
        s = self.stats
        s.cache_bytes = sum(len(p.cache) * p.nbytes for p in self.pools)
        s.cache_bytes_max = max(s.cache_bytes_max, s.cache_bytes)
        return pinned

    # ---- look-ahead ----

    def guess(self, layer: int, indices: mx.array) -> None:
        """Called by a MoE block before it runs: `indices` are layer `layer`'s router picks computed on this block's
        input. The reads start once this block's own experts are in (run() below), so they overlap its compute."""
        if self.config.lookahead:
            self._guess = (layer, indices)

    def _start_ahead(self) -> None:
        layer, indices = self._guess
        self._guess = None
        if layer not in self.pool_of:
            return
        mx.eval(indices)
        pool = self.pool_of[layer]
        held = self.host.cache if self.host is not None else ()
        want = [int(e) for e in np.unique(np.array(indices)) if (layer, int(e)) not in pool.cache
                and (layer, int(e)) not in held]
        free = list(self._buffers)
        for e in want[: len(free)]:  # at most one read per staging buffer; the rest would wait anyway
            buf = free.pop()
            self._ahead[e] = (buf, self._submit(layer, e, buf))
        self._ahead_layer = layer
        self.stats.lookahead_reads += len(self._ahead)

    def _settle_ahead(self, layer: int, routed: list[int], pool: Pool, slots: dict[int, int], served: dict[int, str],
                      locked: set) -> tuple[int, int]:
        """Look-ahead reads for `layer`: routed experts among them go into slots ("prefetched" if the read was done
        before it was needed, else a miss that waited); the others are dropped (speculative bytes, wasted).
        Returns (bytes read on the critical path, bytes read speculatively). The copies into slots run on the workers,
        in parallel; this returns once they are done (also when a read failed: then the error is re-raised once nothing
        writes a staging buffer or a slot anymore)."""
        critical = speculative = 0
        ahead, self._ahead = self._ahead, {}
        was, self._ahead_layer = self._ahead_layer, None
        n = self.store.layers[was].nbytes if was is not None else 0
        copies: list[tuple[int, Future]] = []
        try:
            for e, (buf, fs) in ahead.items():
                in_time = all(f.done() for f in fs)
                reads = sum(f.result()[0] for f in fs)  # waits; re-raises a StoreError
                self.stats.reads += reads
                if was == layer and e in routed and e not in slots and len(locked | pool.cache.pinned) < pool.slots:
                    slot, victim = pool.cache.place((layer, e), self._tick, locked)
                    locked.add((layer, e))
                    out = self._to_host({victim: slot}, set()).get(slot, (None, None))[1] if victim else None
                    copies.append((slot, self._executor.submit(pool.move, slot, buf[self.store.shift(layer, e):],
                                                               out)))
                    slots[e] = slot
                    self.stats.lookahead_used += 1
                    if in_time:
                        served[e] = "prefetched"
                        speculative += n
                    else:
                        critical += n
                else:
                    speculative += n
            for slot, f in copies:
                f.result()
                pool.to_gpu(slot)
        except BaseException:
            wait([f for _, fs in ahead.values() for f in fs] + [f for _, f in copies])
            raise
        return critical, speculative

    # ---- cache-aware routing (attach.CacheRoutedBlock) ----

    def resident_mask(self, layer: int) -> np.ndarray:
        """1.0 for each of `layer`'s experts resident in its pool now (pinned or cached), else 0.0."""
        experts, slots = self.store.layers[layer].experts, self.pool_of[layer].cache.slots
        if len(slots) < experts:
            resident = [e for n, e in slots if n == layer]
        else:  # a pool shared by many layers: ask for this layer's experts only
            resident = [e for e in range(experts) if (layer, e) in slots]
        mask = np.zeros(experts, dtype=np.float32)
        mask[resident] = 1.0
        return mask

    def routed_natively(self, layer: int, indices: mx.array) -> None:
        """The picks `layer`'s router would have made without the boost (lazy): run() evaluates them with the routed
        indices and counts the routed experts not among them as substitutions."""
        self._native[layer] = indices

    # ---- called by the streamed layers, on the engine thread ----

    def run(self, layer: int, inner: Any, x: mx.array, indices: mx.array) -> mx.array:
        if self._last_layer is None or layer <= self._last_layer:  # layers run in order: a new forward pass
            self.token += 1
            self.stats.tokens = self.token
        self._last_layer = layer
        native = self._native.pop(layer, None)  # cache routing: the router's own picks for this call
        # also runs the layers before this one (MLX is lazy): not counted as a stall
        mx.eval(indices, *([] if native is None else [native]))
        t0 = time.perf_counter()
        ids = np.array(indices)
        if native is not None:
            self.stats.substitutions += substitutions(ids, np.array(native))
        experts = [int(e) for e in np.unique(ids)]
        pool = self.pool_of[layer]
        self._tick = self.token  # cache ages count forward passes
        # A prefill chunk (several positions) loads its experts once, as cold entries, and does not touch the
        # policy's view of what decode uses.
        self._prefill = ids.ndim >= 2 and ids.shape[-2] > 1
        slots, served = {}, {}
        found = pool.cache.lookup_many([(layer, e) for e in experts], self._tick, touch=not self._prefill)
        for e, s in zip(experts, found):
            if s is not None:
                slots[e] = s
                served[e] = "pinned" if (layer, e) in pool.cache.pinned else "cache"
        locked = {(layer, e) for e in slots}
        read_bytes = speculative = 0
        if self._ahead:
            read_bytes, speculative = self._settle_ahead(layer, experts, pool, slots, served, locked)
        missing = [e for e in experts if e not in slots]
        lut = np.zeros(self.store.layers[layer].experts, dtype=np.uint32)
        stall = 0.0
        # Pinned experts hold their slots: those of this layer that are routed are resident, the others' slots are
        # not there to be used.
        pinned = [e for e in experts if (layer, e) in pool.cache.pinned]
        room = pool.slots - len(pool.cache.pinned) + len(pinned)
        if len(experts) <= room:
            read_bytes += self.page_in(layer, pool, missing, slots, locked, served=served)
            stall = time.perf_counter() - t0
            if self._guess is not None and not self._prefill:
                self._start_ahead()  # the next layer's reads overlap this layer's compute
            self._guess = None
            for e, s in slots.items():
                lut[e] = s
            y = inner(x, mx.array(lut[ids]))
        else:  # more distinct experts than slots: chunks of experts, each chunk's rows selected exactly
            self._guess = None
            # Resident experts first: chunks holding only those read nothing, so no page-in evicts one of them
            # before its chunk runs (and the chunk that mixes both locks its residents).
            y = None
            free = max(1, pool.slots - len(pool.cache.pinned))  # preload pins at most 90% of a pool's slots
            order = [e for e in experts if e in slots and e not in pinned] + missing
            for a in range(0, len(order), free):
                chunk = order[a:a + free] + (pinned if a == 0 else [])
                chunk_slots = {e: slots[e] for e in chunk if e in slots}
                need = [e for e in chunk if e not in chunk_slots]
                t1 = time.perf_counter()
                read_bytes += self.page_in(layer, pool, need, chunk_slots, {(layer, e) for e in chunk_slots},
                                           served=served)
                stall += time.perf_counter() - t1
                for e, s in chunk_slots.items():
                    lut[e] = s
                mask = np.isin(ids, chunk)
                part = inner(x, mx.array(np.where(mask, lut[ids], 0).astype(np.uint32)))
                m = mx.expand_dims(mx.array(mask), -1)
                y = mx.where(m, part, mx.zeros_like(part) if y is None else y)
                mx.eval(y)  # before the next chunk overwrites these slots
        self.stats.speculative_bytes += speculative
        self._count(layer, experts, served, read_bytes, stall)
        return y

    def page_in(self, layer: int, pool: Pool, missing: list[int], slots: dict[int, int], locked: set,
                 timed: bool = True, served: dict[int, str] | None = None) -> int:
        """Bring `missing` experts into slots: from the host tier where it holds them (a copy), else read (in
        parallel, into the staging buffers) and written into the slot as each arrives. The slots are chosen first, in
        expert order (so evictions do not depend on which read finishes first); the experts they held go to the host
        tier, if any. On CUDA the slots' pages start moving to the host once the reads are submitted (asking costs
        ~0.4 ms an expert on the H200: asked before the reads, it delayed them), so the copies land in host memory.
        Fills `slots` (and `served` with "host" for the host tier's); returns the bytes read from disk. `timed`: add
        where the reads' time went to the stats' `miss_*` totals (a preload's page-ins are not misses)."""
        if not missing:
            return 0
        placed = sorted(missing)
        keys = [(layer, e) for e in placed]
        evicted: list = []
        slots.update(zip(placed, pool.cache.place_many(keys, self._tick, locked, cold=self._prefill,
                                                       evicted=evicted)))
        locked.update(keys)
        host = self.host
        from_host = {e: host.cache.slots[(layer, e)] for e in placed if host is not None and (layer, e) in host}
        out = self._to_host({v: slots[e] for e, v in zip(placed, evicted) if v is not None},
                            {(layer, e) for e in from_host})
        reads = [e for e in placed if e not in from_host]
        clock = _MissClock(time.perf_counter()) if timed and reads else None
        if served is not None:
            served.update((e, "host") for e in from_host)

        def to_host() -> None:  # engine thread, before its first to_gpu: the two prefetches of a slot stay in order
            t = time.perf_counter()
            for e in placed:
                pool.to_host(slots[e])
            if clock is not None:
                clock.to_host += time.perf_counter() - t

        try:
            total = self._read_into(layer, pool, reads, slots, clock, to_host,
                                    {e: host.slot(i, pool.nbytes) for e, i in from_host.items()},
                                    {slot: view for slot, (_, view) in out.items()})
            if clock is not None:
                clock.add_to(self.stats, len(reads), time.perf_counter())
        except BaseException:
            for e in placed:  # their data never arrived (or only partly): not resident
                pool.cache.drop((layer, e))
                slots.pop(e, None)
            if host is not None:  # a victim's copy may not have been made: gone, as without a host tier
                host.release([key for key, _ in out.values()])
            raise
        if host is not None:
            host.release([(layer, e) for e in from_host])  # back in a GPU slot: one tier holds an expert
        return total

    def _to_host(self, victims: dict, locked: set) -> dict[int, tuple[tuple[int, int], np.ndarray]]:
        """Host slots for experts evicted from GPU slots ({key: the GPU slot it leaves}), none evicting a key in
        `locked`. Returns {GPU slot: (the key, the host slot's bytes to copy it into)}; empty without a host tier."""
        if self.host is None or not victims:
            return {}
        taken = self.host.take(list(victims), locked)
        return {victims[k]: (k, self.host.slot(i, self.store.layers[k[0]].nbytes)) for k, i in taken.items()}

    def _read_into(self, layer: int, pool: Pool, missing: list[int], slots: dict[int, int],
                   clock: _MissClock | None = None, submitted: Callable[[], None] | None = None,
                   from_host: dict[int, np.ndarray] | None = None, out: dict[int, np.ndarray] | None = None) -> int:
        """Reads on the workers into free staging buffers; the worker that ends an expert's last read copies it into
        its slot (so copies run in parallel and overlap the other reads, and no thread hand-off comes between a read
        and its copy). Here, on the engine thread, once an expert's reads and copy are done: the slot's GPU prefetch,
        and its buffer is free again. Returns once every copy is done, so no computation reads the pool while a slot
        is written; when a read fails, the error is re-raised once every read and copy still running has ended
        (nothing writes a buffer or a slot after it), and the expert is never copied. `submitted` is called once,
        after the first reads are submitted. `from_host` ({expert: its host slot's bytes}): experts copied from the
        host tier instead of read, once `submitted` has been called; `out` ({slot: host bytes}): a slot's expert is
        copied there before its new one is copied in."""
        out = out or {}
        host_jobs: list[tuple[int, Future]] = []
        if from_host and not missing:  # else once the first reads are submitted (below)
            host_jobs = self._host_copies(pool, from_host, slots, out, submitted)
            submitted = None
        pending = deque(sorted(missing))
        free = list(self._buffers)
        # Stacked layouts (several ranges per expert, buffered reads): adjacent experts are read as runs, one scatter
        # read per tensor; runs are kept short enough that every worker gets one.
        coalesce = (len(self.store.layers[layer].extents[0]) > 1 and not self.store.direct and not self.config.fanout)
        longest = max(1, -(-len(missing) // self._workers)) if coalesce else 1
        inflight: dict[tuple[int, ...], tuple[list[np.ndarray], list[Future], list | None]] = {}
        total = 0
        n = self.store.layers[layer].nbytes
        try:
            while pending or inflight:
                while pending and free:
                    run = [pending.popleft()]
                    while pending and len(run) < min(longest, len(free)) and pending[0] == run[-1] + 1:
                        run.append(pending.popleft())
                    bufs = [free.pop() for _ in run]
                    times = None if clock is None else clock.submitted(len(run))
                    copy = _Copy(pool, [(slots[e], buf[self.store.shift(layer, e):], out.get(slots[e]))
                                        for e, buf in zip(run, bufs)])
                    if len(run) > 1:
                        futures = self._go([(self.store.read_run, layer, run, bufs)], times, copy)
                    else:
                        futures = self._submit(layer, run[0], bufs[0], times, copy)
                    inflight[tuple(run)] = (bufs, futures, times)
                if submitted is not None:
                    submitted()
                    submitted = None
                    if from_host:
                        host_jobs = self._host_copies(pool, from_host, slots, out, None)
                # only reads still running: a finished piece of a fanned-out expert must not make this spin
                running = [f for _, fs, _ in inflight.values() for f in fs if not f.done()]
                if running:
                    wait(running, return_when=FIRST_COMPLETED)
                for run in [r for r, (_, fs, _) in inflight.items() if all(f.done() for f in fs)]:
                    bufs, fs, times = inflight.pop(run)
                    done = [f.result() for f in fs]  # re-raises a StoreError from the worker
                    self.stats.reads += sum(reads for reads, _ in done)
                    gpu = sum(pool.to_gpu(slots[e]) for e in run)
                    if clock is not None:
                        clock.finished(times)
                        clock.copy += sum(copied for _, copied in done)
                        clock.to_gpu += gpu
                    total += n * len(run)
                    free.extend(bufs)
            for slot, f in host_jobs:
                self.stats.host_copy_s += f.result()
                self.stats.host_to_gpu_s += pool.to_gpu(slot)
        except BaseException:
            wait([f for _, fs, _ in inflight.values() for f in fs] + [f for _, f in host_jobs])
            raise
        return total

    def _host_copies(self, pool: Pool, from_host: dict[int, np.ndarray], slots: dict[int, int],
                     out: dict[int, np.ndarray], submitted: Callable[[], None] | None) -> list[tuple[int, Future]]:
        """Copy experts from the host tier into their slots (each slot's old expert saved first where `out` says),
        on the host tier's own threads, so they do not queue behind disk reads. Calls `submitted` first."""
        if submitted is not None:
            submitted()
        return [(slots[e], self._copier.submit(pool.move, slots[e], src, out.get(slots[e])))
                for e, src in from_host.items()]

    def _submit(self, layer: int, expert: int, buf: np.ndarray, times: list | None = None,
                copy: _Copy | None = None) -> list[Future]:
        """The reads of one expert, on the workers, then `copy` (by the worker that ends the last of them); `times`
        (timing only): each read's [submitted, started, finished] perf_counter times are appended to it (see
        _MissClock)."""
        store = self.store
        if store.direct:
            pieces = store.direct_pieces(layer, expert, self._workers if self.config.fanout else 1)
            return self._go([(store.read_direct, layer, expert, buf, [piece]) for piece in pieces], times, copy)
        if not self.config.fanout:
            return self._go([(store.read, layer, expert, buf)], times, copy)
        pieces = store.split(layer, expert, self._workers)
        return self._go([(read_pieces, store, piece, buf) for piece in pieces], times, copy)

    def _go(self, reads: list[tuple], times: list | None, copy: _Copy | None = None) -> list[Future]:
        """Submit `reads` ((fn, *args) each); each future gives (reads made, seconds spent copying)."""
        if copy is not None:
            copy.left = len(reads)
        out = []
        for fn, *args in reads:
            t = None
            if times is not None:
                t = [time.perf_counter()]
                times.append(t)
            out.append(self._executor.submit(_work, t, copy, self._gate, fn, *args))
        return out

    def _count(self, layer: int, experts: list[int], served: dict[int, str], read_bytes: int, stall: float) -> None:
        s = self.stats
        lt = s.layers.setdefault(layer, LayerTotals())
        kinds = tuple(served.get(e, "miss") for e in experts)
        hits = sum(k != "miss" for k in kinds)
        s.hits_pinned += sum(k == "pinned" for k in kinds)
        s.hits_cache += sum(k == "cache" for k in kinds)
        s.hits_prefetched += sum(k == "prefetched" for k in kinds)
        s.hits_host += sum(k == "host" for k in kinds)
        s.misses += len(kinds) - hits
        lt.hits += hits
        lt.misses += len(kinds) - hits
        lt.stall_s += stall
        s.stall_s += stall
        s.critical_bytes += read_bytes
        s.evictions = sum(p.cache.evictions for p in self.pools)
        s.cache_bytes = sum(len(p.cache) * p.nbytes for p in self.pools)
        s.cache_bytes_max = max(s.cache_bytes_max, s.cache_bytes)
        if self.host is not None:
            s.host_bytes, s.host_admitted, s.host_dropped = self.host.bytes_held, self.host.admitted, self.host.dropped
        self.events.append(PageIn(self.token, layer, tuple(experts), kinds, read_bytes, stall, s.cache_bytes))

    # ---- between tokens ----

    def drain(self) -> list[PageIn]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self.store.close()


def substitutions(routed: np.ndarray, native: np.ndarray) -> int:
    """Routed experts (..., k) that the native picks (..., k) of the same token do not hold."""
    return int((routed[..., :, None] != native[..., None, :]).all(axis=-1).sum())


def _much_larger_than_ram(store: ExpertStore) -> bool:
    from tqbench.recipe.fit import physical_memory

    total = sum((store.root / f).stat().st_size for f in store.files)
    return total > 0.6 * physical_memory()


class _Copy:
    """The copy of a read expert (or of a run's experts) from its staging buffer(s) into its slot(s), made by the
    worker that ends the last of its `left` reads (numpy only: Pool.copy_in). A read that fails does not count down,
    so an expert with a failed read is never copied."""

    __slots__ = ("pool", "into", "left", "lock")

    def __init__(self, pool: Pool, into: list[tuple[int, np.ndarray, np.ndarray | None]]):
        self.pool = pool
        self.into = into  # (slot, the expert's bytes in its staging buffer, where the slot's old expert goes or None)
        self.left = 0
        self.lock = threading.Lock()

    def after_read(self) -> float:
        with self.lock:
            self.left -= 1
            if self.left:
                return 0.0
        return sum(self.pool.move(slot, buf, out) for slot, buf, out in self.into)


def _work(t: list | None, copy: _Copy | None, gate: threading.BoundedSemaphore | None, fn, *args) -> tuple[int, float]:
    """A worker's read (once `gate`, if any, lets it: StreamConfig.reads_in_flight), then, if it ended the expert's
    last read, its copy into the slot. `t` (timing only): the read's start and end are appended to it (waiting at the
    gate counts as queueing; the engine thread reads them once the future is done; only bytes and clocks here).
    Returns (reads made, seconds spent copying)."""
    if gate is not None:
        gate.acquire()
    try:
        if t is not None:
            t.append(time.perf_counter())
        reads = fn(*args)
        if t is not None:
            t.append(time.perf_counter())
    finally:
        if gate is not None:
            gate.release()
    return reads, (copy.after_read() if copy is not None else 0.0)


class _MissClock:
    """Where one demand page-in's time went (engine thread only; the workers only fill their reads' time lists and
    return their copies' seconds). Per read: `queue` (submitted to started on a worker), `read` (the read itself),
    `buffer_wait` (the page-in's first submission to this one: an expert waits for a free staging buffer). Per expert:
    `copy` (into its slot, by the worker that ended its last read: copies run in parallel with each other and with
    the other reads), `to_gpu` and `to_host` (the prefetch calls, on the engine thread; to_host right after the first
    submissions). The page-in's wall time: `before` (entry to the first submission: slot choice), `reading` (first
    submission to the last read's end), `after` (the last read's end to the return: the copies still running,
    to_gpu)."""

    __slots__ = ("start", "first", "last_end", "queue", "read", "buffer_wait", "copy", "to_gpu", "to_host")

    def __init__(self, start: float):
        self.start = start
        self.first = self.last_end = None
        self.queue = self.read = self.buffer_wait = self.copy = self.to_gpu = self.to_host = 0.0

    def submitted(self, experts: int) -> list:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.buffer_wait += (now - self.first) * experts
        return []

    def finished(self, times: list) -> None:
        for submitted, started, ended in times:
            self.queue += started - submitted
            self.read += ended - started
            self.last_end = ended if self.last_end is None else max(self.last_end, ended)

    def add_to(self, s: StreamStats, experts: int, end: float) -> None:
        first = self.first if self.first is not None else end
        last = self.last_end if self.last_end is not None else first
        s.miss_timed += experts
        s.miss_queue_s += self.queue
        s.miss_read_s += self.read
        s.miss_buffer_wait_s += self.buffer_wait
        s.miss_copy_s += self.copy
        s.miss_to_gpu_s += self.to_gpu
        s.miss_to_host_s += self.to_host
        s.miss_before_reads_s += first - self.start
        s.miss_reading_s += last - first
        s.miss_after_reads_s += end - last


def read_pieces(store: ExpertStore, piece: list[tuple[int, int, int, int]], buf: np.ndarray) -> int:
    for file, offset, into, length in piece:
        store.read_range(file, offset, buf, into, length)
    return len(piece)

"""Expert streaming on the engine thread: slot pools in MLX memory, a byte budget, reads and slot copies by worker
threads (they only move bytes; every MLX call, and the GPU prefetch of a written slot, stays on the engine thread).

Each MoE layer's SwitchGLU keeps its own code: its projections' per-expert arrays (weight, scales, biases) are
replaced by slot pools shared by every layer of the same shapes, and the layer is called with slot numbers instead of
expert numbers. So a streamed layer computes exactly what the resident one does, expert for expert. Page-ins write
straight into a pool slot's memory (tqbench/managed.py); nothing is stacked or copied per token.

The budget covers the pools and the staging buffers reads land in (two per worker): nothing is held outside it.
When a layer needs more distinct experts than the pool has slots (a small budget, a long prefill), it runs in
chunks of experts, each chunk's rows selected exactly. A call with more tokens than ROWS_AT_ONCE (a long prompt run
layer by layer, tqbench.runtime.prefill) computes its experts' products that many tokens at a time, over the same
slots: the experts are read once, and the products' temporaries are one prefill chunk's, not the whole prompt's.

Here: the pools' sizes, a layer's call, look-ahead and cache-routing bookkeeping. A pool's arrays and slot copies are
tqbench/stream/pool.py's; the page-ins (reads, host-tier copies, their threads and staging buffers)
tqbench/stream/pagein.py's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from tqbench.events import PageIn
from tqbench.managed import DmaCopy, GpuPrefetch
from tqbench.stream.host import HostTier
from tqbench.stream.pagein import Pager, read_buffers, staging_bytes
from tqbench.stream.policies import DEFAULT_POLICY
from tqbench.stream.pool import Pool
from tqbench.stream.stats import LayerTotals, StreamStats
from tqbench.stream.store import ExpertStore, LayerLayout, StoreError


ROWS_AT_ONCE = 2048  # tokens whose expert products are computed at once: mlx-lm's prefill chunk


@dataclass(frozen=True, kw_only=True)
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
    dma_copies: bool = True  # CUDA: slots written by the copy engines from pinned memory (tqbench.managed.DmaCopy);
    # False: through the host, the slots' pages migrating both ways (the way before; benchmarks compare the two)


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
        self.prefetch = GpuPrefetch()  # CUDA without DMA copies: slot writes migrate to the GPU in bulk
        self.dma = DmaCopy(enabled=None if config.dma_copies else False)
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
                pool = Pool(per, max(1, min(alloc[i], cap)), config.policy, self.prefetch, dma=self.dma)
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
            self.host = HostTier(config.host_budget_bytes, widest, pin=self.dma.pin if self.dma.active else None)
            self.stats.host_budget_bytes = config.host_budget_bytes
            self.stats.host_slots = self.host.capacity
        self.pager = Pager(store, self.stats, self.host, workers=workers, buffer_bytes=biggest, fanout=config.fanout,
                           reads_in_flight=config.reads_in_flight)
        if self.dma.active:
            for buf in self.pager.buffers:
                self.dma.pin(buf)
        self.events: list[PageIn] = []
        self.token = 0  # forward passes so far (a decode step or a prefill chunk each)
        self._last_layer = None
        self._tick = 0
        self._prefill = False
        self._guess: tuple[int, mx.array] | None = None  # (next layer, its router's picks on this layer's input)
        self._ahead: dict[int, tuple[np.ndarray, list[Future]]] = {}  # expert -> read in flight for _ahead_layer
        self._ahead_layer: int | None = None
        self._native: dict[int, mx.array] = {}  # layer -> its router's own picks for the call cache routing changed
        # set during a layer-major prefill (tqbench.runtime.prefill): the streamed layers hand it their calls, which
        # it runs for every chunk of the prompt at once
        self.park: Callable[[int, Any, mx.array, mx.array], mx.array] | None = None

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
        free = list(self.pager.buffers)
        for e in want[: len(free)]:  # at most one read per staging buffer; the rest would wait anyway
            buf = free.pop()
            self._ahead[e] = (buf, self.pager.submit(layer, e, buf))
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
                    out = self.pager.to_host({victim: slot}, set()).get(slot, (None, None))[1] if victim else None
                    copies.append((slot, self.pager.submit_move(pool, slot, buf[self.store.shift(layer, e):], out)))
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
            read_bytes, speculative = self._settle_ahead(layer, experts, pool, slots=slots, served=served,
                                                         locked=locked)
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
            y = _in_pieces(inner, x, mx.array(lut[ids]))
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
                part = _in_pieces(inner, x, mx.array(np.where(mask, lut[ids], 0).astype(np.uint32)))
                m = mx.expand_dims(mx.array(mask), -1)
                y = mx.where(m, part, mx.zeros_like(part) if y is None else y)
                mx.eval(y)  # before the next chunk overwrites these slots
        self.stats.speculative_bytes += speculative
        self._count(layer, experts, served, read_bytes, stall)
        return y

    def page_in(self, layer: int, pool: Pool, missing: list[int], slots: dict[int, int], locked: set,
                timed: bool = True, served: dict[int, str] | None = None) -> int:
        """Pager.page_in at this forward pass (a prefill's experts cold)."""
        return self.pager.page_in(layer, pool, missing, slots=slots, locked=locked, now=self._tick, cold=self._prefill,
                                  timed=timed, served=served)

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
        if self._prefill:
            s.prefill_hits += hits
            s.prefill_misses += len(kinds) - hits
            s.prefill_bytes += read_bytes
            s.prefill_stall_s += stall
        s.evictions = sum(p.cache.evictions for p in self.pools)
        s.cache_bytes = sum(len(p.cache) * p.nbytes for p in self.pools)
        s.cache_bytes_max = max(s.cache_bytes_max, s.cache_bytes)
        if self.host is not None:
            s.host_bytes, s.host_admitted, s.host_dropped = self.host.bytes_held, self.host.admitted, self.host.dropped
        s.copies = "dma" if self.dma.active else "numpy"
        s.pinned_bytes = self.dma.pinned_bytes
        self.events.append(PageIn(token=self.token, layer=layer, experts=tuple(experts), served=kinds,
                                  bytes_read=read_bytes, stall_s=stall, cache_bytes=s.cache_bytes))

    # ---- between tokens ----

    def drain(self) -> list[PageIn]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        self.pager.close()
        if self.host is not None:
            self.host.close()
        self.dma.close()
        self.store.close()


def substitutions(routed: np.ndarray, native: np.ndarray) -> int:
    """Routed experts (..., k) that the native picks (..., k) of the same token do not hold."""
    return int((routed[..., :, None] != native[..., None, :]).all(axis=-1).sum())


def _much_larger_than_ram(store: ExpertStore) -> bool:
    from tqbench.machine import physical_memory

    total = sum((store.root / f).stat().st_size for f in store.files)
    return total > 0.6 * physical_memory()



def _in_pieces(inner: Any, x: mx.array, slots: mx.array) -> mx.array:
    """inner(x, slots), ROWS_AT_ONCE tokens at a time when there are more (x: (..., tokens, dims), slots: (..., tokens,
    k)); each piece evaluated before the next, so only one piece's temporaries are held."""
    axis = x.ndim - 2
    n = x.shape[axis]
    if n <= ROWS_AT_ONCE:
        return inner(x, slots)
    pieces = []
    for a in range(0, n, ROWS_AT_ONCE):
        rows = slice(a, a + ROWS_AT_ONCE)
        piece = inner(x[..., rows, :], slots[..., rows, :])
        mx.eval(piece)
        pieces.append(piece)
    return mx.concatenate(pieces, axis=axis)

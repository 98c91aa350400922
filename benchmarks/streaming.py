#!/usr/bin/env python3
"""Expert-streaming benchmark (issue 11): routing traces of the trained demo replayed against K3-sized experts on disk
(hit rates next to Belady and the best fixed set, disk throughput on misses against this disk's raw O_DIRECT
bandwidth), and end-to-end streamed decode of a random-weight model whose experts are several times the budget.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/streaming.py
    python benchmarks/streaming.py --quick          # a smoke run (about a minute)
    python benchmarks/streaming.py --work /data/bench-streaming   # keep the 4.9 GB expert file, the trace and the model

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset: MLX's
Linux CPU wheel ships a reference BLAS. `--no-openblas` opts out.)

Part 1, routing-trace replay (no model runs during the replay):

1. Trace: the shipped demo (7 MoE layers x 64 experts, top-4: 448 expert-layers) run teacher-forced over the first
   `--trace-tokens` tokens of the held-out split (`tqbench.demo.is_heldout`), cut into `--window`-token windows each
   from an empty context (`training.modelstats.trace_routing`, in a fresh subprocess). A causal model routes position t
   from the tokens before it, so this is the routing a decode of that text would produce, token by token, at batch
   speed. Kept in the work directory and reused while its inputs match.
2. Store: one file of seeded random bytes holding layers x experts x `--expert-bytes` (default 10,960,896 bytes, one
   K3 expert at tq3a-tqTe-down4-g64: gate 2,555,904 + up 2,555,904 + down 5,849,088, from tqbench's plan of the K3
   skeleton) after a 1,000-byte prefix (a safetensors header's place: expert offsets are not page aligned, as in a
   real conversion), and an `expert_map.json` in tqbench's layout, so `ExpertStore.from_expert_map` reads it.
3. Hit rates, bookkeeping only, over the whole trace, for every budget (cache slots = expert-layers): `SlotCache`
   with `lru` and `lrfu` (tqbench/stream/policies.py, default lam 0.01) driven as the streamer drives it (per token and
   MoE layer: look up the distinct routed experts, then place the misses with the hits locked); Belady (offline
   optimum: on a miss with the cache full, evict the resident key whose next use is furthest, never one the current
   layer call uses); the best fixed set in hindsight (the budget's most-used keys: hits = their routings). An LRFU
   lam sweep (`--lams`) alongside.
4. Disk replay: for each budget and policy the cache state is taken at the middle of the trace, and from there the
   trace is replayed with real reads until `--misses` misses were read, once per read mode (`--workers` x fan-out
   off/on, and fan-out whose loop waits only on pending reads, "fan*"): every miss is read with
   `ExpertStore.read_direct` (O_DIRECT) by a thread pool into page-aligned staging buffers, as many as the streamer
   has (`read_buffers`: two per worker), and placed into the cache as its read completes: the loop of
   `Pager.page_in` (tqbench/stream/pagein.py) without the slot copy, which the streamer's worker makes right after the read (with fan-out
   each expert's aligned range is cut into `workers` pieces by `ExpertStore.direct_pieces`). Before every replay the
   store file's pages are dropped (posix_fadvise DONTNEED) and after it `mincore` measures how much of it is cached.
   Throughput on misses = expert bytes read / seconds spent in page-ins, divided by this disk's raw O_DIRECT bandwidth
   measured right before that replay (`--pair-bytes` of sequential reads of one expert's size at the worker count that
   was best in the budget's round of raw reads at every worker count); goal >= 0.9.

Part 2, end to end: a seeded random-weight K3-layout model with K3-shaped experts (latent x intermediate 1792 x 1536,
half K3's in each direction, 2.74 MB each; 2 MoE layers of 64, top-8), converted with tq3a-tqTe-down4-g64 (both kept in
the work directory), and four runs loaded side by side in one fresh process, decoding greedily one token each in turn:
resident, streamed with every expert in the budget (paged in once before the prompt), streamed with `--e2e-share` of
the experts' bytes in the budget (the experts on disk are several times the budget), and that with look-ahead; page
cache off. Reported: decode tok/s and against resident, expert bytes read per token, hit rate, stall share (the
streamer's `stall_s` over the decode seconds), the disk-bound ceiling tok/s = raw O_DIRECT bandwidth / expert bytes
read per token and tok/s against it, look-ahead's precision and the stall it removes.

Writes JSON (`--out`, default bench-results/streaming.json, schema tqbench.bench.streaming/1) and prints tables.
"""

from __future__ import annotations

import os
import platform
import sys

from harness import add_size_options, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import copy  # noqa: E402
import hashlib  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import changed_paths, drop_cache, emit, machine_info, resident_fraction, run_child  # noqa: E402

import numpy as np  # noqa: E402

SCHEMA = "tqbench.bench.streaming/1"
MiB = 2**20
SCRIPT = Path(__file__).resolve()  # the children run this file
ALIGN = 4096
# One K3 expert at tq3a-tqTe-down4-g64, by projection (tqbench.recipe.plan of the K3 skeleton).
K3_EXPERT_PARTS = (("w1.weight", 2_555_904), ("w3.weight", 2_555_904), ("w2.weight", 5_849_088))
K3_EXPERT_BYTES = sum(n for _, n in K3_EXPERT_PARTS)  # 10,960,896
STORE_PREFIX = 1000  # bytes before the first expert: offsets are not page aligned, as in a real shard
DEFAULT_POLICY = "lrfu"
DEFAULT_LAM = 0.01  # tqbench.stream.policies.LRFU's default
RATIO_GOAL = 0.9
RELEVANT = ("tqbench/stream", "tqbench/runtime", "tqbench/demo", "training/modelstats.py", "tqbench/convert",
            "benchmarks/streaming.py")
RECIPE = "tq3a-tqTe-down4-g64"
# The end-to-end model: K3's routed experts at half size in each direction (K3: latent 3584, intermediate 3072;
# 2.74 MB each at the recipe), 2 MoE layers of 64 experts top-8; small dense parts. On a CPU the TurboQuant reference
# path decodes a few tens of millions of expert weights a second, so a token of 16 such experts takes seconds.
E2E_SPEC = dict(hidden_size=512, num_hidden_layers=3, mla_every=4, intermediate_size=1024, num_experts=64,
                num_experts_per_token=8, moe_intermediate_size=1536, routed_expert_hidden_size=1792,
                num_shared_experts=1, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=256, kda_num_heads=8,
                kda_head_dim=64, bpe_merges=256, num_shards=4)
E2E_SPEC_QUICK = dict(E2E_SPEC, num_hidden_layers=3, num_experts=16, num_experts_per_token=4,
                      moe_intermediate_size=256, routed_expert_hidden_size=256, hidden_size=256, intermediate_size=512,
                      q_lora_rank=64, kv_lora_rank=64, kda_num_heads=4)

DEFAULTS = dict(trace_tokens=20480, window=256, budgets="16,32,64,128", workers="1,4,16", misses=300,
                lams="0.003,0.01,0.02,0.03,0.05,0.1", expert_bytes=K3_EXPERT_BYTES, raw_bytes=1536 * MiB,
                pair_bytes=768 * MiB, e2e_prompt=2, e2e_warmup=2, e2e_tokens=8, e2e_share=0.25, e2e_workers=4,
                e2e_repeats=1)
QUICK = dict(trace_tokens=1024, window=256, budgets="16,64", workers="1,4", misses=24, lams="0.01,0.03",
             expert_bytes=MiB, raw_bytes=32 * MiB, pair_bytes=16 * MiB, e2e_prompt=2, e2e_warmup=1, e2e_tokens=3,
             e2e_share=0.25, e2e_workers=2, e2e_repeats=1)


# --- helpers shared by parent and children ---------------------------------------------------------------------------


# --- cache policies and bounds on a trace (pure bookkeeping) -------------------------------------------------------


def batches_of(trace: np.ndarray, layer_ids: list[int]) -> list[list[tuple[int, list[int]]]]:
    """Per token, per MoE layer: (layer id, the distinct routed experts sorted), from a trace `[layers, tokens, k]`."""
    per_layer = [[sorted(set(row)) for row in t.tolist()] for t in trace]
    return [[(layer_ids[i], per_layer[i][t]) for i in range(len(layer_ids))] for t in range(trace.shape[1])]


def make_cache(budget: int, policy: str, lam: float | None = None):
    from tqbench.stream.cache import SlotCache
    from tqbench.stream.policies import LRFU

    cache = SlotCache(budget, policy)
    if lam is not None and policy == "lrfu":
        cache.policy = LRFU(lam)
    return cache


def lookup(cache, layer: int, experts, now: int) -> tuple[set, list]:
    """The streamer's first step for one layer: look each routed expert up (a hit counts as a use at `now`); returns
    the cached ones, locked for this layer, and the missing ones, in routing order."""
    keys = [(layer, e) for e in experts]
    slots = cache.lookup_many(keys, now)
    locked = {k for k, s in zip(keys, slots) if s is not None}
    return locked, [e for e, s in zip(experts, slots) if s is None]


def simulate(batches, cache, start: int = 0, stop: int | None = None, snapshot_at: int | None = None) -> dict:
    """Drive `cache` over tokens [start, stop) as the streamer does (ticks count tokens from 1): per layer call, look up
    every distinct routed expert (the hits touched together), then place the misses together, in order, with the
    layer's hits locked.
    Returns hits, misses and (with `snapshot_at`) a deep copy of the cache as it was before that token."""
    hits = misses = 0
    snap = None
    stop = len(batches) if stop is None else stop
    for t in range(start, stop):
        if t == snapshot_at:
            snap = copy.deepcopy(cache)
        now = t + 1
        for layer, experts in batches[t]:
            locked, missing = lookup(cache, layer, experts, now)
            hits += len(experts) - len(missing)
            misses += len(missing)
            cache.place_many([(layer, e) for e in missing], now, locked)
    if snapshot_at is not None and snap is None:
        snap = copy.deepcopy(cache)
    return dict(hits=hits, misses=misses, hit_rate=hits / max(1, hits + misses), snapshot=snap)


def belady_hit_rate(batches, budget: int) -> float:
    """Offline optimum (Belady's MIN) for demand paging with the current layer call's experts locked: a miss with the
    cache full evicts the resident key whose next use (in layer calls) is furthest away."""
    calls = [c for token in batches for c in token]
    n = len(calls)
    never = n + 1
    nxt: list[list[int]] = [None] * n  # type: ignore[list-item]
    last: dict[tuple[int, int], int] = {}
    for i in range(n - 1, -1, -1):
        layer, experts = calls[i]
        row = []
        for e in experts:
            row.append(last.get((layer, e), never))
            last[(layer, e)] = i
        nxt[i] = row
    resident: dict[tuple[int, int], int] = {}  # key -> its next use
    heap: list[tuple[int, tuple[int, int]]] = []
    hits = total = 0
    for i, (layer, experts) in enumerate(calls):
        now_keys = {(layer, e) for e in experts}
        for e, use in zip(experts, nxt[i]):
            key = (layer, e)
            total += 1
            if key in resident:
                hits += 1
            elif len(resident) >= budget:
                kept = []
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue  # stale
                    if victim in now_keys:
                        kept.append((neg, victim))
                        continue
                    del resident[victim]
                    break
                for item in kept:
                    heapq.heappush(heap, item)
            resident[key] = use
            heapq.heappush(heap, (-use, key))
    return hits / max(1, total)


def best_fixed_hit_rate(batches, budget: int) -> float:
    """The best fixed set in hindsight: the `budget` keys with the most routings, never changing; its hit rate."""
    counts: dict[tuple[int, int], int] = {}
    total = 0
    for token in batches:
        for layer, experts in token:
            for e in experts:
                counts[(layer, e)] = counts.get((layer, e), 0) + 1
            total += len(experts)
    top = sorted(counts.values(), reverse=True)[:budget]
    return sum(top) / max(1, total)


# --- the expert store on disk ----------------------------------------------------------------------------------------


def build_store(root: Path, layer_ids: list[int], experts: int, expert_bytes: int, seed: int = 0) -> dict:
    """One file of random bytes, `layers x experts x expert_bytes` after a STORE_PREFIX-byte prefix, and its
    expert_map.json (tqbench's streaming layout). Reused while its marker matches."""
    parts = K3_EXPERT_PARTS if expert_bytes == K3_EXPERT_BYTES else (("w1.weight", expert_bytes),)
    want = dict(layers=layer_ids, experts=experts, expert_bytes=expert_bytes, prefix=STORE_PREFIX, seed=seed,
                parts=[list(p) for p in parts])
    marker = root / "store.json"
    data = root / "experts.bin"
    size = STORE_PREFIX + len(layer_ids) * experts * expert_bytes
    t0 = time.perf_counter()
    built = False
    if not (marker.is_file() and json.loads(marker.read_text()) == want and data.is_file()
            and data.stat().st_size == size):
        root.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)
        rng = np.random.default_rng(seed)
        block = 64 * MiB
        with open(data, "wb") as f:
            f.write(rng.bytes(STORE_PREFIX))
            left = size - STORE_PREFIX
            while left:
                n = min(block, left)
                f.write(rng.bytes(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        layers = {}
        offset = STORE_PREFIX
        for layer in layer_ids:
            rel, tensors = 0, {}
            for name, n in parts:
                tensors[name] = {"offset": rel, "bytes": n, "dtype": "U8", "shape": [n]}
                rel += n
            locs = []
            for _ in range(experts):
                locs.append([0, offset])
                offset += expert_bytes
            layers[str(layer)] = {"experts": locs, "tensors": tensors, "length": expert_bytes,
                                  "prefix": f"language_model.model.layers.{layer}.block_sparse_moe.experts"}
        (root / "expert_map.json").write_text(json.dumps({"layout": "streaming", "files": [data.name],
                                                          "layers": layers}))
        marker.write_text(json.dumps(want))
        built = True
    return dict(path=str(root), file=str(data), bytes=size, expert_bytes=expert_bytes, layers=layer_ids,
                experts_per_layer=experts, prefix=STORE_PREFIX, seed=seed, built=built,
                build_seconds=time.perf_counter() - t0 if built else None)


def timed_reads(items: list[tuple[Path, int, int]], workers: int) -> tuple[int, float, bool]:
    """Read (file, offset, length) `items` with O_DIRECT where the OS has it (offsets and lengths page-aligned),
    `workers` threads, each into its own aligned buffer; the first `workers` items warm the threads and are not
    timed. Returns (bytes timed, seconds, whether O_DIRECT was used)."""
    from tqbench.stream.store import aligned_buffer

    direct = getattr(os, "O_DIRECT", 0)
    fds = {f: os.open(f, os.O_RDONLY | direct) for f in {f for f, _, _ in items}}
    local = threading.local()
    biggest = max(n for _, _, n in items)

    def read(item) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = aligned_buffer(biggest)
        f, off, n = item
        return os.preadv(fds[f], [memoryview(buf)[:n]], off)

    try:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(read, items[:workers]))  # warm the threads and their buffers
            t0 = time.perf_counter()
            got = sum(ex.map(read, items[workers:]))
            seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return got, seconds, bool(direct)


def raw_direct(files: list[Path], chunk: int, total: int, workers: int, start: int = 0) -> dict:
    """This disk's raw bandwidth: `total` bytes of sequential O_DIRECT reads of `chunk` bytes (rounded up to pages),
    `workers` in flight, from chunk index `start` on (wrapping) over the files' aligned chunks."""
    chunk = -(-chunk // ALIGN) * ALIGN
    slots = [(f, i * chunk) for f in files for i in range(f.stat().st_size // chunk)]
    if not slots:
        raise SystemExit(f"no file has room for one {chunk}-byte chunk")
    count = max(1, total // chunk)
    order = [slots[(start + i) % len(slots)] for i in range(count)]
    got, seconds, direct = timed_reads([(f, off, chunk) for f, off in order], workers)
    return dict(workers=workers, chunk=chunk, bytes=got, seconds=seconds, gbps=got / seconds / 1e9 if seconds else None,
                direct=bool(direct))


class Reader:
    """The streamer's page-in loop (Pager.page_in + submit in tqbench/stream/pagein.py, direct or buffered) without the slot copy: misses
    are read by `workers` threads into page-aligned staging buffers, as many as the streamer has
    (`read_buffers(workers)`), and placed into the cache as their reads complete.

    `pending_only` False waits as the streamer does, on every in-flight read future (`FIRST_COMPLETED`); with fan-out
    an expert's finished pieces then make every wait return at once while its other pieces are still being read, and
    the engine thread spins. True waits only on futures not done yet (the variant measured next to it)."""

    def __init__(self, store, workers: int, fanout: bool, pending_only: bool = False):
        from tqbench.stream.store import aligned_buffer
        from tqbench.stream.pagein import read_buffers

        self.store = store
        self.workers = workers
        self.fanout = fanout
        self.pending_only = pending_only
        biggest = max(store.buffer_bytes(n) for n in store.layers)
        self.buffers = [aligned_buffer(biggest) for _ in range(read_buffers(workers))]
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="bench-read")
        self.reset()

    def reset(self) -> None:
        self.reads = self.expert_bytes = self.disk_bytes = self.misses = self.waits = 0
        self.seconds = 0.0

    def _submit(self, layer: int, e: int, buf) -> tuple[list, int]:
        store, ex = self.store, self.executor
        if store.direct:
            pieces = store.direct_pieces(layer, e, self.workers if self.fanout else 1)
            return [ex.submit(store.read_direct, layer, e, buf, [p]) for p in pieces], sum(p[3] for p in pieces)
        n = store.layers[layer].nbytes
        if not self.fanout:
            return [ex.submit(store.read, layer, e, buf)], n
        from tqbench.stream.pagein import read_pieces

        return [ex.submit(read_pieces, store, piece, buf) for piece in store.split(layer, e, self.workers)], n

    def page_in(self, layer: int, missing: list[int], cache, now: int, locked: set) -> None:
        t0 = time.perf_counter()
        pending = deque(sorted(missing))
        free = list(self.buffers)
        inflight: dict[int, tuple] = {}
        n = self.store.layers[layer].nbytes
        while pending or inflight:
            while pending and free:
                e = pending.popleft()
                buf = free.pop()
                futures, disk = self._submit(layer, e, buf)
                inflight[e] = (buf, futures, disk)
            futures = [f for _, fs, _ in inflight.values() for f in fs]
            wait([f for f in futures if not f.done()] if self.pending_only else futures, return_when=FIRST_COMPLETED)
            self.waits += 1
            for e in [e for e, (_, fs, _) in inflight.items() if all(f.done() for f in fs)]:
                buf, fs, disk = inflight.pop(e)
                self.reads += sum(f.result() for f in fs)
                cache.place((layer, e), now, locked)
                locked.add((layer, e))
                self.expert_bytes += n
                self.disk_bytes += disk
                self.misses += 1
                free.append(buf)
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def disk_verdict(hit_rows: list[dict], disk_rows: list[dict], summary: list[dict]) -> dict:
    """The streamer's best read mode (fan-out waiting on pending reads only is not what the streamer does) by its median
    ratio over every replay; per budget, the default policy's ratio in that mode and in StreamConfig's default mode."""
    from tqbench.stream.streamer import StreamConfig

    default_mode = mode_name(StreamConfig.__dataclass_fields__["workers"].default,
                             StreamConfig.__dataclass_fields__["fanout"].default, False)
    streamer = [x for x in summary if not x["pending_only"]]
    best = max(streamer, key=lambda x: x["median_ratio"]) if streamer else None
    fixed = [x for x in summary if x["pending_only"]]
    best_fixed = max(fixed, key=lambda x: x["median_ratio"]) if fixed else None

    def ratio(budget: int, mode: str | None) -> float | None:
        d = next((d for d in disk_rows if (d["budget"], d["policy"], d["mode"]) == (budget, DEFAULT_POLICY, mode)),
                 None)
        return d["ratio"] if d else None

    for row in hit_rows:
        row["disk_ratio_default_mode"] = ratio(row["budget"], default_mode)
        row["disk_ratio_best_mode"] = ratio(row["budget"], best["mode"] if best else None)
    return dict(default_mode=default_mode, best_streamer_mode=best["mode"] if best else None,
                best_streamer_median_ratio=best["median_ratio"] if best else None,
                best_pending_only_mode=best_fixed["mode"] if best_fixed else None,
                best_pending_only_median_ratio=best_fixed["median_ratio"] if best_fixed else None)


def reader_modes(workers: list[int]) -> list[tuple[int, bool, bool]]:
    """(workers, fan-out, wait on pending reads only) per replay: fan-out off and on (as the streamer waits) at every
    worker count, and fan-out waiting on pending reads only where there is more than one worker."""
    return [(w, f, po) for w in workers for f, po in ((False, False), (True, False), (True, True))
            if not (po and w == 1)]


def mode_name(workers: int, fanout: bool, pending_only: bool) -> str:
    return f"{workers}w" + (" fan*" if pending_only else " fan" if fanout else "")


def replay(batches, cache, reader: Reader, start: int, misses: int) -> dict:
    """From token `start` on, the streamer's loop with real reads, until `misses` misses were read (or the trace ends).
    Returns the window and what it read."""
    reader.reset()
    hits = calls = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    t = start
    while t < len(batches) and reader.misses < misses:
        now = t + 1
        for layer, experts in batches[t]:
            locked, missing = lookup(cache, layer, experts, now)
            hits += len(experts) - len(missing)
            if missing:
                calls += 1
                reader.page_in(layer, missing, cache, now, locked)
        t += 1
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    s = reader.seconds
    return dict(tokens=t - start, start=start, hits=hits, misses=reader.misses,
                hit_rate=hits / max(1, hits + reader.misses), reads=reader.reads, expert_bytes=reader.expert_bytes,
                disk_bytes=reader.disk_bytes, page_in_s=s, wall_s=wall, calls_with_misses=calls, waits=reader.waits,
                cpu_s=(ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
                misses_per_call=reader.misses / max(1, calls),
                gbps=reader.expert_bytes / s / 1e9 if s else None,
                disk_gbps=reader.disk_bytes / s / 1e9 if s else None)


# --- children --------------------------------------------------------------------------------------------------------


def child_trace(a: dict) -> None:
    """Routing of the shipped demo over the first trace_tokens tokens of the held-out split, teacher-forced."""
    t0 = time.perf_counter()
    from mlx_lm import load

    from tqbench.demo import SHIPPED_DEMO, SHIPPED_SPEC, special_ids
    from tqbench.tokenizer import load_encoding
    from training.corpus import corpus_files, encode_files, is_heldout, stdlib_root
    from training.modelstats import trace_routing
    root = stdlib_root()
    files = [f for f in corpus_files(root) if is_heldout(f)]
    enc = load_encoding(SHIPPED_DEMO)
    stream = encode_files(enc, root, files, special_ids(SHIPPED_SPEC)["eos_token_id"])
    tokens = stream[: a["tokens"] + 1]
    model, _ = load(str(SHIPPED_DEMO))
    t1 = time.perf_counter()
    trace = trace_routing(model, tokens, window=a["window"], batch=a["batch"])
    seconds = time.perf_counter() - t1
    np.save(a["out"], trace)
    moe = [i for i in range(SHIPPED_SPEC.num_hidden_layers) if SHIPPED_SPEC.is_moe(i)]
    emit(dict(mode="trace", shape=list(trace.shape), heldout_files=len(files), heldout_tokens=int(len(stream)),
              tokens_sha256=hashlib.sha256(tokens.astype(np.uint32).tobytes()).hexdigest(),
              moe_layers=moe, num_experts=SHIPPED_SPEC.num_experts, top_k=SHIPPED_SPEC.num_experts_per_token,
              trace_seconds=seconds, tokens_per_s=trace.shape[1] / seconds, total_seconds=time.perf_counter() - t0,
              stdlib=str(root), demo=str(SHIPPED_DEMO)))


def streamer_stats(streamer) -> dict:
    """The streamer's counters as the benchmarks record them."""
    s = streamer.stats
    return dict(hits=s.hits, hits_pinned=s.hits_pinned, hits_cache=s.hits_cache, hits_prefetched=s.hits_prefetched,
                hits_host=s.hits_host, misses=s.misses, host_copy_s=s.host_copy_s,
                reads=s.reads, critical_bytes=s.critical_bytes, speculative_bytes=s.speculative_bytes,
                stall_s=s.stall_s, tokens=s.tokens, evictions=s.evictions, lookahead_reads=s.lookahead_reads,
                lookahead_used=s.lookahead_used, cache_bytes_max=s.cache_bytes_max, substitutions=s.substitutions)


def child_decode(a: dict) -> None:
    """Every run of `a["runs"]` (a label and a StreamConfig's fields, or None for resident) loaded side by side in this
    process, each with its own KV cache; a prompt each, then greedy decode one token per run in turn, the order rotated
    every round, so a drift in the machine's speed hits every run alike. Per run: per-token seconds and the streamer's
    counters over the measured tokens."""
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.runtime.load import load
    from tqbench.stream.streamer import StreamConfig
    import_s = time.perf_counter() - t0
    prompt = mx.array(np.array(a["prompt"], dtype=np.uint32))
    runs = []
    for label, stream in a["runs"]:
        t1 = time.perf_counter()
        stream = dict(stream) if stream else None
        prewarm = stream.pop("prewarm", False) if stream else False
        loaded = load(a["path"], streaming=StreamConfig(**stream) if stream else None)
        load_s = time.perf_counter() - t1
        if prewarm:  # every expert paged in once before the prompt: the whole model is in the cache
            st = loaded.streamer
            x = mx.zeros((1, 1, 1))
            for layer, lay in sorted(st.store.layers.items()):
                st.run(layer, lambda x, slots: x, x, mx.array(np.arange(lay.experts, dtype=np.uint32)[None, None]))
            st.drain()
        runs.append(dict(label=label, stream=stream, prewarm=prewarm, loaded=loaded, load_s=load_s,
                         cache=make_prompt_cache(loaded.model), times=[]))
    for r in runs:
        t1 = time.perf_counter()
        logits = r["loaded"].model(prompt[None], cache=r["cache"])
        r["tok"] = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(r["tok"])
        r["prefill_s"] = time.perf_counter() - t1
        r["tokens"] = [int(r["tok"].item())]

    def step(r: dict) -> float:
        t = time.perf_counter()
        logits = r["loaded"].model(r["tok"][:, None], cache=r["cache"])
        r["tok"] = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(r["tok"])
        r["tokens"].append(int(r["tok"].item()))
        return time.perf_counter() - t

    n = len(runs)
    for i in range(a["warmup"]):
        for r in runs[i % n:] + runs[: i % n]:
            step(r)
    for r in runs:
        r["before"] = streamer_stats(r["loaded"].streamer) if r["loaded"].streamer else None
    for i in range(a["tokens"]):
        for r in runs[i % n:] + runs[: i % n]:
            r["times"].append(step(r))
    out = []
    for r in runs:
        st = r["loaded"].streamer
        x = dict(label=r["label"], load_s=r["load_s"], prefill_s=r["prefill_s"], warmup=a["warmup"],
                 token_s=r["times"], decode_s=sum(r["times"]), decode_tps=len(r["times"]) / sum(r["times"]),
                 tokens=r["tokens"], weight_bytes=r["loaded"].weight_bytes)
        if st:
            after = streamer_stats(st)
            events = [e for e in st.events if e.token > r["before"]["tokens"]]
            x.update(stream=r["stream"], prewarm=r["prewarm"], before=r["before"], after=after,
                     events=[dict(token=e.token, layer=e.layer, experts=len(e.experts),
                                  misses=sum(k == "miss" for k in e.served),
                                  prefetched=sum(k == "prefetched" for k in e.served), bytes_read=e.bytes_read,
                                  stall_s=e.stall_s) for e in events],
                     delta={k: after[k] - r["before"][k] for k in after if k != "cache_bytes_max"},
                     slots=st.stats.slots, slot_bytes=st.stats.slot_bytes, staging_bytes=st.stats.staging_bytes,
                     page_cache=st.stats.page_cache, budget_bytes=st.stats.budget_bytes,
                     cache_bytes_max=st.stats.cache_bytes_max)
            st.close()
        out.append(x)
    emit(dict(mode="decode", import_s=import_s, prompt_tokens=int(prompt.size), runs=out,
              mlx_peak=int(mx.get_peak_memory())))


CHILDREN = {"trace": child_trace, "decode": child_decode}


# --- parent ----------------------------------------------------------------------------------------------------------


def demo_digest() -> str:
    from tqbench.demo import SHIPPED_DEMO

    h = hashlib.sha256()
    for f in sorted(SHIPPED_DEMO.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f.name.encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def prepare_trace(work: Path, cfg: dict, timeout: float) -> tuple[np.ndarray, dict]:
    """The demo's routing trace, from the work directory while its inputs match, else traced in a fresh process."""
    out = work / "routing-trace.npy"
    marker = work / "routing-trace.json"
    want = dict(demo=demo_digest(), tokens=cfg["trace_tokens"], window=cfg["window"], python=platform.python_version())
    if out.is_file() and marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("inputs") == want:
            info["reused"] = True
            return np.load(out), info
    info = run_child(SCRIPT, "trace", dict(tokens=cfg["trace_tokens"], window=cfg["window"], batch=32, out=str(out)),
                     timeout)
    info["inputs"] = want
    marker.write_text(json.dumps(info))
    info["reused"] = False
    return np.load(out), info


def raw_round(files: list[Path], chunk: int, total: int, workers: list[int], start: int) -> dict:
    rows = []
    for i, w in enumerate(workers):
        drop_cache(files)
        rows.append(raw_direct(files, chunk, total, w, start + i * max(1, total // chunk)))
    best = max(rows, key=lambda r: r["gbps"] or 0)
    return dict(rows=rows, best_gbps=best["gbps"], best_workers=best["workers"])


def run_replay(work: Path, cfg: dict, trace: np.ndarray, info: dict, notes: list[str]) -> dict:
    from tqbench.stream.store import ExpertStore

    layer_ids = info["moe_layers"]
    experts = info["num_experts"]
    budgets = [int(b) for b in cfg["budgets"].split(",")]
    workers = [int(w) for w in cfg["workers"].split(",")]
    lams = [float(x) for x in cfg["lams"].split(",")]
    expert_layers = len(layer_ids) * experts
    for b in budgets:
        if not trace.shape[-1] <= b <= expert_layers:
            raise SystemExit(f"budget {b} must hold one layer's top-{trace.shape[-1]} and at most {expert_layers}")
    print(f"store: {len(layer_ids)} layers x {experts} experts x {cfg['expert_bytes']:,} bytes ...", end=" ",
          flush=True)
    store_info = build_store(work / "store", layer_ids, experts, cfg["expert_bytes"])
    print("built" if store_info["built"] else "reused", flush=True)
    store = ExpertStore.from_expert_map(work / "store")
    direct = store.set_direct(True)
    if not direct:
        notes.append("the work directory's filesystem refused O_DIRECT: replays read through the page cache, dropped "
                     "before each replay (posix_fadvise); see page_cache_resident_after")
    files = [store.root / f for f in store.files]
    batches = batches_of(trace, layer_ids)
    tokens = len(batches)
    warm = tokens // 2

    # hit rates over the whole trace, bookkeeping only
    hit_rows, lam_rows, snapshots = [], [], {}
    for b in budgets:
        t0 = time.perf_counter()
        row = dict(budget=b, belady=belady_hit_rate(batches, b), best_fixed=best_fixed_hit_rate(batches, b))
        for policy in ("lru", "lrfu"):
            r = simulate(batches, make_cache(b, policy), snapshot_at=warm)
            row[policy] = r["hit_rate"]
            snapshots[(b, policy)] = r["snapshot"]
        gap = row["belady"] - row["lru"]
        row["gap_closed"] = (row["lrfu"] - row["lru"]) / gap if gap > 0 else None
        row["beats_fixed"] = row["lrfu"] > row["best_fixed"]
        row["closes_third"] = row["gap_closed"] is not None and row["gap_closed"] >= 1 / 3
        hit_rows.append(row)
        lam_row = dict(budget=b)
        for lam in lams:
            lam_row[str(lam)] = simulate(batches, make_cache(b, "lrfu", lam))["hit_rate"]
        lam_rows.append(lam_row)
        print(f"  budget {b:4d}: lru {row['lru']:.3f} lrfu {row['lrfu']:.3f} fixed {row['best_fixed']:.3f} belady "
              f"{row['belady']:.3f}  ({time.perf_counter() - t0:.0f}s)", flush=True)

    # disk replays
    chunk = cfg["expert_bytes"]
    raws, disk_rows = [], []
    start_chunk = 0
    readers = {}
    try:
        for bi, b in enumerate(budgets):
            rr = raw_round(files, chunk, cfg["raw_bytes"], workers, start_chunk)
            start_chunk += len(workers) * max(1, cfg["raw_bytes"] // chunk) + 7
            rr["before_budget"] = b
            raws.append(rr)
            print("  raw O_DIRECT: " + ", ".join(f"{r['workers']}w {r['gbps']:.2f}" for r in rr["rows"]) + " GB/s",
                  flush=True)
            configs = [(p, w, f, po) for p in ("lru", "lrfu") for w, f, po in reader_modes(workers)]
            k = bi % len(configs)
            for policy, w, fan, po in configs[k:] + configs[:k]:  # rotated: every config takes every position in turn
                key = (w, fan, po)
                if key not in readers:
                    readers[key] = Reader(store, w, fan, po)
                drop_cache(files)
                pair = raw_direct(files, chunk, cfg["pair_bytes"], rr["best_workers"], start_chunk)
                start_chunk += max(1, cfg["pair_bytes"] // chunk) + 3
                drop_cache(files)
                before = resident_fraction(files)
                cache = copy.deepcopy(snapshots[(b, policy)])
                r = replay(batches, cache, readers[key], warm, cfg["misses"])
                after = resident_fraction(files)
                r.update(budget=b, policy=policy, workers=w, fanout=fan, pending_only=po, mode=mode_name(w, fan, po),
                         page_cache_resident_before=before,
                         page_cache_resident_after=after, raw=pair, raw_gbps=pair["gbps"],
                         group_raw_gbps=rr["best_gbps"],
                         ratio=r["gbps"] / pair["gbps"] if r["gbps"] and pair["gbps"] else None,
                         ratio_group=r["gbps"] / rr["best_gbps"] if r["gbps"] and rr["best_gbps"] else None)
                disk_rows.append(r)
                print(f"  budget {b:4d} {policy:<4} {mode_name(w, fan, po):<9}: "
                      f"{r['misses']:4d} misses ({r['misses_per_call']:.1f} a call) {r['gbps'] or 0:.2f} GB/s = "
                      f"{r['ratio'] or 0:.2f} x raw {pair['gbps']:.2f}  "
                      f"(hit rate {r['hit_rate']:.3f}, cached after {after if after is None else round(after, 4)})",
                      flush=True)
        rr = raw_round(files, chunk, cfg["raw_bytes"], workers, start_chunk)
        rr["before_budget"] = None
        raws.append(rr)
    finally:
        for r in readers.values():
            r.close()
        store.close()
    raw_best = statistics.median([r["best_gbps"] for r in raws])
    best_workers = statistics.mode([r["best_workers"] for r in raws])
    disk_summary = []
    for w, fan, po in reader_modes(workers):
        ds = [d for d in disk_rows if d["mode"] == mode_name(w, fan, po) and d["ratio"]]
        if ds:
            disk_summary.append(dict(mode=mode_name(w, fan, po), workers=w, fanout=fan, pending_only=po,
                                     replays=len(ds),
                                     median_ratio=statistics.median([d["ratio"] for d in ds]),
                                     min_ratio=min(d["ratio"] for d in ds), max_ratio=max(d["ratio"] for d in ds),
                                     median_gbps=statistics.median([d["gbps"] for d in ds]),
                                     median_raw_gbps=statistics.median([d["raw_gbps"] for d in ds]),
                                     misses_per_call=statistics.median([d["misses_per_call"] for d in ds]),
                                     waits_per_miss=statistics.median([d["waits"] / d["misses"] for d in ds]),
                                     cpu_s_per_gb=statistics.median([d["cpu_s"] / d["expert_bytes"] * 1e9
                                                                     for d in ds])))
    return dict(trace=dict(info, tokens=tokens, routings=int(sum(len(e) for tk in batches for _, e in tk)),
                           layer_calls=tokens * len(layer_ids), expert_layers=expert_layers,
                           top_k=int(trace.shape[-1]), replay_start_token=warm,
                           method="teacher-forced over held-out windows (training.modelstats.trace_routing)"),
                store=store_info, direct=direct, hit_rates=hit_rows, lam_sweep=dict(lams=lams, rows=lam_rows,
                default_lam=DEFAULT_LAM), raw=raws, raw_best_gbps=raw_best, raw_best_workers=best_workers,
                disk=disk_rows, disk_summary=disk_summary, **disk_verdict(hit_rows, disk_rows, disk_summary))


# --- end to end -------------------------------------------------------------------------------------------------------


def build_e2e_model(work: Path, spec_kw: dict, seed: int = 0) -> dict:
    from dataclasses import asdict

    from tqbench.convert import convert
    from tqbench.demo import DemoSpec, write_source
    from tqbench.recipe import Recipe
    spec = DemoSpec(**spec_kw)
    src, dst, marker = work / "e2e-source", work / f"e2e-{RECIPE}", work / "e2e.json"
    want = dict(spec=asdict(spec), seed=seed, recipe=RECIPE)
    info: dict = dict(spec=asdict(spec), seed=seed, recipe=RECIPE, path=str(dst), reused=True)
    if not (marker.is_file() and json.loads(marker.read_text()) == want and dst.is_dir()):
        marker.unlink(missing_ok=True)
        t0 = time.perf_counter()
        write_source(src, spec, seed)
        info["write_source_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in convert(src, dst, Recipe.parse(RECIPE), force=True):
            pass
        info["convert_s"] = time.perf_counter() - t0
        shutil.rmtree(src, ignore_errors=True)
        marker.write_text(json.dumps(want))
        info["reused"] = False
    from tqbench.stream.store import ExpertStore
    store = ExpertStore.open(dst)
    lay = next(iter(store.layers.values()))
    info.update(files=[str(dst / f) for f in store.files], expert_bytes=lay.nbytes, moe_layers=len(store.layers),
                experts_per_layer=lay.experts,
                expert_total_bytes=sum(x.nbytes * x.experts for x in store.layers.values()),
                model_bytes=sum((dst / f).stat().st_size for f in store.files))
    return info


def run_e2e(work: Path, cfg: dict, quick: bool, timeout: float, notes: list[str]) -> dict:
    print("end to end: model ...", end=" ", flush=True)
    model = build_e2e_model(work, E2E_SPEC_QUICK if quick else E2E_SPEC)
    print(("reused" if model["reused"] else f"written {model['write_source_s']:.0f}s, converted "
           f"{model['convert_s']:.0f}s") + f"; {model['moe_layers']} MoE layers x {model['experts_per_layer']} experts "
          f"x {model['expert_bytes'] / 1e6:.2f} MB = {model['expert_total_bytes'] / 1e6:.0f} MB of experts", flush=True)
    files = [Path(f) for f in model["files"]]
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, cfg["e2e_prompt"]).tolist()  # byte tokens of the random model's vocabulary
    eb, total, w = model["expert_bytes"], model["expert_total_bytes"], cfg["e2e_workers"]
    from tqbench.stream.pagein import staging_bytes

    staging = staging_bytes(eb + 2 * ALIGN, w)  # the streamer's staging buffers (O_DIRECT: an aligned superset each)
    small = max(int(cfg["e2e_share"] * total // eb), 1) * eb + staging
    runs = [("resident", None),
            ("streamed, fits", dict(budget_bytes=total + staging + eb, workers=w, page_cache="off", prewarm=True)),
            ("streamed, small", dict(budget_bytes=small, workers=w, page_cache="off")),
            ("streamed, small, look-ahead", dict(budget_bytes=small, workers=w, page_cache="off", lookahead=True))]
    raw_bytes = min(cfg["raw_bytes"], sum(f.stat().st_size for f in files))
    raw_workers = sorted({1, w, 4, 16})
    children, raws = [], []
    for rep in range(cfg["e2e_repeats"]):
        raws.append(raw_round(files, eb, raw_bytes, raw_workers, rep * 13))
        drop_cache(files)
        order = runs if rep % 2 == 0 else runs[::-1]
        x = run_child(SCRIPT, "decode", dict(path=model["path"], runs=order, prompt=prompt, warmup=cfg["e2e_warmup"],
                                             tokens=cfg["e2e_tokens"]), timeout)
        x["repeat"] = rep
        children.append(x)
        for r in x["runs"]:
            extra = ""
            if "delta" in r:
                d = r["delta"]
                extra = (f", {d['critical_bytes'] / len(r['token_s']) / 1e6:.0f} MB read per token, stall "
                         f"{d['stall_s'] / r['decode_s']:.1%}")
            print(f"  [{rep + 1}/{cfg['e2e_repeats']}] {r['label']:<28} decode {r['decode_tps']:.3f} tok/s{extra}",
                  flush=True)
    raws.append(raw_round(files, eb, raw_bytes, raw_workers, 7))
    raw_gbps = statistics.median([r["best_gbps"] for r in raws])
    rows = []
    for label, stream in runs:
        xs = [next(r for r in c["runs"] if r["label"] == label) for c in children]
        res = [next(r for r in c["runs"] if r["label"] == "resident") for c in children]
        row = dict(run=label, repeats=len(xs), decode_tps=statistics.median([x["decode_tps"] for x in xs]),
                   decode_tps_all=[x["decode_tps"] for x in xs],
                   token_s_median=statistics.median([t for x in xs for t in x["token_s"]]),
                   load_s=statistics.median([x["load_s"] for x in xs]),
                   prefill_s=statistics.median([x["prefill_s"] for x in xs]),
                   same_tokens_as_resident=all(x["tokens"] == r["tokens"] for x, r in zip(xs, res)),
                   vs_resident=statistics.median([r["decode_s"] / x["decode_s"] for x, r in zip(xs, res)]),
                   vs_resident_median_token=statistics.median([statistics.median(r["token_s"]) /
                                                               statistics.median(x["token_s"])
                                                               for x, r in zip(xs, res)]))
        if stream:
            n = [len(x["token_s"]) for x in xs]
            per_tok = [x["delta"]["critical_bytes"] / k for x, k in zip(xs, n)]
            spec_tok = [x["delta"]["speculative_bytes"] / k for x, k in zip(xs, n)]
            hm = [(x["delta"]["hits"], x["delta"]["misses"]) for x in xs]
            la = [(x["delta"]["lookahead_reads"], x["delta"]["lookahead_used"]) for x in xs]
            bpt = statistics.median(per_tok)
            ceiling = raw_gbps * 1e9 / bpt if bpt else None
            stall_tok = statistics.median([x["delta"]["stall_s"] / k for x, k in zip(xs, n)])
            row.update(budget_bytes=xs[0]["budget_bytes"], slots=xs[0]["slots"],
                       slot_share=xs[0]["slots"] * eb / total, page_cache=xs[0]["page_cache"],
                       bytes_per_token=bpt, speculative_bytes_per_token=statistics.median(spec_tok),
                       misses_per_token=statistics.median([x["delta"]["misses"] / k for x, k in zip(xs, n)]),
                       hit_rate=statistics.median([h / max(1, h + m) for h, m in hm]),
                       hits_prefetched=sum(x["delta"]["hits_prefetched"] for x in xs),
                       stall_share=statistics.median([x["delta"]["stall_s"] / x["decode_s"] for x in xs]),
                       stall_s_per_token=stall_tok,
                       read_s_per_token_at_raw=bpt / (raw_gbps * 1e9),
                       ceiling_tps=ceiling, vs_ceiling=row["decode_tps"] / ceiling if ceiling else None,
                       lookahead_reads=sum(r for r, _ in la), lookahead_used=sum(u for _, u in la),
                       lookahead_precision=(sum(u for _, u in la) / sum(r for r, _ in la)
                                            if sum(r for r, _ in la) else None))
            # compute and reads one after the other (no overlap) at the resident compute speed and the raw bandwidth
            r_tps = statistics.median([x["decode_tps"] for x in res])
            row["serial_model_tps"] = 1 / (1 / r_tps + bpt / (raw_gbps * 1e9))
        rows.append(row)
    by = {r["run"]: r for r in rows}
    small_row, la_row = by["streamed, small"], by["streamed, small, look-ahead"]
    lookahead = dict(precision=la_row["lookahead_precision"], hits_prefetched=la_row["hits_prefetched"],
                     stall_s_per_token_without=small_row["stall_s_per_token"],
                     stall_s_per_token_with=la_row["stall_s_per_token"],
                     stall_removed_share=(1 - la_row["stall_s_per_token"] / small_row["stall_s_per_token"]
                                          if small_row["stall_s_per_token"] else None))
    fits = by["streamed, fits"]
    return dict(model=model, prompt_tokens=len(prompt), raw=raws, raw_gbps=raw_gbps, children=children, rows=rows,
                lookahead=lookahead, fits_vs_resident=fits["vs_resident"],
                fits_goal_met=fits["vs_resident"] >= RATIO_GOAL)


# --- reporting --------------------------------------------------------------------------------------------------------


def print_tables(doc: dict) -> None:
    if "replay" in doc:
        rp = doc["replay"]
        tr = rp["trace"]
        print(f"\nhit rates: the demo's routing over {tr['tokens']:,} held-out tokens ({tr['routings']:,} routings, "
              f"{tr['expert_layers']} expert-layers, top-{tr['top_k']}); budget = cache slots")
        head = (f"{'budget':>6} {'LRU':>7} {'LRFU':>7} {'fixed':>7} {'Belady':>7} {'LRFU-fixed':>10} "
                f"{'gap closed':>10}  goals (beats fixed, >= 1/3 of the gap)")
        print(head)
        print("-" * len(head))
        for r in rp["hit_rates"]:
            gc = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.0%}"
            print(f"{r['budget']:>6} {r['lru']:>7.1%} {r['lrfu']:>7.1%} {r['best_fixed']:>7.1%} {r['belady']:>7.1%} "
                  f"{(r['lrfu'] - r['best_fixed']) * 100:>+9.1f}p {gc:>10}  "
                  f"{'yes' if r['beats_fixed'] else 'NO'}, {'yes' if r['closes_third'] else 'NO'}")
        ls = rp["lam_sweep"]
        print(f"\nLRFU hit rate by lam (per token; default {ls['default_lam']})")
        head = f"{'budget':>6} " + " ".join(f"{lam:>7}" for lam in ls["lams"])
        print(head)
        print("-" * len(head))
        for r in ls["rows"]:
            print(f"{r['budget']:>6} " + " ".join(f"{r[str(lam)]:>7.1%}" for lam in ls["lams"]))
        print(f"\ndisk on misses: GB/s of expert bytes over page-in seconds and that / raw, the raw O_DIRECT bandwidth "
              f"measured right before the replay (sequential {rp['store']['expert_bytes']:,}-byte reads at the "
              f"worker count that was best in the budget's round; run median of the rounds' best "
              f"{rp['raw_best_gbps']:.2f} GB/s, mostly at {rp['raw_best_workers']} workers); page cache "
              f"{'bypassed (O_DIRECT)' if rp['direct'] else 'ON'}")
        modes = [x["mode"] for x in rp["disk_summary"]]
        head = f"{'budget':>6} {'policy':<6} " + " ".join(f"{m:>11}" for m in modes)
        print(head)
        print("-" * len(head))
        for b in sorted({d["budget"] for d in rp["disk"]}):
            for p in ("lru", "lrfu"):
                cells = []
                for m in modes:
                    d = next((d for d in rp["disk"] if (d["budget"], d["policy"], d["mode"]) == (b, p, m)), None)
                    cells.append("-" if d is None or d["gbps"] is None else f"{d['gbps']:.2f} {d['ratio']:.2f}x")
                print(f"{b:>6} {p:<6} " + " ".join(f"{c:>11}" for c in cells))
        print("fan* = fan-out whose page-in loop waits only on reads still pending (the streamer's waits on every "
              "in-flight read)")
        print("\nby workers and fan-out, over every budget and policy: median (min-max) of GB/s on misses / paired raw")
        for x in rp["disk_summary"]:
            print(f"  {x['mode']:<9} {x['median_ratio']:.2f} ({x['min_ratio']:.2f}-{x['max_ratio']:.2f}); "
                  f"{x['median_gbps']:.2f} GB/s against raw {x['median_raw_gbps']:.2f}; "
                  f"{x['misses_per_call']:.1f} misses per layer call that misses; {x['waits_per_miss']:.0f} waits "
                  f"per miss, {x['cpu_s_per_gb']:.2f} CPU s per GB")
        if rp["best_streamer_mode"]:
            print(f"the streamer's best mode: {rp['best_streamer_mode']} at {rp['best_streamer_median_ratio']:.2f} x "
                  f"raw "
                  f"(StreamConfig's default mode {rp['default_mode']}); fan-out waiting on pending reads only: "
                  + (f"{rp['best_pending_only_mode']} at {rp['best_pending_only_median_ratio']:.2f}"
                     if rp["best_pending_only_mode"] else "-"))
        cached = [d["page_cache_resident_after"] for d in rp["disk"] if d["page_cache_resident_after"] is not None]
        if cached:
            print(f"page cache after the replays: at most {max(cached):.2%} of the store file resident")
    if "e2e" in doc:
        e = doc["e2e"]
        m = e["model"]
        print(f"\nend to end: {m['moe_layers']} MoE layers x {m['experts_per_layer']} experts x "
              f"{m['expert_bytes'] / 1e6:.2f} MB ({m['expert_total_bytes'] / 1e6:.0f} MB of experts), {RECIPE}, "
              f"{e['prompt_tokens']}-token prompt, greedy; the four runs in one process, one token each in turn; raw "
              f"O_DIRECT {e['raw_gbps']:.2f} GB/s")
        head = (f"{'run':<28} {'cache':>6} {'tok/s':>7} {'x resid':>7} {'x med':>6} {'MB/tok':>7} {'hit':>5} "
                f"{'stall':>6} {'ceiling':>8} {'x ceil':>7} {'same':>5}")
        print(head)
        print("-" * len(head))
        for r in e["rows"]:
            s = "slot_share" in r
            print(f"{r['run']:<28} {(format(r['slot_share'], '.0%') if s else 'all'):>6} {r['decode_tps']:>7.3f} "
                  f"{r['vs_resident']:>6.2f}x {r['vs_resident_median_token']:>5.2f}x "
                  f"{(format(r['bytes_per_token'] / 1e6, '.1f') if s else '-'):>7} "
                  f"{(format(r['hit_rate'], '.0%') if s else '-'):>5} "
                  f"{(format(r['stall_share'], '.1%') if s else '-'):>6} "
                  f"{(format(r['ceiling_tps'], '.0f') if s and r['ceiling_tps'] else '-'):>8} "
                  f"{(format(r['vs_ceiling'], '.4f') if s and r['vs_ceiling'] else '-'):>7} "
                  f"{'yes' if r['same_tokens_as_resident'] else 'NO':>5}")
        la = e["lookahead"]
        if la["precision"] is not None:
            removed = la["stall_removed_share"]
            print(f"look-ahead: {la['precision']:.0%} of the experts read ahead were routed, {la['hits_prefetched']} "
                  f"prefetched hits; stall {la['stall_s_per_token_without'] * 1e3:.0f} ms per token without, "
                  f"{la['stall_s_per_token_with'] * 1e3:.0f} ms with"
                  + (f" ({-removed:+.0%})" if removed is not None else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--parts", default="replay,e2e", help="replay, e2e or both (default)")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary directory, removed afterwards; a "
                                             "given one keeps the expert file, the trace and the model for reuse)")
    p.add_argument("--out", type=Path, default=Path("bench-results/streaming.json"), help="JSON result file")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per child process")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)
    parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    if not parts <= {"replay", "e2e"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'replay', 'e2e'})}")

    tmp = a.work is None
    work = Path(tempfile.mkdtemp(prefix="tqbench-bench-streaming-")) if tmp else a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    notes: list[str] = []
    doc: dict = dict(schema=SCHEMA, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=[sys.executable, *sys.argv],
                     machine=machine_info(work, RELEVANT), config=dict(cfg, quick=a.quick, parts=sorted(parts),
                                                             recipe=RECIPE, default_policy=DEFAULT_POLICY,
                                                             ratio_goal=RATIO_GOAL), notes=notes)
    try:
        if "replay" in parts:
            print("tracing the demo's routing ...", end=" ", flush=True)
            trace, info = prepare_trace(work, cfg, a.timeout)
            print(("reused" if info["reused"] else f"{info['trace_seconds']:.0f}s") + f": {trace.shape}", flush=True)
            doc["replay"] = run_replay(work, cfg, trace, info, notes)
        if "e2e" in parts:
            doc["e2e"] = run_e2e(work, cfg, a.quick, a.timeout, notes)
        goals = {}
        if "replay" in doc:
            hr = doc["replay"]["hit_rates"]
            goals["default_policy_beats_best_fixed_at_every_budget"] = all(r["beats_fixed"] for r in hr)
            goals["default_policy_closes_a_third_of_lru_gap_at_every_budget"] = all(r["closes_third"] for r in hr)
            best = doc["replay"]["best_streamer_median_ratio"]
            goals["disk_ratio_at_least_0.9_in_the_streamers_best_mode"] = best is not None and best >= RATIO_GOAL
        if "e2e" in doc:
            goals["streamed_over_resident_at_least_0.9_when_it_fits"] = doc["e2e"]["fits_goal_met"]
        doc["goals"] = goals
        end = machine_info(work, RELEVANT)
        doc["machine"]["git_commit_end"] = end.get("git_commit")
        doc["machine"]["load_average_end"] = end.get("load_average")
        if end.get("git_commit") != doc["machine"].get("git_commit"):
            changed = changed_paths(doc["machine"].get("git_commit"), end.get("git_commit"), RELEVANT)
            doc["machine"]["changed_during_run"] = changed
            notes.append(f"the repository moved from {doc['machine'].get('git_commit')} to {end.get('git_commit')} "
                         "during the run; " + (f"these files the benchmark runs changed: {', '.join(changed)}: "
                                               "measurements may mix versions" if changed else
                                               f"none of {', '.join(RELEVANT)} changed"))
        doc["total_seconds"] = time.perf_counter() - t_start
    finally:
        if tmp:
            shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_tables(doc)
    print("\ngoals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in doc["goals"].items()))
    for n in notes:
        print("note:", n)
    print(f"\nwrote {a.out} ({doc['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        sys.exit(main())

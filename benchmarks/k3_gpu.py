#!/usr/bin/env python3
"""The whole path on a GPU (issue 14): a Kimi-K3-shaped model streamed from NVMe, with the page cache bypassed.

    PYTHONPATH=. python3 benchmarks/k3_gpu.py --work /tmp/k3 --out k3.json        # on the GPU machine
    python benchmarks/k3_gpu.py --quick                                            # a CPU smoke run (about a minute)

What it does, in one run on one disk (the work directory):

1. Conversion (`--convert-layers`, `--convert-experts`): a seeded random K3-shaped source (`tqbench.demo.write_source`:
   K3's expert shapes, mxfp4 experts) converted for real with `tq3a-tqTe-down4-g64` by `benchmarks/convert.py`'s child,
   in fresh processes: once to pay MLX's kernel compilation (reported apart), then `--convert-pairs` rounds of each of
   `--convert-modes` (`arena`: the converter as it runs on a GPU, reading ahead into MLX memory; `bytes`: one unit
   ahead read as bytes, the converter before that; `passes`, `compare`, `cuda`: the arena with that quantizer kernel), the order
   rotating per round, with its per-stage timers; and the raw read+write of the same bytes on the same disk, page
   cache dropped before each.
2. The streaming model: K3's expert shapes (hidden 7168, latent 3584, expert width 3072: 10.96 MB per expert at the
   recipe), `--layers` layers (the first dense) of `--experts` experts, top-16, smaller attention than K3 (see SPEC).
   Its source is written sparse for the routed experts (holes: a K3-shaped mxfp4 source of that size would not fit
   beside the output), and it is converted by the converter itself with one substitution (`SyntheticExperts`): each
   routed projection's codes and scales are computed once from random weights and written for every expert. So the
   expert bytes on disk are real converter output of the real size, their values are the same for every expert (the
   speed does not depend on them), and every other tensor is converted from its random source as usual.
3. This disk's raw O_DIRECT bandwidth at the expert size (`benchmarks/streaming.py`'s `raw_round`: consecutive
   expert-sized chunks of the shard files), and the same number of reads of whole experts (their aligned ranges, as
   the streamer reads them) picked at random over the model's experts, seeded (`raw["random"]`: what misses read).
4. Decode, each run in this order in one fresh process, greedy, the same random-token prompts: A) prompt A cold at
   native top-16, whose routings make a profile (counts per expert); B) prompt B cold; C) prompt B warm-started from
   A's profile (pinned share `--pin-share` of the budget, preloaded before the prompt, the counts seeding the cache);
   D) prompt B cold at `--max-active-experts 8`; E) prompt B cold with look-ahead. Budget `--budget-gb`, page cache
   off, `--workers` read threads. Before the runs, one untimed prompt of the same length (and one token) per top-k in
   a model loaded and closed again, so no timed run pays for compiling kernels (`stream.warmups`: its seconds and
   its wait on reads). Per run: prefill tok/s with the prompt's misses, bytes, wait on reads and the rest (`prefill`),
   decode tok/s, expert bytes read per token, hit rate by tier,
   stall (waiting on reads and slot writes) per token and per layer, and for B the LRU / LRFU / Belady / best fixed
   set hit rates of its whole trace (prefill included) at the same slot count, next to the streamer's own; and where
   each miss's wait went (`per_miss_ms`, from the streamer's `miss_*` totals: queued, read, waiting for a buffer,
   copied into the slot, prefetch calls, and the page-in's wall time before / during / after the reads).
5. Resident: the same model with every expert in GPU memory (an upper bound for a model that fits), fresh process.
6. The projection for full K3 (92 MoE layers, 10.96 MB experts) at top-16 and top-8 on this disk, from the measured
   per-expert read cost on misses and the resident per-layer compute, at the hit rates measured here.

Writes JSON (`--out`) after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from harness import add_size_options, drop_cache, emit, machine_info, output_digest, run_child, sizes

SCHEMA = "tqbench.bench.k3gpu/1"
RECIPE = "tq3a-tqTe-down4-g64"
SCRIPT = Path(__file__).resolve()  # the build and decode children run this file
K3_MOE_LAYERS, K3_EXPERT_BYTES = 92, 10_960_896
K3_EXPERTS = 896
K3_RESIDENT_BYTES = 27.6e9  # K3 at the recipe minus its routed experts (931 GB - 92 x 896 x 10.96 MB)
# The lent H200 box: 139 GB of GPU memory (less the resident weights and a 3 GB reserve for the expert cache) and
# 128 GB of RAM (less a tenth, the host tier's auto reserve there): each tier's share of full K3's experts.
BOX_GPU_BYTES, BOX_RAM_BYTES = 139e9, 128e9
K3_BOX_SHARES = dict(gpu=(BOX_GPU_BYTES - K3_RESIDENT_BYTES - 3e9) / (K3_MOE_LAYERS * K3_EXPERTS * K3_EXPERT_BYTES),
                     host=BOX_RAM_BYTES * 0.9 / (K3_MOE_LAYERS * K3_EXPERTS * K3_EXPERT_BYTES))
SEED_PROMPT_A, SEED_PROMPT_B, SEED_PROMPT_W = 11, 12, 13  # W: the compile warm-up's prompt

# K3's routed-expert shapes; attention narrower than K3's 96 heads and a smaller dense MLP and vocabulary, so that the
# model's resident part converts in seconds (the streamed experts are the subject).
SPEC = dict(hidden_size=7168, routed_expert_hidden_size=3584, moe_intermediate_size=3072, num_experts_per_token=16,
            num_shared_experts=1, intermediate_size=8192, num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=16, kda_head_dim=128,
            mla_every=4, first_k_dense_replace=1, bpe_merges=256, num_shards=8)
QUICK_SPEC = dict(SPEC, hidden_size=256, routed_expert_hidden_size=256, moe_intermediate_size=256,
                  num_experts_per_token=4, intermediate_size=512, num_attention_heads=4, q_lora_rank=64,
                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kda_num_heads=4,
                  kda_head_dim=32, num_shards=2)
DEFAULTS = dict(layers=9, experts=384, budget_gb=6.0, host_gb=24.0, workers=4, prompt=4, tokens=24, warmup=2,
                pin_share=0.5, cache_margins="0.02,0.1",
                convert_layers=2, convert_experts=32, convert_pairs=2, convert_modes="arena,passes",
                raw_bytes=1536 * 2**20)
QUICK = dict(layers=3, experts=16, budget_gb=0.004, host_gb=0.008, workers=2, prompt=3, tokens=4, warmup=1,
             pin_share=0.5, cache_margins="0.02,0.1",
             convert_layers=2, convert_experts=4, convert_pairs=1, convert_modes="arena,bytes,compare",
             raw_bytes=8 * 2**20)


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and name.endswith((".weight_packed", ".weight_scale"))


# --- the streaming model ----------------------------------------------------------------------------------------------


def write_sparse_source(dest: Path, spec, seed: int = 0) -> None:
    """`tqbench.demo.write_source` with the routed experts' data left as holes in the shards (sparse files)."""
    from tqbench.demo import demo_tokenizer_ranks, random_weights, split_shards
    from tqbench.demo.spec import source_config, special_ids, tensor_plan
    from tqbench.layout.names import shard_file
    from tqbench.shards import header_bytes
    from tqbench.tokenizer import write_tokenizer

    dest.mkdir(parents=True)
    write_tokenizer(dest, demo_tokenizer_ranks(spec))
    weights, weight_map = random_weights(seed), {}
    shards = split_shards(tensor_plan(spec), spec.num_shards)
    for k, tensors in enumerate(shards):
        name = shard_file(k, len(shards))
        with open(dest / name, "wb") as f:
            f.write(header_bytes(tensors, {"format": "pt"}))
            for t in tensors:
                if is_routed_expert(t.name):
                    f.seek(t.nbytes, os.SEEK_CUR)
                else:
                    f.write(np.ascontiguousarray(weights(t)).tobytes())
                weight_map[t.name] = name
            f.truncate(f.tell())
    total = sum(t.nbytes for s in shards for t in s)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (dest / "config.json").write_text(json.dumps(source_config(spec)))
    (dest / "generation_config.json").write_text(json.dumps(special_ids(spec)))


def synthetic_experts_class():
    import mlx.core as mx

    from tqbench.convert.produce import Producer

    class SyntheticExperts(Producer):
        """Routed experts: one projection's codes computed from random weights once and written for every expert
        (the source holds holes there); everything else is produced from the source as usual."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._outputs: dict[str, tuple] = {}

        def unit_reads(self, unit, after):
            return [(e, d) for e, d in super().unit_reads(unit, after) if not is_routed_expert(e.name)]

        def decode(self, parts, fmt):
            if "weight_packed" in parts and is_routed_expert(parts["weight_packed"].name):
                rows, half = parts["weight_packed"].shape
                return mx.random.normal((rows, 2 * half), key=mx.random.key(rows + half)) * (2 * half) ** -0.5
            return super().decode(parts, fmt)

        def module_outputs(self, m, expert):
            if expert is None:
                return super().module_outputs(m, expert)
            key = f"{m.name.rsplit('.', 1)[-1]}:{m.source.shape}:{m.choice}"
            if key not in self._outputs:
                self._outputs[key] = super().module_outputs(m, expert)
            out, nbytes, err = self._outputs[key]
            return out, nbytes, err

    return SyntheticExperts


def child_build(a: dict) -> None:
    """Write the sparse source and convert it (synthetic expert codes) into a["dst"]."""
    t0 = time.perf_counter()
    from tqbench.convert import convert
    from tqbench.demo import DemoSpec
    from tqbench.events import ConvertFinished
    from tqbench.recipe import Recipe
    spec = DemoSpec(**a["spec"])
    src, dst = Path(a["src"]), Path(a["dst"])
    t1 = time.perf_counter()
    write_sparse_source(src, spec)
    t2 = time.perf_counter()
    fin = None
    for ev in convert(src, dst, Recipe.parse(RECIPE), force=True, producer_class=synthetic_experts_class()):
        if isinstance(ev, ConvertFinished):
            fin = ev
    t3 = time.perf_counter()
    emit(dict(mode="build", import_s=t1 - t0, write_source_s=t2 - t1, convert_s=t3 - t2,
              bytes_out=fin.bytes_out if fin else None))


# --- decode runs ------------------------------------------------------------------------------------------------------


def child_decode(a: dict) -> None:
    """The runs of a["runs"] one after another in this process (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.runtime.load import load
    from tqbench.runtime.routing import set_active_experts
    from tqbench.stream.stats import MISS_TIMES
    from tqbench.stream.streamer import StreamConfig
    from streaming import streamer_stats  # the streamer's counters, as the streaming benchmark takes them

    from tqbench import cubin

    def _counters(st) -> dict:  # and where the misses' time went
        return dict(streamer_stats(st), **{k: getattr(st.stats, k) for k in MISS_TIMES})

    prompts = {k: mx.array(np.array(v, dtype=np.uint32))[None] for k, v in a["prompts"].items()}
    profile: dict[tuple[int, int], int] = {}
    out = []
    warmups = []
    streamed = [r for r in a["runs"] if r.get("stream")]
    if a.get("compile_warmup") and streamed:
        # MLX compiles a kernel the first time a process runs it (from its disk cache, or from source on a fresh
        # machine): one untimed prompt of the same length and one decode token, per top-k among the runs, in a model
        # loaded and closed here, so the timed prefills below start from an empty expert cache with kernels compiled
        for top_k in dict.fromkeys(r.get("top_k") for r in streamed):
            t0 = time.perf_counter()
            loaded = load(a["path"], streaming=StreamConfig(**streamed[0]["stream"]), tokenizer=False)
            if top_k:
                set_active_experts(loaded.model, top_k)
            cache = make_prompt_cache(loaded.model)
            t1 = time.perf_counter()
            tok = mx.argmax(loaded.model(prompts["W"], cache=cache)[:, -1], axis=-1)
            mx.eval(tok)
            prefill_s = time.perf_counter() - t1
            mx.eval(loaded.model(tok[:, None], cache=cache))
            stall_s = loaded.streamer.stats.stall_s
            loaded.streamer.close()
            warmups.append(dict(top_k=top_k, seconds=time.perf_counter() - t0, prefill_s=prefill_s, stall_s=stall_s,
                                nvrtc=asdict(cubin.STATS)))  # tqbench's kernels compiled (or loaded) so far
            del loaded, cache, tok
            mx.clear_cache()
    for run in a["runs"]:
        t0 = time.perf_counter()
        stream = run.get("stream")
        loaded = load(a["path"], streaming=StreamConfig(**stream) if stream else None, tokenizer=False)
        st = loaded.streamer
        if run.get("top_k"):
            set_active_experts(loaded.model, run["top_k"])
        load_s = time.perf_counter() - t0
        pinned = 0
        if run.get("warm") and st is not None:  # the profile learned in run A: hottest first
            ranked = [k for k, _ in sorted(profile.items(), key=lambda kv: -kv[1])]
            pinned = st.preload(ranked, run["pin_share"], dict(profile))
        preload_s = st.stats.preload_s if st else 0.0
        cache = make_prompt_cache(loaded.model)
        before_prefill = _counters(st) if st else None
        t1 = time.perf_counter()
        logits = loaded.model(prompts[run["prompt"]], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        prefill_s = time.perf_counter() - t1
        after_prefill = _counters(st) if st else None
        tokens, times, before = [int(tok.item())], [], None
        for i in range(a["warmup"] + a["tokens"]):
            if i == a["warmup"]:
                before = _counters(st) if st else None
                n_events = len(st.events) if st else 0
            t = time.perf_counter()
            logits = loaded.model(tok[:, None], cache=cache)
            tok = mx.argmax(logits[:, -1], axis=-1)
            mx.eval(tok)
            if i >= a["warmup"]:
                times.append(time.perf_counter() - t)
            tokens.append(int(tok.item()))
        r = dict(label=run["label"], load_s=load_s, prefill_s=prefill_s, prompt_tokens=int(prompts[run["prompt"]].size),
                 token_s=times, decode_s=sum(times), decode_tps=len(times) / sum(times), tokens=tokens,
                 weight_bytes=loaded.weight_bytes, stream=stream, top_k=run.get("top_k"))
        if st is not None:
            after = _counters(st)
            events = st.events[n_events:]
            if run.get("learn"):
                for e in st.events:
                    for x in e.experts:
                        profile[(e.layer, x)] = profile.get((e.layer, x), 0) + 1
            per_layer: dict[int, dict] = {}
            for e in events:
                d = per_layer.setdefault(e.layer, dict(stall_s=0.0, misses=0, routed=0))
                d["stall_s"] += e.stall_s
                d["misses"] += sum(k == "miss" for k in e.served)
                d["routed"] += len(e.experts)
            r.update(delta={k: after[k] - before[k] for k in after if k != "cache_bytes_max"},
                     prefill_delta={k: after_prefill[k] - before_prefill[k] for k in after if k != "cache_bytes_max"},
                     pinned=pinned, preload_s=preload_s,
                     preload_bytes=st.stats.preload_bytes, slots=st.stats.slots, slot_bytes=st.stats.slot_bytes,
                     staging_bytes=st.stats.staging_bytes, budget_bytes=st.stats.budget_bytes,
                     cache_bytes_max=st.stats.cache_bytes_max, page_cache=st.stats.page_cache,
                     per_layer={str(k): v for k, v in sorted(per_layer.items())},
                     hit_rate_all=st.stats.hit_rate(),  # the whole run: prefill, warm-up and measured tokens
                     gpu_prefetch=dict(active=st.prefetch.active, calls=st.prefetch.calls, error=st.prefetch.error),
                     dma=dict(active=st.dma.active, calls=st.dma.calls, error=st.dma.error,
                              pinned_bytes=st.dma.pinned_bytes),
                     trace=[[e.token, e.layer, list(e.experts)] for e in st.events])
            st.close()
        out.append(r)
        del loaded, cache, logits
        mx.clear_cache()
    emit(dict(mode="decode", runs=out, warmups=warmups, mlx_peak=int(mx.get_peak_memory()),
              device=str(mx.default_device())))


CHILDREN = {"build": child_build, "decode": child_decode}


# --- parts ------------------------------------------------------------------------------------------------------------


def convert_modes(names: str) -> dict[str, tuple[dict, dict]]:
    """The conversion variants `--convert-modes` names: converter arguments and environment of each. `arena`: the
    converter as on a GPU (reading ahead into MLX memory); `bytes`: one unit ahead read as bytes (`read_ahead=0`, the
    converter before the arena); `passes`, `compare`, `cuda`: the arena with that quantizer kernel (TQBENCH_QUANTIZER;
    `arena` uses the device's default, `cuda` on a GPU since 2026-12-02, `passes` before)."""
    from tqbench.convert.pipeline import READ_AHEAD
    known = {"arena": (dict(read_ahead=READ_AHEAD), {}), "bytes": (dict(read_ahead=0), {}),
             "compare": (dict(read_ahead=READ_AHEAD), {"TQBENCH_QUANTIZER": "compare"}),
             "cuda": (dict(read_ahead=READ_AHEAD), {"TQBENCH_QUANTIZER": "cuda"}),
             "passes": (dict(read_ahead=READ_AHEAD), {"TQBENCH_QUANTIZER": "passes"})}
    modes = names.split(",")
    if modes[0] != "arena" or any(m not in known for m in modes):
        raise SystemExit(f"--convert-modes: arena first, then any of {', '.join(known)}; not {names!r}")
    return {m: known[m] for m in modes}


def part_convert(work: Path, spec_kw: dict, cfg: dict, timeout: float) -> dict:
    """A real K3-shaped source converted in fresh processes: first `arena` with kernel compilation included, then
    `convert_pairs` rounds of every mode of `convert_modes` (see there; the order rotates from round to round), and
    the raw read+write of the same bytes."""
    from tqbench.demo import DemoSpec, write_source
    convert_py = Path(__file__).resolve().parent / "convert.py"
    spec = DemoSpec(**dict(spec_kw, num_hidden_layers=cfg["convert_layers"], num_experts=cfg["convert_experts"]))
    modes = convert_modes(cfg["convert_modes"])
    src = work / "convert-source"
    t0 = time.perf_counter()
    write_source(src, spec, 0)
    write_s = time.perf_counter() - t0
    files = sorted(src.glob("*.safetensors"))
    source_bytes = sum(f.stat().st_size for f in files)
    names = list(modes)
    rounds = [names[i % len(names):] + names[:i % len(names)] for i in range(1, cfg["convert_pairs"] + 1)]
    order = [("arena", None)] + [(m, i) for i, r in enumerate(rounds) for m in r]
    runs = []
    for i, (mode, rnd) in enumerate(order):
        dst = work / f"convert-out-{i}"
        drop_cache(files)
        kw, env = modes[mode]
        runs.append(run_child(convert_py, "convert", dict(src=str(src), dst=str(dst), recipe=RECIPE,
                                                          shard_size=5 * 2**30, stages=True, **kw), timeout, env))
        runs[-1].update(mode=mode, first=i == 0, round=rnd, output_digest=output_digest(dst),
                        output_bytes=sum(f.stat().st_size for f in dst.iterdir() if f.is_file()))
        if i < len(order) - 1:
            for f in dst.iterdir():
                f.unlink()
            dst.rmdir()
    drop_cache(files)
    raw = run_child(convert_py, "raw", dict(files=[str(f) for f in files], dst=str(work / "raw.bin"),
                                            write_bytes=runs[-1]["output_bytes"]), timeout)
    timed = runs[1:]
    warm = {m: statistics.median(r["seconds"] for r in timed if r["mode"] == m) for m in names}
    by_round = [{r["mode"]: r["seconds"] for r in timed if r["round"] == i} for i in range(len(rounds))]
    out = dict(spec=asdict(spec), write_source_s=write_s, source_bytes=source_bytes, modes=names, runs=runs, raw=raw,
               mb_per_s={m: source_bytes / warm[m] / 1e6 for m in names},
               vs_raw_by_mode={m: warm[m] / raw["seconds"] for m in names},
               speedup_over_arena={m: [x["arena"] / x[m] for x in by_round] for m in names[1:]},  # paired by round
               source_mb_per_s=source_bytes / warm["arena"] / 1e6, vs_raw=warm["arena"] / raw["seconds"],
               first_run_extra_s=runs[0]["seconds"] - warm["arena"])
    if "bytes" in modes:  # the keys of the first arena measurement (2026-12-02)
        out.update(bytes_mb_per_s=out["mb_per_s"]["bytes"], bytes_vs_raw=out["vs_raw_by_mode"]["bytes"],
                   arena_speedup_paired=[x["bytes"] / x["arena"] for x in by_round])
    return out


def build_model(work: Path, spec_kw: dict, cfg: dict, timeout: float) -> dict:
    spec = dict(spec_kw, num_hidden_layers=cfg["layers"], num_experts=cfg["experts"])
    dst, marker = work / "k3-stream", work / "k3-stream.json"
    info: dict = dict(spec=spec, path=str(dst), reused=True)
    if not (marker.is_file() and json.loads(marker.read_text()) == spec):
        marker.unlink(missing_ok=True)
        src = work / "k3-stream-source"
        for d in (src, dst):
            if d.exists():
                subprocess.run(["rm", "-rf", str(d)], check=True)
        info.update(run_child(SCRIPT, "build", dict(spec=spec, src=str(src), dst=str(dst)), timeout), reused=False)
        subprocess.run(["rm", "-rf", str(src)], check=True)
        marker.write_text(json.dumps(spec))
    from tqbench.stream.store import ExpertStore
    store = ExpertStore.open(dst)
    lay = next(iter(store.layers.values()))
    info.update(files=[str(dst / f) for f in store.files], expert_bytes=lay.nbytes, moe_layers=len(store.layers),
                experts_per_layer=lay.experts, expert_total_bytes=sum(x.nbytes * x.experts
                                                                      for x in store.layers.values()),
                model_bytes=sum(f.stat().st_size for f in dst.iterdir() if f.is_file()))
    return info


def raw_random(model: Path, files: list[Path], chunk: int, total: int, workers: list[int], seed: int = 0) -> dict:
    """`raw_round`'s reads at random experts: as many reads as it makes (`total` // `chunk`, the first `workers` of
    each row warming the threads), each one expert's aligned range as the streamer's O_DIRECT read takes it, the
    experts drawn (seeded, without repeats while there are experts left) over every MoE layer of the model."""
    from streaming import timed_reads

    from tqbench.stream.store import ALIGN, ExpertStore

    store = ExpertStore.open(model)
    ranges = []
    for _, lay in sorted(store.layers.items()):
        for ext in lay.extents:
            (x,) = ext  # tqbench's layout: one range per expert
            start = x.offset // ALIGN * ALIGN
            ranges.append((store.root / store.files[x.file], start, -(-(x.offset + x.length) // ALIGN) * ALIGN - start))
    store.close()
    count = max(1, total // chunk)
    order = np.random.default_rng(seed).permutation(len(ranges))
    rows, used = [], 0
    for w in workers:
        picks = [ranges[order[(used + i) % len(order)]] for i in range(count)]
        used += count
        drop_cache(files)
        got, seconds, direct = timed_reads(picks, w)
        rows.append(dict(workers=w, reads=len(picks) - w, bytes=got, seconds=seconds,
                         gbps=got / seconds / 1e9 if seconds else None, direct=direct))
    best = max(rows, key=lambda r: r["gbps"] or 0)
    return dict(rows=rows, best_gbps=best["gbps"], best_workers=best["workers"], seed=seed, experts=len(ranges))


def trace_bounds(trace: list, slots: int) -> dict:
    """Hit rates of a run's whole trace (prefill included, from an empty cache) at its slot count: LRU, LRFU, Belady
    and the best fixed set; compare with the run's own `hit_rate_all`."""
    from streaming import belady_hit_rate, best_fixed_hit_rate, make_cache, simulate
    tokens: dict[int, list] = {}
    for t, layer, experts in trace:
        tokens.setdefault(t, []).append((layer, sorted(set(experts))))
    batches = [tokens[t] for t in sorted(tokens)]
    return dict(slots=slots, lru=simulate(batches, make_cache(slots, "lru"))["hit_rate"],
                lrfu=simulate(batches, make_cache(slots, "lrfu"))["hit_rate"],
                belady=belady_hit_rate(batches, slots), best_fixed=best_fixed_hit_rate(batches, slots))


def summarize(run: dict) -> dict:
    d, n = run.get("delta"), len(run["token_s"])
    row = dict(label=run["label"], decode_tps=run["decode_tps"], prefill_tps=run["prompt_tokens"] / run["prefill_s"],
               token_s_median=statistics.median(run["token_s"]), load_s=run["load_s"])
    if d:
        routed = d["hits"] + d["misses"]
        stall = d["stall_s"] / n
        host = d.get("hits_host", 0)
        row.update(hit_rate=d["hits"] / max(1, routed), hits_pinned=d["hits_pinned"], hits_cache=d["hits_cache"],
                   hits_prefetched=d["hits_prefetched"], hits_host=host, misses_per_token=d["misses"] / n,
                   tiers=dict(gpu=(d["hits"] - host) / max(1, routed), host=host / max(1, routed),
                              disk=d["misses"] / max(1, routed)),
                   host_hits_per_token=host / n, substitutions_per_token=d.get("substitutions", 0) / n,
                   host_copy_ms=d["host_copy_s"] / host * 1e3 if host else None,
                   bytes_per_token=d["critical_bytes"] / n, speculative_bytes_per_token=d["speculative_bytes"] / n,
                   stall_s_per_token=stall, stall_share=d["stall_s"] / run["decode_s"],
                   read_s_per_miss=d["stall_s"] / d["misses"] if d["misses"] else None,
                   disk_gbps_on_misses=d["critical_bytes"] / d["stall_s"] / 1e9 if d["stall_s"] else None,
                   pinned=run.get("pinned"), preload_s=run.get("preload_s"), preload_bytes=run.get("preload_bytes"),
                   slots=run["slots"], budget_bytes=run["budget_bytes"], cache_bytes_max=run["cache_bytes_max"],
                   gpu_prefetch=run.get("gpu_prefetch"), dma=run.get("dma"))
        p = run["prefill_delta"]  # the prompt's one forward pass: its reads, its wait, and the rest (compute)
        row["prefill"] = dict(tokens=run["prompt_tokens"], seconds=run["prefill_s"], hits=p["hits"],
                              misses=p["misses"], bytes=p["critical_bytes"], stall_s=p["stall_s"],
                              other_s=run["prefill_s"] - p["stall_s"],
                              disk_gbps=p["critical_bytes"] / p["stall_s"] / 1e9 if p["stall_s"] else None)
        timed = d.get("miss_timed")
        if timed:  # where a miss's wait went, ms per timed miss (look-ahead's reads are not timed)
            ms = {k[5:-2]: d[k] / timed * 1e3 for k in d if k.startswith("miss_") and k.endswith("_s")}
            ms["stall"] = d["stall_s"] / d["misses"] * 1e3
            ms["outside_page_in"] = ms["stall"] - ms["before_reads"] - ms["reading"] - ms["after_reads"]
            row["per_miss_ms"] = dict(ms, timed=timed)
    return row


def projection(read_s_per_miss: float, layer_compute_s: float, hit_rates: dict[str, float], raw_gbps: float) -> list:
    """Full K3 (92 MoE layers, 10.96 MB experts) on this disk: tok/s = 1 / (misses x read cost + 93 layers' compute),
    and the disk-only ceiling (misses' bytes at the raw bandwidth)."""
    rows = []
    for k in (16, 8):
        for name, h in hit_rates.items():
            misses = K3_MOE_LAYERS * k * (1 - h)
            serial = misses * read_s_per_miss + 93 * layer_compute_s
            rows.append(dict(top_k=k, hit_rate_from=name, hit_rate=h, misses_per_token=misses,
                             bytes_per_token=misses * K3_EXPERT_BYTES, tps=1 / serial,
                             disk_ceiling_tps=raw_gbps * 1e9 / (misses * K3_EXPERT_BYTES) if misses else None))
    return rows


def box_budget(model: dict, share: float, workers: int) -> int:
    """An expert cache budget holding `share` of the model's experts (at least one) plus the streamer's O_DIRECT
    staging buffers, as the budget counts them."""
    from tqbench.stream.store import ALIGN
    from tqbench.stream.pagein import staging_bytes

    eb = model["expert_bytes"]
    return max(eb, int(share * model["expert_total_bytes"]) // eb * eb) + staging_bytes(eb + 2 * ALIGN, workers)


def tier_projection(box: dict, read_s_per_miss: float, layer_compute_s: float, raw_gbps: float) -> dict:
    """Full K3 on the lent box with both tiers (GPU and host shares of its experts, K3_BOX_SHARES), at the tier rates
    the K3-shaped model measured at those shares: tok/s = 1 / (misses x read cost + host copies x their wait + 93
    layers' compute). A host copy's wait: the run's stall less its misses at B cold's read cost, per host hit."""
    n_tokens = 1 / box["decode_tps"]  # seconds per token
    stall = box["stall_s_per_token"]
    misses_t, host_t = box["misses_per_token"], box["host_hits_per_token"]
    host_wait = max(0.0, stall - misses_t * read_s_per_miss) / host_t if host_t else 0.0
    rows = []
    for k in (16, 8):
        misses = K3_MOE_LAYERS * k * box["tiers"]["disk"]
        hosted = K3_MOE_LAYERS * k * box["tiers"]["host"]
        serial = misses * read_s_per_miss + hosted * host_wait + 93 * layer_compute_s
        rows.append(dict(top_k=k, tiers=box["tiers"], misses_per_token=misses, host_copies_per_token=hosted,
                         bytes_per_token=misses * K3_EXPERT_BYTES, tps=1 / serial,
                         disk_ceiling_tps=raw_gbps * 1e9 / (misses * K3_EXPERT_BYTES) if misses else None))
    return dict(shares=K3_BOX_SHARES, host_wait_s=host_wait, measured_token_s=n_tokens, rows=rows)


def finish(doc: dict) -> None:
    """The figures that need several parts: disk on misses against raw, and the K3 projection."""
    if "stream" not in doc or "raw" not in doc:
        return
    raw_gbps = doc["raw"]["best_gbps"]
    random_gbps = doc["raw"].get("best_gbps_random")
    eb = doc.get("model", {}).get("expert_bytes")
    for row in doc["stream"]["rows"]:
        if random_gbps and eb and "per_miss_ms" in row:  # one expert read alone at the random-read rate
            row["per_miss_ms"]["raw_random_read"] = eb / random_gbps / 1e6
    if "resident" in doc:  # each token's time: compute (as resident), waiting on reads and slot writes, the rest
        compute, layers = doc["resident"]["token_s_median"], doc["model"]["moe_layers"]
        for row in doc["stream"]["rows"]:
            stall = row["stall_s_per_token"]
            split = dict(compute=compute, waiting_on_reads=stall,
                         overhead=max(0.0, 1 / row["decode_tps"] - stall - compute))
            row["split_per_token_s"] = split
            row["split_per_layer_token_ms"] = {k: v * 1e3 / layers for k, v in split.items()}
    cold = next((r for r in doc["stream"]["rows"] if r["label"] == "B cold"), None)
    if cold is None:  # --runs without B: the ratios and the projection are the B cold run's
        return
    doc["disk_on_misses_vs_raw"] = (cold["disk_gbps_on_misses"] or 0) / raw_gbps
    if random_gbps:
        doc["disk_on_misses_vs_raw_random"] = (cold["disk_gbps_on_misses"] or 0) / random_gbps
    if "resident" in doc and cold["read_s_per_miss"]:
        b = cold["trace_bounds"]
        hit = {"measured (B cold)": cold["hit_rate"], "Belady (B trace)": b["belady"], "none": 0.0}
        layers = doc["model"]["spec"]["num_hidden_layers"]
        doc["projection_k3"] = projection(cold["read_s_per_miss"], doc["resident"]["token_s_median"] / layers, hit,
                                          raw_gbps)
        boxes = {r["label"]: r for r in doc["stream"]["rows"] if "K3 box tiers" in r["label"]}  # runs T, U, V
        per_layer = doc["resident"]["token_s_median"] / layers
        if "B cold, K3 box tiers" in boxes:
            doc["projection_k3_tiers"] = tier_projection(boxes["B cold, K3 box tiers"], cold["read_s_per_miss"],
                                                         per_layer, raw_gbps)
        if boxes:
            doc["projection_k3_tiers_by_run"] = {label: tier_projection(r, cold["read_s_per_miss"], per_layer, raw_gbps)
                                                 for label, r in boxes.items()}


def combine(docs: list[dict], names: list[str]) -> dict:
    out: dict = {"configs": {}}
    for d, name in zip(docs, names):
        out.update({k: v for k, v in d.items() if v is not None and k != "config"})
        out["configs"][name] = d.get("config")
    out["combined_from"] = names
    finish(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK, "a CPU smoke run at tiny shapes")
    p.add_argument("--parts", default="convert,stream,resident",
                   help="any of convert, build (the streaming model only), stream, resident")
    p.add_argument("--runs", default="A,B,W,8,L",
                   help="stream runs: A cold, B cold, W warm, 8 top-8, L look-ahead, F fan-out, X 16 workers, 1 one "
                        "worker, 2 two, R one read in flight, H host tier (--host-gb), P page cache on, T both tiers "
                        "at the shares full K3 gets on the lent box (B cold), N B cold and M the host tier with slots "
                        "written through host pages (no DMA copies: the way before), U as T warm from A's profile (needs A), "
                        "V as T with cache routing at the first of --cache-margins, C cache-aware routing at each of "
                        "--cache-margins")
    p.add_argument("--work", type=Path, help="work directory on the disk to measure (kept)")
    p.add_argument("--out", type=Path, default=Path("bench-results/k3_gpu.json"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--combine", nargs="+", type=Path, metavar="JSON",
                   help="merge the parts of runs cut into several calls (later files win) and redo the projection")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        CHILDREN[a.child[0]](json.loads(a.child[1]))
        return 0
    if a.combine:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(combine([json.loads(f.read_text()) for f in a.combine],
                                            [str(f) for f in a.combine]), indent=1) + "\n")
        return 0
    if a.work is None:
        p.error("--work is required (a directory on the disk to measure)")
    cfg = sizes(a, DEFAULTS, QUICK)
    spec_kw = QUICK_SPEC if a.quick else SPEC
    parts = set(a.parts.split(","))
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    doc: dict = dict(schema=SCHEMA, machine=machine_info(), config=cfg, spec=spec_kw, recipe=RECIPE, quick=a.quick)
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    save()
    if "convert" in parts:
        c = doc["convert"] = part_convert(work, spec_kw, cfg, a.timeout)
        log(f"convert: {c['source_bytes'] / 1e6:.0f} MB of source; " + "; ".join(
            f"{m} {c['mb_per_s'][m]:.1f} MB/s ({c['vs_raw_by_mode'][m]:.1f}x raw read+write)" for m in c["modes"])
            + "".join(f"; {m} speed-up over arena per round {', '.join(f'{x:.2f}' for x in v)}"
                      for m, v in c["speedup_over_arena"].items())
            + f"; first run +{c['first_run_extra_s']:.1f} s")
        save()
    if not parts & {"build", "stream", "resident"}:
        return 0
    model = doc["model"] = build_model(work, spec_kw, cfg, a.timeout)
    log(f"model: {model['moe_layers']} MoE layers x {model['experts_per_layer']} experts x "
        f"{model['expert_bytes'] / 1e6:.2f} MB = {model['expert_total_bytes'] / 1e9:.2f} GB of experts"
        + ("" if model["reused"] else f" (source {model['write_source_s']:.0f} s, convert {model['convert_s']:.0f} s)"))
    save()
    from streaming import raw_round
    files = [Path(f) for f in model["files"]]
    eb = model["expert_bytes"]
    thread_counts = sorted({1, cfg["workers"], 4, 16})
    raw = doc["raw"] = raw_round(files, eb, cfg["raw_bytes"], thread_counts, 0)
    raw["offsets"] = "consecutive chunks of the shard files"
    raw["random"] = raw_random(Path(model["path"]), files, eb, cfg["raw_bytes"], thread_counts)
    raw["best_gbps_random"] = raw["random"]["best_gbps"]
    raw_gbps = raw["best_gbps"]
    log(f"raw O_DIRECT: {raw_gbps:.2f} GB/s at {raw['best_workers']} workers (consecutive chunks), "
        + ", ".join(f"{r['gbps'] or 0:.2f}" for r in raw["random"]["rows"])
        + f" GB/s at {'/'.join(str(w) for w in thread_counts)} workers (random experts)")
    save()
    rng = np.random.default_rng
    vocab = 256 + spec_kw["bpe_merges"]
    prompts = {"A": rng(SEED_PROMPT_A).integers(0, vocab, cfg["prompt"]).tolist(),
               "B": rng(SEED_PROMPT_B).integers(0, vocab, cfg["prompt"]).tolist(),
               "W": rng(SEED_PROMPT_W).integers(0, vocab, cfg["prompt"]).tolist()}
    if "resident" in parts:
        drop_cache(files)
        starts = []
        for i in range(2):  # the second fresh process finds MLX's compiled kernels in its disk cache
            drop_cache(files)
            res = run_child(SCRIPT, "decode", dict(path=model["path"], prompts=prompts, warmup=cfg["warmup"],
                                                   tokens=cfg["tokens"], runs=[dict(label="resident", prompt="B")]),
                            a.timeout)
            r = res["runs"][0]
            starts.append(dict(load_s=r["load_s"], first_forward_s=r["prefill_s"],
                               process_wall_s=res["process_wall_s"], decode_tps=r["decode_tps"]))
            log(f"resident process {i + 1}: first forward {r['prefill_s']:.1f} s, decode {r['decode_tps']:.2f} tok/s, "
                f"load {r['load_s']:.1f} s")
        doc["resident"] = dict(summarize(r), weight_bytes=r["weight_bytes"], tokens=r["tokens"],
                               mlx_peak=res["mlx_peak"])
        doc["startup"] = dict(processes=starts, kernel_compile_and_checks_s=starts[0]["first_forward_s"]
                              - starts[1]["first_forward_s"])
        save()
    if "stream" in parts:
        stream = dict(budget_bytes=int(cfg["budget_gb"] * 1e9), workers=cfg["workers"], page_cache="off")
        half = spec_kw["num_experts_per_token"] // 2  # K3: 16 -> 8
        margins = [float(m) for m in str(cfg["cache_margins"]).split(",")]
        box = dict(stream, budget_bytes=box_budget(model, K3_BOX_SHARES["gpu"], cfg["workers"]),
                   host_budget_bytes=max(eb, int(K3_BOX_SHARES["host"] * model["expert_total_bytes"])))
        runs = [dict(label="A cold (learns the profile)", prompt="A", stream=stream, learn=True),
                dict(label="B cold", prompt="B", stream=stream),
                dict(label="B warm from A's profile", prompt="B", stream=stream, warm=True,
                     pin_share=cfg["pin_share"]),
                dict(label=f"B cold, top-{half}", prompt="B", stream=stream, top_k=half),
                dict(label="B cold, look-ahead", prompt="B", stream=dict(stream, lookahead=True)),
                # a layer misses about 5 experts, read by 4 threads: does splitting each read across the threads
                # (fan-out), a thread per miss (16) or one thread change the wait per miss? (On 2026-12-02 the
                # lent disk read random experts at 2.35 GB/s with one thread and 1.62 with four.)
                dict(label="B cold, fan-out", prompt="B", stream=dict(stream, fanout=True)),
                dict(label="B cold, 16 workers", prompt="B", stream=dict(stream, workers=16)),
                dict(label="B cold, 1 worker", prompt="B", stream=dict(stream, workers=1)),
                dict(label="B cold, 2 workers", prompt="B", stream=dict(stream, workers=2)),
                # the workers' copies overlap the reads, but one read at a time reaches the disk
                dict(label="B cold, 1 read in flight", prompt="B", stream=dict(stream, reads_in_flight=1)),
                # issue 33: the host-RAM tier under the same GPU budget, the OS page cache instead, and both tiers at
                # the shares of full K3's experts the lent box's GPU and RAM would hold
                dict(label="B cold, host tier", prompt="B",
                     stream=dict(stream, host_budget_bytes=int(cfg["host_gb"] * 1e9))),
                dict(label="B cold, page cache on", prompt="B", stream=dict(stream, page_cache="on")),
                dict(label="B cold, K3 box tiers", prompt="B", stream=box),
                # issue 50: the slots written the way before DMA copies (through the host, their pages migrating)
                dict(label="B cold, page migration", prompt="B", stream=dict(stream, dma_copies=False)),
                dict(label="B cold, host tier, page migration", prompt="B",
                     stream=dict(stream, host_budget_bytes=int(cfg["host_gb"] * 1e9), dma_copies=False)),
                # issue 50: at the box's shares the disk's misses bound the tiers; two ways to miss less
                dict(label="B warm from A's profile, K3 box tiers", prompt="B", stream=box, warm=True,
                     pin_share=cfg["pin_share"]),
                dict(label=f"B cold, K3 box tiers, cache routing {margins[0]:g}", prompt="B",
                     stream=dict(box, cache_routing=margins[0])),
            ] + [  # cache-aware routing: a cached expert within the margin of an uncached one is chosen instead
                dict(label=f"B cold, cache routing {m:g}", prompt="B", stream=dict(stream, cache_routing=m))
                for m in margins]
        chosen = set(a.runs.split(","))
        keys = "ABW8LFX12RHPTNMUV" + "C" * (len(runs) - 17)
        runs = [r for r, key in zip(runs, keys) if key in chosen]
        drop_cache(files)
        res = run_child(SCRIPT, "decode", dict(path=model["path"], prompts=prompts, warmup=cfg["warmup"],
                                               tokens=cfg["tokens"], runs=runs, compile_warmup=True), a.timeout)
        for w in res["warmups"]:
            log(f"compile warm-up (top-k {w['top_k'] or 'native'}): {w['seconds']:.1f} s, of which the prompt "
                f"{w['prefill_s']:.1f} s, waiting on reads {w['stall_s']:.1f} s, tqbench's kernels compiled by NVRTC "
                f"{w['nvrtc']['compiled']} in {w['nvrtc']['compile_s']:.1f} s (untimed; the runs below follow it)")
        rows = []
        for r in res["runs"]:
            row = summarize(r)
            row["per_layer"] = r["per_layer"]
            row["same_tokens_as_resident"] = (r["tokens"] == doc["resident"]["tokens"]
                                              if "resident" in doc and r["prompt_tokens"] and r["top_k"] is None
                                              and r["label"].startswith("B") else None)
            if r["label"] == "B cold":
                row["trace_bounds"] = dict(trace_bounds(r["trace"], r["slots"]), streamer=r["hit_rate_all"])
            rows.append(row)
            pf = row["prefill"]
            log(f"{row['label']:<28} prefill {row['prefill_tps']:.2f} tok/s ({pf['tokens']} tokens in "
                f"{pf['seconds']:.2f} s: {pf['misses']} misses, {pf['bytes'] / 1e9:.2f} GB, "
                f"waiting {pf['stall_s']:.2f} s)")
            log(f"{row['label']:<28} decode {row['decode_tps']:.3f} tok/s, hit {row['hit_rate']:.1%}, "
                f"{row['bytes_per_token'] / 1e9:.2f} GB/token, stall {row['stall_share']:.0%}, "
                f"disk on misses {row['disk_gbps_on_misses'] or 0:.2f} GB/s"
                + (f"; tiers gpu {row['tiers']['gpu']:.1%} host {row['tiers']['host']:.1%} disk "
                   f"{row['tiers']['disk']:.1%}" if row.get("hits_host") else ""))
            m = row.get("per_miss_ms")
            if m:
                log(f"{'':<28} per miss ms: stall {m['stall']:.2f} = before reads {m['before_reads']:.2f} + reading "
                    f"{m['reading']:.2f} + after {m['after_reads']:.2f} + outside {m['outside_page_in']:.2f}; "
                    f"read {m['read']:.2f}, queued {m['queue']:.2f}, buffer wait {m['buffer_wait']:.2f}, copy "
                    f"{m['copy']:.2f}, to_gpu {m['to_gpu']:.2f}, to_host {m['to_host']:.2f} ({m['timed']} timed)")
        doc["stream"] = dict(rows=rows, warmups=res["warmups"], mlx_peak=res["mlx_peak"], device=res["device"])
        finish(doc)
        if "disk_on_misses_vs_raw_random" in doc:
            m = next(r for r in rows if r["label"] == "B cold").get("per_miss_ms") or {}
            log(f"disk on misses (B cold) vs raw: {doc['disk_on_misses_vs_raw']:.2f}x consecutive, "
                f"{doc['disk_on_misses_vs_raw_random']:.2f}x random experts; waited {m.get('stall', 0):.2f} ms per "
                f"miss, one expert at the random-read rate {m.get('raw_random_read', 0):.2f} ms")
        for row in doc.get("projection_k3_tiers", {}).get("rows", []):
            log(f"K3 top-{row['top_k']} on the lent box's two tiers (gpu {row['tiers']['gpu']:.1%}, host "
                f"{row['tiers']['host']:.1%}): {row['tps']:.3f} tok/s (disk ceiling {row['disk_ceiling_tps'] or 0:.3f})")
        for row in doc.get("projection_k3", []):
            log(f"K3 top-{row['top_k']} at hit rate {row['hit_rate']:.1%} ({row['hit_rate_from']}): "
                f"{row['tps']:.3f} tok/s (disk ceiling {row['disk_ceiling_tps'] or 0:.3f})")
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

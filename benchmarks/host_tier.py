#!/usr/bin/env python3
"""The host-RAM expert tier against the OS page cache (issue 33), on this machine: what serving a GPU-cache miss from
each costs, and what it does to decode.

    python benchmarks/host_tier.py --out results/bench-host-tier-cpu.json
    python benchmarks/host_tier.py --quick          # a smoke run (about a minute)

The model is `streaming.py`'s end-to-end one (K3's layout, random weights, experts of 2.74 MB: half K3's in each
direction; `--quick`: tiny), converted with tq3a-tqTe-down4-g64 and kept in the work directory. Five runs are loaded
side by side in one fresh process and decode greedily one token each in turn, the order rotating every token, so a
drift in the machine's speed hits every run alike (`streaming.py`'s decode child):

- `cache`: the expert cache alone at `--gpu-share` of the experts' bytes, page cache off (O_DIRECT): every miss is a
  disk read. The baseline.
- `cache + host`: the same cache and a host tier of `--host-share` of the experts' bytes, page cache off.
- `cache, page cache on`: the cache alone, reads through the page cache (which grows to hold whatever was read).
- `cache + host, page cache on`.
- `cache + host (all)`: a host tier that holds every expert, page cache off (misses only for first reads).

Reported per run: decode tok/s and its ratio to `cache` in the same process, routed experts per tier (GPU cache, host
tier, read), bytes read per token, stall per token and per expert not in the cache (what a host copy, a page-cache
read or a disk read costs while decode waits), and the page cache's share of the model's files after the run
(`mincore`). On unified memory (this CPU, Apple silicon) the cache's slots and the host tier are the same RAM: the
figure that carries over to CUDA is the cost of a host copy against a read, not the tier's capacity.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import add_size_options, drop_cache, machine_info, peak_rss_bytes, resident_fraction, run_child, sizes
from harness import with_openblas

with_openblas()

import json  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

import streaming  # noqa: E402

SCHEMA = "tqbench.bench.host_tier/1"
DEFAULTS = dict(gpu_share=0.15, host_share=0.6, tokens=48, warmup=8, prompt=8, workers=4, repeats=2)
QUICK = dict(gpu_share=0.25, host_share=0.5, tokens=6, warmup=2, prompt=4, workers=2, repeats=1)


def runs(model: dict, cfg: dict) -> list[tuple[str, dict]]:
    from tqbench.stream.store import ALIGN
    from tqbench.stream.pagein import staging_bytes

    eb, total, w = model["expert_bytes"], model["expert_total_bytes"], cfg["workers"]
    gpu = max(int(cfg["gpu_share"] * total // eb), 1) * eb + staging_bytes(eb + 2 * ALIGN, w)
    host = max(int(cfg["host_share"] * total // eb), 1) * eb
    base = dict(budget_bytes=gpu, workers=w, page_cache="off")
    return [("cache", base), ("cache + host", dict(base, host_budget_bytes=host)),
            ("cache, page cache on", dict(base, page_cache="on")),
            ("cache + host, page cache on", dict(base, page_cache="on", host_budget_bytes=host)),
            ("cache + host (all)", dict(base, host_budget_bytes=total + eb))]


def summarize(r: dict, model: dict) -> dict:
    d, n = r["delta"], len(r["token_s"])
    routed = d["hits"] + d["misses"]
    gpu = d["hits"] - d["hits_host"]
    outside = d["hits_host"] + d["misses"]  # experts not in the cache when needed
    return dict(label=r["label"], decode_tps=r["decode_tps"], token_ms_median=statistics.median(r["token_s"]) * 1e3,
                tiers=dict(gpu=gpu / routed, host=d["hits_host"] / routed, disk=d["misses"] / routed),
                bytes_read_per_token=d["critical_bytes"] / n, stall_ms_per_token=d["stall_s"] / n * 1e3,
                stall_ms_per_expert_outside_cache=d["stall_s"] / outside * 1e3 if outside else None,
                host_copy_ms_per_copy=d["host_copy_s"] / d["hits_host"] * 1e3 if d["hits_host"] else None,
                page_cache="page cache on" in r["label"], tokens=r["tokens"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--work", type=Path, help="keep the model here (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench-results/host_tier.json"))
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)
    work = a.work or Path(tempfile.mkdtemp(prefix="tqbench-host-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    model = streaming.build_e2e_model(work, streaming.E2E_SPEC_QUICK if a.quick else streaming.E2E_SPEC)
    files = [Path(f) for f in model["files"]]
    print(f"model: {model['moe_layers']} MoE layers x {model['experts_per_layer']} experts x "
          f"{model['expert_bytes'] / 1e6:.2f} MB = {model['expert_total_bytes'] / 1e6:.0f} MB of experts", flush=True)
    prompt = np.random.default_rng(1).integers(0, 256, cfg["prompt"]).tolist()
    order = runs(model, cfg)
    repeats = []
    for rep in range(cfg["repeats"]):
        drop_cache(files)
        x = run_child(streaming.SCRIPT, "decode", dict(path=model["path"], runs=order if rep % 2 == 0 else order[::-1],
                                                       prompt=prompt, warmup=cfg["warmup"], tokens=cfg["tokens"]),
                      a.timeout)
        rows = {r["label"]: summarize(r, model) for r in x["runs"]}
        base = rows["cache"]["decode_tps"]
        for row in rows.values():
            row["vs_cache"] = row["decode_tps"] / base
        repeats.append(dict(rows=[rows[label] for label, _ in order], page_cache_after=resident_fraction(files),
                            peak_rss=x["peak_rss"], child_wall_s=x["process_wall_s"]))
    same = all(r["tokens"] == repeats[0]["rows"][0]["tokens"] for rep in repeats for r in rep["rows"])
    summary = []
    for i, (label, stream) in enumerate(order):
        rows = [rep["rows"][i] for rep in repeats]
        summary.append(dict(label=label, stream=stream, vs_cache=[r["vs_cache"] for r in rows],
                            vs_cache_median=statistics.median(r["vs_cache"] for r in rows),
                            decode_tps_median=statistics.median(r["decode_tps"] for r in rows),
                            tiers=rows[-1]["tiers"], bytes_read_per_token=rows[-1]["bytes_read_per_token"],
                            stall_ms_per_token=statistics.median(r["stall_ms_per_token"] for r in rows),
                            stall_ms_per_expert_outside_cache=statistics.median(
                                r["stall_ms_per_expert_outside_cache"] or 0 for r in rows),
                            host_copy_ms_per_copy=rows[-1]["host_copy_ms_per_copy"]))
    doc = dict(schema=SCHEMA, machine=machine_info(work), config=cfg, quick=a.quick,
               model={k: v for k, v in model.items() if k != "files"}, runs=summary, repeats=repeats,
               same_tokens_in_every_run=same, peak_rss=peak_rss_bytes())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'run':<30} {'tok/s':>7} {'vs cache':>9} {'gpu':>5} {'host':>5} {'disk':>5} {'MB/token':>9} "
          f"{'stall ms/token':>15} {'ms/outside':>11}")
    for s in summary:
        t = s["tiers"]
        print(f"{s['label']:<30} {s['decode_tps_median']:>7.2f} {s['vs_cache_median']:>9.2f} {t['gpu']:>5.0%} "
              f"{t['host']:>5.0%} {t['disk']:>5.0%} {s['bytes_read_per_token'] / 1e6:>9.2f} "
              f"{s['stall_ms_per_token']:>15.2f} {s['stall_ms_per_expert_outside_cache']:>11.2f}")
    print(f"same greedy tokens in every run: {same}; wrote {a.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

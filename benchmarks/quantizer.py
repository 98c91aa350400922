#!/usr/bin/env python3
"""TurboQuant's quantizer kernels on K3's expert matrices, on whatever device MLX uses (issue 14).

    PYTHONPATH=. python3 benchmarks/quantizer.py --out bench-results/quantizer.json     # on the GPU machine
    python benchmarks/quantizer.py --quick                                              # a CPU smoke run (seconds)

`tqbench.quant.turboquant.quantize` with each quantizer kernel the device runs (`passes`: MLX's prebuilt kernels, five
passes per boundary, CUDA's default until 2026-12-02; `compare`: one broadcast comparison, a sum and a lookup;
`compiled`: one mx.compile'd kernel, the CPU's and Metal's default; `cuda`: the hand-written CUDA kernel, CUDA's
default; `--kernels` picks some, `passes` always among them) on the converter's work for one K3 expert at the
`tq3a-tqTe-down4-g64` recipe: gate and up (3072 x 3584, ternary, group 64) and down (3584 x 3072, 4-bit), rotated,
from float32 weights already in device memory. Each call is what the converter does per matrix: build the graph,
evaluate codes, scales and the error, read the error. Per kernel: the first call apart (kernel compilation), then
the median of `--repeats` calls of the three matrices, GB/s of float32 weights, and its time relative to `passes`
measured in the same run (kernels alternate per repeat); MLX's peak memory for one matrix; the codes and scales of
every kernel compared with `passes` (they must be equal). With `--batch B` (default 8) also the same work for B
experts at once (each projection's B matrices stacked into one call), per expert, against one expert per call: what
batching experts per MLX call would buy the converter. `--rules rms,search` times each kernel under each scale rule
(turboquant.SCALE_RULES; the outputs compared with `passes` under the same rule) and reports search / rms per kernel,
both measured in the same run. Peak RSS of the process at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from harness import peak_rss_bytes, with_openblas

SCHEMA = "tqbench.bench.quantizer/1"
# (name, out, in, codebook): one K3 expert at tq3a-tqTe-down4-g64
K3_EXPERT = [("gate", 3072, 3584, "T"), ("up", 3072, 3584, "T"), ("down", 3584, 3072, "4")]
QUICK_EXPERT = [("gate", 64, 256, "T"), ("up", 64, 256, "T"), ("down", 256, 64, "4")]
GROUP = 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="experts per call in the batched timing (1: none)")
    p.add_argument("--kernels", help="comma-separated kernels to time (default: every one this device runs; passes "
                   "is always timed, as the reference)")
    p.add_argument("--rules", default="rms", help="comma-separated scale rules to time (rms, search)")
    p.add_argument("--quick", action="store_true", help="small matrices, 2 repeats")
    p.add_argument("--out", type=Path, default=Path("bench-results/quantizer.json"))
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    with_openblas()
    from tqbench.quant import turboquant as tq

    mats = QUICK_EXPERT if a.quick else K3_EXPERT
    repeats = 2 if a.quick else a.repeats
    batch = 2 if a.quick else a.batch
    rng = np.random.default_rng(0)
    weights = []
    for name, out, inp, kind in mats:
        w = mx.array(rng.standard_normal((out, inp)).astype(np.float32) * inp ** -0.5)
        signs = mx.array(tq.rotation_signs(f"bench.{name}", inp, 0)) if tq.rotation_block(inp) else None
        mx.eval(w)
        weights.append((name, w, kind, signs))
    nbytes = sum(w.nbytes for _, w, _, _ in weights)
    kernels = list(tq.available_quantizer_kernels())
    if a.kernels:
        unknown = set(a.kernels.split(",")) - set(kernels)
        if unknown:
            p.error(f"--kernels: {', '.join(sorted(unknown))} not among {', '.join(kernels)}")
        kernels = [k for k in kernels if k in a.kernels.split(",") or k == "passes"]

    rules = a.rules.split(",")
    unknown = set(rules) - set(tq.SCALE_RULES)
    if unknown:
        p.error(f"--rules: {', '.join(sorted(unknown))} not among {', '.join(tq.SCALE_RULES)}")
    rows = []
    for rule in rules:
        rows += measure(tq, weights, kernels, rule, repeats, batch, nbytes)
    for r in rows:
        if len(rules) > 1:
            rms = next(x for x in rows if x["kernel"] == r["kernel"] and x["rule"] == "rms")
            r["vs_rms"] = r["median_s"] / rms["median_s"]
    doc = dict(schema=SCHEMA, date=time.strftime("%Y-%m-%d"), device=str(mx.default_device()), mlx=mx.__version__,
               platform=platform.platform(), default_kernel=tq.quantizer_kernel(), quick=a.quick,
               rules=rules, matrices=[dict(name=n, shape=list(w.shape), codebook=kind, rotated=s is not None)
                         for n, w, kind, s in weights], float32_bytes=nbytes, repeats=repeats, batch=batch, rows=rows,
               peak_rss=peak_rss_bytes())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


def measure(tq, weights, kernels: list[str], rule: str, repeats: int, batch: int, nbytes: int) -> list[dict]:
    """One scale rule: every kernel timed against `passes` under the same rule, outputs compared with its."""
    def one_expert(kernel: str) -> list:
        return [tq.quantize(w, kind, GROUP, signs, kernel=kernel, rule=rule) for _, w, kind, signs in weights]

    first, reference, same, peak = {}, one_expert("passes"), {}, {}
    for k in kernels:
        t = time.perf_counter()
        got = one_expert(k)
        first[k] = time.perf_counter() - t
        same[k] = all(np.array_equal(np.array(g.weight), np.array(r.weight))
                      and np.array_equal(np.array(g.scales), np.array(r.scales)) for g, r in zip(got, reference))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        name, w, kind, signs = weights[-1]
        tq.quantize(w, kind, GROUP, signs, kernel=k, rule=rule)
        peak[k] = mx.get_peak_memory() - base
    stacked = [(name, mx.stack([w] * batch), kind, signs) for name, w, kind, signs in weights] if batch > 1 else []
    mx.eval(*[w for _, w, _, _ in stacked])

    def batched(kernel: str) -> list:  # `batch` experts' work in one call per projection
        return [tq.quantize(w, kind, GROUP, signs, kernel=kernel, rule=rule) for _, w, kind, signs in stacked]

    same_batched = {}
    for k in kernels if stacked else []:  # warm-up at the stacked shapes, and each stacked copy's output checked
        same_batched[k] = all(np.array_equal(np.array(g.weight[i]), np.array(r.weight))
                              and np.array_equal(np.array(g.scales[i]), np.array(r.scales))
                              for g, r in zip(batched(k), reference) for i in range(batch))
    times: dict[str, list[float]] = {k: [] for k in kernels}
    per_expert_batched: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(repeats):
        for k in (kernels if r % 2 == 0 else kernels[::-1]):
            t = time.perf_counter()
            one_expert(k)
            times[k].append(time.perf_counter() - t)
            if stacked:
                t = time.perf_counter()
                batched(k)
                per_expert_batched[k].append((time.perf_counter() - t) / batch)
    rows = []
    for k in kernels:
        med = statistics.median(times[k])
        rows.append(dict(kernel=k, rule=rule, first_s=first[k], median_s=med, gb_per_s=nbytes / med / 1e9,
                         vs_passes=med / statistics.median(times["passes"]),
                         paired_vs_passes=[x / y for x, y in zip(times[k], times["passes"])],
                         peak_memory_one_matrix=peak[k], same_codes_and_scales_as_passes=same[k], times_s=times[k]))
        if stacked:
            b = statistics.median(per_expert_batched[k])
            rows[-1].update(batched_median_s_per_expert=b, batched_vs_one=b / med,
                            batched_times_s_per_expert=per_expert_batched[k], batched_same_output=same_batched[k])
        print(f"{k:<9} {rule:<6} first {first[k]:7.3f} s   median {med * 1e3:8.2f} ms per expert ({nbytes / med / 1e9:6.2f} GB/s "
              f"of float32)   x{rows[-1]['vs_passes']:.2f} of passes   peak {peak[k] / 2**20:7.1f} MiB   "
              f"same output: {same[k]}" + (f"   {batch} per call: {rows[-1]['batched_median_s_per_expert'] * 1e3:.2f} "
                                           f"ms per expert (x{rows[-1]['batched_vs_one']:.2f})" if stacked else ""),
              flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""Fused TurboQuant codebook kernels against MLX's affine quantized kernels, on a GPU (CUDA or Metal).

    PYTHONPATH=. python3 benchmarks/kernels.py --out bench-kernels.json [--check] [--variants] [--quick]

- `--check`: every kernel variant against a float64 reference on random packed weights: levels 3/4/8/16, groups
  32/64/128, 1..4 rows of x, and gathered experts; max relative error per configuration (the self-check's 1e-4
  is the bar); also runs the dispatch (tqbench.runtime.kernels.matmul) once per level to show its self-check passes.
- timing: K3's shapes (out x in) 7168x4096, 4096x7168, 3072x3584, 3584x3072 at batch 1, TurboQuant (group 64)
  against `mx.quantized_matmul` (affine, group 64, bf16 x) at the same bits (4-bit, 3-bit; ternary against
  2-bit), and 16 of 64 experts of 3072x7168 (x shared, as gate/up) and 7168x3072 (x per expert, as down) against
  `mx.gather_qmm`. Each measurement evaluates a chain of products over enough weight copies that they come from
  HBM, not L2 (the graph is built before the clock starts, so Python's cost is not timed), repeated; the median
  per product is reported, and each ratio is against the affine time measured in the same run.
- `--variants`: also times other kernel layouts (rows per lane, lanes per row tile, warps per threadgroup).
- first use: `tq_first_s` (each timed product's first build and launch; Metal compiles the kernel's source then) and
  the dispatch check's `first_s` (the same, plus the self-check of the first product of its configuration).

Runs unchanged on a Mac (Metal: the kernels built by `mx.fast.metal_kernel`, Metal's layouts) and on CUDA.
- `--launch-cost`: what one launch costs on tiny products, NVRTC's cubin (with it, and with an empty source once the
  module is loaded) against MLX's build of the same kernel (`launch_cost`); CUDA only. With `--skip-timing`:
  `python3 benchmarks/kernels.py --launch-cost --skip-timing --out bench-launch-cost.json`.

Needs only numpy and mlx (plus this repository on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from tqbench.cubin import cached_cubin
from tqbench.quant.turboquant import codebook as published_codebook
from tqbench.runtime import codebook as ref
from tqbench.runtime import kernels as K

SHAPES = [(7168, 4096), (4096, 7168), (3072, 3584), (3584, 3072)]  # (out, in)
EXPERT_SHAPES = [(3072, 7168), (7168, 3072)]  # gate/up (x shared by the 16 experts), down (x per expert)
FORMATS = [("4-bit", 16, 4), ("3-bit", 8, 3), ("ternary", 3, 2)]  # (name, levels, affine bits compared)
GROUP = 64
L2_BYTES = 60e6


def tq_bytes(levels: int, out: int, n: int, g: int = GROUP) -> int:
    return out * (4 * -(-n // K.format_of(levels)[1]) + 2 * n // g)


def affine_bytes(bits: int, out: int, n: int, g: int = GROUP) -> int:
    return out * n * bits // 8 + 4 * out * n // g


def random_words(levels: int, shape: tuple, key) -> mx.array:
    """Valid packed words of random codes (padding codes not zeroed: the kernels never read them)."""
    k1, k2 = mx.random.split(key)
    w = (mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=k1) << 16) | \
        mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=k2)
    if levels == 3:
        return w % 3486784401  # < 3^20
    if levels == 8:
        return w & 0x3FFFFFFF  # 10 codes, top 2 bits unused
    return w


def tq_weights(levels: int, out: int, n: int, lead: tuple, key: int, g: int = GROUP):
    k1, k2 = mx.random.split(mx.random.key(key))
    w = random_words(levels, (*lead, out, -(-n // K.format_of(levels)[1])), k1)
    s = mx.random.uniform(0.01, 0.05, (*lead, out, n // g), key=k2).astype(mx.float16)
    kind = {3: "T", 4: "2", 8: "3", 16: "4"}[levels]
    cb = mx.array(published_codebook(kind))
    mx.eval(w, s, cb)
    return w, s, cb


def affine_weights(bits: int, out: int, n: int, lead: tuple, key: int, g: int = GROUP):
    wf = (mx.random.normal((*lead, out, n), key=mx.random.key(key)) * 0.02).astype(mx.bfloat16)
    q = mx.quantize(wf, group_size=g, bits=bits)
    mx.eval(q)
    del wf
    return q


def time_chain(make, copies: int, chain: int, repeats: int) -> tuple[float, float]:
    """Median and min seconds per product: `make(i)` builds product i (lazily) on weight copy i % copies."""
    for _ in range(2):  # warm-up (compiles, allocations)
        mx.eval([make(i % copies) for i in range(min(chain, 2 * copies))])
    times = []
    for _ in range(repeats):
        outs = [make(i % copies) for i in range(chain)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / chain)
        del outs
    return statistics.median(times), min(times)


def n_copies(nbytes: int) -> int:
    return max(2, math.ceil(4 * L2_BYTES / nbytes))


def first_launch(make) -> float:
    """Seconds from nothing built to the first product's result: the kernel's build (Metal compiles its source here;
    CUDA loads or compiles the cubin) and one launch."""
    t0 = time.perf_counter()
    mx.eval(make(0))
    return time.perf_counter() - t0


def bench_matvec(args, results: list, variants: bool) -> None:
    backend = K.default_backend()
    x32 = {n: mx.random.normal((1, n), key=mx.random.key(n)) for _, n in SHAPES}
    for (out, n) in SHAPES:
        xb = x32[n].astype(mx.bfloat16)
        for name, levels, bits in FORMATS:
            copies = n_copies(tq_bytes(levels, out, n))
            tq = [tq_weights(levels, out, n, (), key=100 + i) for i in range(copies)]
            layouts = [{}]
            if variants:
                if K.unit_codes(levels) == 32:
                    layouts += [dict(rows=4, lanes=32, tiles=4), dict(rows=8, lanes=32, tiles=4),
                                dict(rows=8, lanes=16, tiles=4), dict(rows=4, lanes=16, tiles=8)]
                else:
                    layouts += [dict(lanes=8, tiles=1), dict(lanes=4, tiles=1), dict(rows=8, lanes=8, tiles=1),
                                dict(lanes=16, tiles=1), dict(lanes=8, tiles=1, prefetch=True),
                                dict(lanes=4, tiles=1, prefetch=not (levels == 3))]
            seen, best, first_s = set(), None, None
            for lay in layouts:
                key = K.make_spec(levels, GROUP, n, out, 1, 1, False, backend=backend, **lay)
                if key in seen:
                    continue
                seen.add(key)
                f = lambda i, lay=lay: K.fused_matmul(x32[n], *tq[i], backend, **lay)
                if first_s is None:
                    first_s = first_launch(f)  # the default layout's
                med, mn = time_chain(f, copies, args.chain, args.repeats)
                spec = K.make_spec(levels, GROUP, n, out, 1, 1, False, backend=backend, **lay)
                rec = dict(layout=dict(rows=spec.rows, lanes=spec.lanes, tiles=spec.tiles, xpre=spec.xpre,
                                       prefetch=spec.prefetch), median_s=med, min_s=mn)
                if best is None or med < best["median_s"]:
                    best = rec
                if variants:
                    results.append(dict(kind="variant", format=name, out=out, n=n, **rec))
            tq = None  # free the copies before the affine ones
            copies_a = n_copies(affine_bytes(bits, out, n))
            aff = [affine_weights(bits, out, n, (), key=200 + i) for i in range(copies_a)]
            fa = lambda i: mx.quantized_matmul(xb, *aff[i], transpose=True, group_size=GROUP, bits=bits)
            amed, amin = time_chain(fa, copies_a, args.chain, args.repeats)
            fa32 = lambda i: mx.quantized_matmul(x32[n], *aff[i], transpose=True, group_size=GROUP, bits=bits)
            a32med, _ = time_chain(fa32, copies_a, args.chain, args.repeats)
            aff = None
            row = dict(kind="matvec", format=name, levels=levels, affine_bits=bits, out=out, n=n, group=GROUP,
                       tq_s=best["median_s"], tq_min_s=best["min_s"], tq_layout=best["layout"], tq_first_s=first_s,
                       affine_bf16_s=amed, affine_bf16_min_s=amin, affine_f32x_s=a32med,
                       ratio=best["median_s"] / amed,
                       tq_gbps=tq_bytes(levels, out, n) / best["median_s"] / 1e9,
                       affine_gbps=affine_bytes(bits, out, n) / amed / 1e9)
            results.append(row)
            print(f"matvec {out}x{n} {name:8s} tq {row['tq_s'] * 1e6:7.2f} us ({row['tq_gbps']:5.0f} GB/s) "
                  f"affine{bits} {amed * 1e6:7.2f} us ({row['affine_gbps']:5.0f} GB/s) ratio {row['ratio']:.2f} "
                  f"layout {best['layout']}", flush=True)


def bench_gather(args, results: list, experts: int = 64, top: int = 16) -> None:
    backend = K.default_backend()
    rng = np.random.default_rng(0)
    idxs = [mx.array(rng.choice(experts, top, replace=False).reshape(1, 1, top).astype(np.uint32))
            for _ in range(64)]
    for (out, n) in EXPERT_SHAPES:
        shared = out < n  # gate/up: x (1, 1, 1, 1, n) shared by the experts; down: x (1, 1, 16, 1, n)
        xshape = (1, 1, 1, 1, n) if shared else (1, 1, top, 1, n)
        x32 = mx.random.normal(xshape, key=mx.random.key(5))
        xb = x32.astype(mx.bfloat16)
        for name, levels, bits in FORMATS:
            w, s, cb = tq_weights(levels, out, n, (experts,), key=300)
            f = lambda i: K.fused_gather(x32, w, s, cb, idxs[i % len(idxs)], backend)
            first_s = first_launch(f)
            med, mn = time_chain(f, len(idxs), args.chain, args.repeats)
            w = s = None
            aw = affine_weights(bits, out, n, (experts,), key=400)
            fa = lambda i: mx.gather_qmm(xb, *aw, rhs_indices=idxs[i % len(idxs)], transpose=True,
                                         group_size=GROUP, bits=bits)
            amed, amin = time_chain(fa, len(idxs), args.chain, args.repeats)
            aw = None
            row = dict(kind="gather", format=name, levels=levels, affine_bits=bits, out=out, n=n, group=GROUP,
                       experts=experts, top=top, x_shared=shared, tq_s=med, tq_min_s=mn, tq_first_s=first_s,
                       affine_bf16_s=amed,
                       affine_bf16_min_s=amin, ratio=med / amed,
                       tq_gbps=top * tq_bytes(levels, out, n) / med / 1e9,
                       affine_gbps=top * affine_bytes(bits, out, n) / amed / 1e9)
            results.append(row)
            print(f"gather {top}/{experts} {out}x{n} {name:8s} tq {med * 1e6:7.2f} us ({row['tq_gbps']:5.0f} GB/s) "
                  f"affine{bits} {amed * 1e6:7.2f} us ({row['affine_gbps']:5.0f} GB/s) ratio {row['ratio']:.2f}",
                  flush=True)


def reference64(x: mx.array, w: mx.array, s: mx.array, cb: mx.array) -> np.ndarray:
    with mx.stream(mx.cpu):
        wd = np.array(ref.dequantize_rotated(w, s, cb, x.shape[-1]), np.float64)
    return np.array(x, np.float64) @ np.swapaxes(wd, -1, -2)


def check(results: list, quick: bool = False) -> float:
    """Every variant against a float64 reference; returns the largest relative error."""
    backend = K.default_backend()
    worst = 0.0
    n, out = 896, 136  # 3-bit rows of 90 words, ternary 45: misaligned rows; a partial 160-code unit
    for levels in K.LEVELS:
        for g in ((64,) if quick else K.GROUPS):
            w, s, cb = K.random_case(levels, g, n, out, 6, key=levels * 10 + g)
            for rows in ((1, 3) if quick else (1, 2, 3, 4)):
                x = mx.random.normal((rows, n), key=mx.random.key(rows + g))
                got = np.array(K.fused_matmul(x, w[1], s[1], cb, backend), np.float64)
                want = reference64(x, w[1], s[1], cb)
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                worst = max(worst, err)
                results.append(dict(kind="check", op="matvec", levels=levels, group=g, rows=rows, n=n, out=out,
                                    rel_error=err))
            x = mx.random.normal((2, 1, 1, n), key=mx.random.key(g))
            idx = mx.array([[5, 0, 3], [1, 1, 4]], dtype=mx.uint32)
            got = np.array(K.fused_gather(x, w, s, cb, idx, backend), np.float64)
            wd = [reference64(x[a, 0], w[int(e)], s[int(e)], cb) for a in range(2) for e in np.array(idx[a])]
            want = np.stack(wd).reshape(got.shape)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            worst = max(worst, err)
            results.append(dict(kind="check", op="gather", levels=levels, group=g, rows=1, n=n, out=out,
                                rel_error=err))
            print(f"check levels={levels:2d} g={g:3d}: max rel error "
                  f"{max(r['rel_error'] for r in results if r.get('levels') == levels and r.get('group') == g):.2e}",
                  flush=True)
    # K3 shapes through the dispatch (self-check, then the fused kernel), published codebooks, 1 row
    for (out, n) in SHAPES:
        for name, levels, _ in FORMATS:
            w, s, cb = tq_weights(levels, out, n, (), key=7)
            x = mx.random.normal((1, n), key=mx.random.key(3))
            t0 = time.perf_counter()
            got = np.array(K.matmul(x, w, s, cb), np.float64)  # builds the kernel (and self-checks a configuration)
            first_s = time.perf_counter() - t0
            want = reference64(x, w, s, cb)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            worst = max(worst, err)
            results.append(dict(kind="check", op="dispatch", levels=levels, group=GROUP, rows=1, n=n, out=out,
                                rel_error=err, first_s=first_s))
    checked = {str(k): v for k, v in K.dispatcher.checked.items()}
    results.append(dict(kind="self_check", results=checked, warnings=list(K.dispatcher.warnings)))
    print(f"dispatch self-checks: {checked}; warnings: {K.dispatcher.warnings}", flush=True)
    # the reference path on the GPU (float32 matmul, TF32 unless MLX_ENABLE_TF32=0) for comparison
    w, s, cb = tq_weights(16, 4096, 7168, (), key=8)
    x = mx.random.normal((1, 7168), key=mx.random.key(4))
    got = np.array(ref.matmul(x, w, s, cb), np.float64)
    want = reference64(x, w, s, cb)
    results.append(dict(kind="check", op="reference_on_gpu", levels=16, group=GROUP, rows=1, n=7168, out=4096,
                        rel_error=float(np.linalg.norm(got - want) / np.linalg.norm(want))))
    print(f"the reference path on the GPU: rel error {results[-1]['rel_error']:.2e}")
    return worst


LAUNCH_SHAPES = [(64, 256), (512, 512), (7168, 4096)]  # (out, in): tiny products where a launch is most of the time


def launch_cost(results: list, chain: int, repeats: int) -> None:
    """Why a plain matvec through NVRTC's cubin measured 1.3-3.4x MLX's build of the same kernel: the cost of one
    launch, on products small enough that the launch is most of it (and K3's 7168x4096). For each shape and format, a
    chain of `chain` launches of one kernel on one weight, graph-building and evaluation timed apart (median per
    launch over `repeats`), through:
    - `nvrtc`: `mx.fast.precompiled_cuda_kernel` carrying the cubin with every launch, as tqbench launches;
    - `nvrtc_empty_source`: the same launches with an empty source once MLX holds the module (it keeps a loaded module
      by name and reads the source only to load it): the cubin's share of a launch;
    - `mlx`: MLX's own build of the same kernel (`mx.fast.cuda_kernel`).
    The three outputs are compared once. CUDA only (main refuses other devices)."""
    for out, n in LAUNCH_SHAPES:
        x = mx.random.normal((1, n), key=mx.random.key(3))
        for name, levels, _ in FORMATS:
            w, s, cb = tq_weights(levels, out, n, (), key=500)
            spec = K.make_spec(levels, GROUP, n, out, 1, 1, False, K.dtype_name(s.dtype), K.dtype_name(cb.dtype))
            grid, tg = spec.grid(1)
            kname, cubin = cached_cubin(K.kernel_name(spec, "cuda"), lambda nm: K.cuda_program(spec, nm))

            def empty_source(**kw):
                return mx.fast.precompiled_cuda_kernel(name=kname, compiled_source=b"", scalars=[],
                                                       ensure_row_contiguous=True, **kw)

            builds = {"nvrtc": K._compiled(spec, "cuda", "nvrtc"), "nvrtc_empty_source": empty_source,
                      "mlx": K._compiled(spec, "cuda", "mlx")}
            row = dict(kind="launch_cost", format=name, out=out, n=n, cubin_bytes=len(cubin))

            def launch(build):
                return build(inputs=[x, w, s, cb], grid=grid, threadgroup=tg, output_shapes=[(1, 1, out)],
                             output_dtypes=[mx.float32])[0]

            first = np.array(launch(builds["nvrtc"]), np.float64)  # MLX now holds the module: an empty source works
            for label, build in builds.items():
                try:
                    got = np.array(launch(build), np.float64)
                    row[f"{label}_vs_nvrtc"] = float(np.linalg.norm(got - first) / max(np.linalg.norm(first), 1e-30))
                    build_s, eval_s = [], []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        ys = [launch(build) for _ in range(chain)]
                        t1 = time.perf_counter()
                        mx.eval(ys)
                        t2 = time.perf_counter()
                        del ys
                        build_s.append((t1 - t0) / chain)
                        eval_s.append((t2 - t1) / chain)
                except Exception as e:  # noqa: BLE001 - an MLX that refuses one way: say so, keep the others
                    row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                row[f"{label}_build_s"] = statistics.median(build_s)
                row[f"{label}_eval_s"] = statistics.median(eval_s)
            if "nvrtc_eval_s" in row and "mlx_eval_s" in row:
                row["nvrtc_over_mlx"] = (row["nvrtc_build_s"] + row["nvrtc_eval_s"]) / \
                    (row["mlx_build_s"] + row["mlx_eval_s"])
            results.append(row)
            us = {k: round(v * 1e6, 2) for k, v in row.items() if k.endswith(("_build_s", "_eval_s"))}
            print(f"launch cost {out}x{n} {name} (cubin {len(cubin):,} B): us per launch {json.dumps(us)}; "
                  f"nvrtc / mlx {row.get('nvrtc_over_mlx', float('nan')):.2f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--check", action="store_true", help="correctness of every kernel variant first")
    ap.add_argument("--check-quick", action="store_true", help="correctness of group 64, 1 and 3 rows only")
    ap.add_argument("--variants", action="store_true", help="also time other kernel layouts")
    ap.add_argument("--quick", action="store_true", help="short chains and few repeats")
    ap.add_argument("--chain", type=int, default=200, help="products per timed evaluation")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--launch-cost", action="store_true",
                    help="time one kernel's launches on tiny products: NVRTC's cubin (with it, and with an empty "
                         "source once loaded) against MLX's build of the same kernel")
    ap.add_argument("--cuda-build", choices=["nvrtc", "mlx"], default="nvrtc",
                    help="CUDA kernels compiled once per machine by NVRTC (the default) or by mx.fast.cuda_kernel")
    args = ap.parse_args()
    K.CUDA_BUILD = args.cuda_build
    if args.quick:
        args.chain, args.repeats = 50, 5
    if args.launch_cost and K.default_backend() != "cuda":
        print(f"--launch-cost times CUDA kernel launches (NVRTC's cubin against MLX's build); the default device here "
              f"is {mx.default_device()} without CUDA", file=sys.stderr)
        return 2
    if K.default_backend() is None:
        print("no GPU backend with fused kernels (CUDA or Metal) on the default device", file=sys.stderr)
        return 2
    info = dict(mlx=mx.__version__, backend=K.default_backend(), python=platform.python_version(),
                device=str(mx.default_device()), chain=args.chain, repeats=args.repeats, group=GROUP,
                cuda_build=args.cuda_build)
    try:
        info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # noqa: BLE001
        pass
    results: list = []
    worst = None
    if args.check or args.check_quick:
        t = time.time()
        worst = check(results, quick=not args.check)
        print(f"correctness: worst relative error {worst:.2e} ({time.time() - t:.0f} s)", flush=True)
    if args.launch_cost:
        launch_cost(results, args.chain, args.repeats)
    if not args.skip_timing:
        t = time.time()
        bench_matvec(args, results, args.variants)
        bench_gather(args, results)
        print(f"timing: {time.time() - t:.0f} s")
        print()
        print("| op | shape (out x in) | format | TurboQuant us | affine us (same bits) | ratio | TQ GB/s | affine GB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            if r["kind"] in ("matvec", "gather"):
                op = "matvec" if r["kind"] == "matvec" else f"gather {r['top']}/{r['experts']}"
                print(f"| {op} | {r['out']}x{r['n']} | {r['format']} g{r['group']} vs affine {r['affine_bits']}-bit "
                      f"| {r['tq_s'] * 1e6:.2f} | {r['affine_bf16_s'] * 1e6:.2f} | {r['ratio']:.2f} "
                      f"| {r['tq_gbps']:.0f} | {r['affine_gbps']:.0f} |")
    from tqbench.cubin import STATS
    info.update(nvrtc=dict(compiled=STATS.compiled, compile_s=STATS.compile_s, loaded=STATS.loaded),
                nvrtc_error=K.NVRTC_ERROR, kernels_built=K._compiled.cache_info().currsize,
                first_use_warnings=[w for w in K.dispatcher.warnings if "on first use" in w])
    print(f"kernels built: {K._compiled.cache_info().currsize}; NVRTC compiled {STATS.compiled} in "
          f"{STATS.compile_s:.1f} s, loaded {STATS.loaded}" + (f"; NVRTC error: {K.NVRTC_ERROR}" if K.NVRTC_ERROR else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=info, worst_rel_error=worst, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Two checks for a GPU sitting (issue 50), written to files the sitting brings back:

    python3 scripts/gpu_cuda_checks.py logits --out logits-cuda.npz   # then the same here on the CPU, and compare
    python3 scripts/gpu_cuda_checks.py noise                            # the CPU's own logits under bf16-sized noise
    python3 scripts/gpu_cuda_checks.py launch                           # launch cost against the cubin's bytes
    python3 scripts/gpu_cuda_checks.py launch-detail --out launch.json  # where a launch's time goes, and two cures

`logits`: tests/test_host_tier.py's prompt on the demo's tq3a-tqTe-down4-g32 conversion, resident and streamed
(12 slots, no host tier): the prompt's logits and 10 greedy tokens each, saved as .npz
(results/gpu-cuda-checks-h100.json compares them with the CPU's). `noise`: the CPU's own logits of that prompt with
every layer's output scaled by (1 + eps x noise). `launch`: the ELF sections of every cubin in tqbench's cache, and the
launch cost of one 512x512 matvec with its cubin padded by trailing zeros (a cost that grows with the bytes handed to
MLX, not the code). `launch-detail`: for a K3 expert gather (ternary, 3-bit) and a small 4-bit matvec, the time a
launch takes to build (no evaluation) and to build and run, with the cubin as it is and padded by 1 MB, against MLX's
own build of the same source; the ternary kernel again with its symmetric/general codebook branch taken at run time
(one copy of the code instead of two: size, launch and kernel time); then all of it again in a child process whose
glibc malloc keeps large blocks on its heap (MALLOC_MMAP_THRESHOLD_), to tell copying from page faults.
Run from the repository root with tests/ and benchmarks/ importable (PYTHONPATH=.)."""

import argparse
import glob
import os
import statistics
import struct
import sys
import time

import numpy as np

sys.path[:0] = ["tests", "benchmarks"]


def logits_check(out: str) -> None:
    from conftest import converted
    from model_helpers import expert_bytes
    from test_host_tier import RECIPE, _run, _streamed
    from tqbench.runtime.load import load

    m = converted(RECIPE)
    res = _run(load(m).model)
    st = _run(_streamed(m, expert_bytes(m), 12, 0, 2, policy="lru").model)
    np.savez(out, resident=res[0], streamed=st[0], resident_tokens=np.array(res[1]), streamed_tokens=np.array(st[1]))
    print("resident tokens", res[1], "\nstreamed tokens", st[1])


def noise_check() -> None:
    """How far bf16-sized noise moves the same prompt's logits on this machine: every decoder layer's output scaled
    by (1 + eps x N(0, 1)), against the plain run (what another backend's order of arithmetic can do)."""
    import mlx.core as mx

    from conftest import converted
    from model_helpers import logits
    from test_host_tier import PROMPT, RECIPE
    from tqbench.runtime.load import load

    model = load(converted(RECIPE)).model
    base = logits(model, PROMPT).astype(np.float32)
    cls = type(model.model.layers[0])
    plain = cls.__call__
    for eps in (2 ** -10, 2 ** -8):
        for seed in (1, 2):
            key = [mx.random.key(seed)]

            def noisy(self, *a, **k):
                h, blocks = plain(self, *a, **k)
                key[0], sub = mx.random.split(key[0])
                return h * (1 + eps * mx.random.normal(h.shape, key=sub).astype(h.dtype)), blocks

            cls.__call__ = noisy
            try:
                x = logits(model, PROMPT).astype(np.float32)
            finally:
                cls.__call__ = plain
            d = np.abs(x - base).max(-1).ravel()
            print(f"eps 2^{int(np.log2(eps))} seed {seed}: logits moved up to {d.max():.2f} (rows {np.round(d, 2)}), "
                  f"argmax alike on {(x.argmax(-1) == base.argmax(-1)).sum()} of {len(PROMPT)} rows")


def sections(blob: bytes) -> list[tuple[str, int]]:
    """An ELF64 file's sections, (name, size), largest first."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    hdr = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names = blob[hdr[shstrndx][4]:hdr[shstrndx][4] + hdr[shstrndx][5]]
    return sorted(((names[h[0]:names.index(b"\0", h[0])].decode(), h[5]) for h in hdr), key=lambda x: -x[1])


def launch_check() -> None:
    import mlx.core as mx

    from kernels import tq_weights
    from tqbench.cubin import cached_cubin
    from tqbench.paths import cache_dir
    from tqbench.runtime import kernels as K

    for f in sorted(glob.glob(str(cache_dir() / "cuda" / "*.cubin"))):
        b = open(f, "rb").read()
        print(f"{os.path.basename(f)[:60]} {len(b):,} B: " + ", ".join(f"{n} {s:,}" for n, s in sections(b)[:3]))
    for levels, out, n in ((3, 512, 512), (16, 512, 512)):
        x = mx.random.normal((1, n), key=mx.random.key(3))
        w, s, cb = tq_weights(levels, out, n, (), key=500)
        spec = K.make_spec(levels, 64, n, out, 1, 1, False, K.dtype_name(s.dtype), K.dtype_name(cb.dtype))
        grid, tg = spec.grid(1)
        kname, cubin = cached_cubin(K.kernel_name(spec, "cuda"), lambda nm: K.cuda_program(spec, nm))

        def launch(src: bytes):
            return mx.fast.precompiled_cuda_kernel(name=kname, compiled_source=src, inputs=[x, w, s, cb], grid=grid,
                                                   threadgroup=tg, output_shapes=[(1, 1, out)],
                                                   output_dtypes=[mx.float32], scalars=[],
                                                   ensure_row_contiguous=True)[0]

        for pad in (0, 200_000, 1_000_000):
            src, times = cubin + b"\0" * pad, []
            for _ in range(7):
                t0 = time.perf_counter()
                mx.eval([launch(src) for _ in range(200)])
                times.append((time.perf_counter() - t0) / 200)
            print(f"levels {levels} {out}x{n}: cubin {len(cubin):,} + pad {pad:,}: "
                  f"{statistics.median(times) * 1e6:.1f} us per launch (build + eval)", flush=True)
        for label, src in (("a one-byte cubin, module loaded", b"x"), ("the cubin again", cubin)):
            try:
                mx.eval(launch(src))
                print(f"  {label}: ok")
            except Exception as e:  # noqa: BLE001 - what MLX says is the finding
                print(f"  {label}: {type(e).__name__}: {str(e)[:160]}")


def _median_us(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        times.append((time.perf_counter() - t0) / n)
    return round(statistics.median(times) * 1e6, 2)


def launch_detail(child: bool) -> dict:
    import mlx.core as mx

    from kernels import tq_weights
    from tqbench.cubin import architecture, cached_cubin, compile_cubin
    from tqbench.runtime import kernels as K

    rows = []
    # (levels, out, n, experts, pairs): K3's expert gate/up (3072 x 7168) and down (7168 x 3072); a small matvec
    for levels, out, n, experts, pairs in ((3, 3072, 7168, 24, 16), (8, 7168, 3072, 24, 16), (16, 512, 512, 1, 0)):
        w, s, cb = tq_weights(levels, out, n, (experts,) if pairs else (), key=500)
        x = mx.random.normal((1, 1, n), key=mx.random.key(3))
        idx = mx.array([(7 * i) % experts for i in range(pairs)], dtype=mx.uint32)
        names = K.dtype_name(s.dtype), K.dtype_name(cb.dtype)
        if pairs:
            spec = K.gather_specs(1, (1,), (pairs,), levels=levels, group=64, n=n, out=out, experts=experts,
                                  scale_dtype=names[0], book_dtype=names[1])[0]
            inputs, oshape = [x.reshape(1, 1, n), w, s, cb, idx], [(pairs, 1, out)]
        else:
            spec = K.make_spec(levels, 64, n, out, 1, 1, False, *names)
            inputs, oshape = [x.reshape(1, n), w, s, cb], [(1, 1, out)]
        grid, tg = spec.grid(max(pairs, 1))
        kname, cubin = cached_cubin(K.kernel_name(spec, "cuda"), lambda nm: K.cuda_program(spec, nm))
        variants = [("cubin", kname, cubin), ("cubin + 1 MB of zeros", kname, cubin + b"\0" * 1_000_000)]
        if levels == 3:  # one copy of the ternary block: the codebook's symmetry tested inside it, at run time
            src = K.cuda_program(spec, kname + "_rt")
            old = "#define TQ_BLOCK(J) if (general) TQ_BLOCK_TER(J, true) else TQ_BLOCK_TER(J, false)"
            assert old in src
            src = src.replace(old, "#define TQ_BLOCK(J) TQ_BLOCK_TER(J, general)")
            blob = compile_cubin(src, architecture())
            variants.append(("one ternary block, branch at run time", kname + "_rt", blob))
        ref = None
        for label, name, blob in variants:
            def launch(name=name, blob=blob):
                return mx.fast.precompiled_cuda_kernel(name=name, compiled_source=blob, inputs=inputs, grid=grid,
                                                       threadgroup=tg, output_shapes=oshape,
                                                       output_dtypes=[mx.float32], scalars=[],
                                                       ensure_row_contiguous=True)[0]
            y = launch()
            mx.eval(y)
            ref = y if ref is None else ref
            held = []

            def build(held=held, launch=launch):
                held[:] = [launch() for _ in range(200)]
                return 200

            def run(launch=launch):
                mx.eval([launch() for _ in range(200)])
                return 200
            b = _median_us(build)
            mx.eval(held)
            rows.append(dict(levels=levels, out=out, n=n, pairs=pairs, variant=label, cubin_bytes=len(blob),
                             text_bytes=sum(sz for nm, sz in sections(blob) if nm.startswith(".text")),
                             build_us=b, build_and_run_us=_median_us(run),
                             max_abs_diff_vs_first=float(mx.max(mx.abs(y - ref)).item())))
            print(rows[-1], flush=True)
        own = K._compiled(spec, "cuda", "mlx")

        def run_own():
            mx.eval([own(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=oshape,
                         output_dtypes=[mx.float32])[0] for _ in range(200)])
            return 200
        run_own()
        rows.append(dict(levels=levels, out=out, n=n, pairs=pairs, variant="MLX's own build (mx.fast.cuda_kernel)",
                         source_bytes=sum(map(len, K.kernel_source(spec, "cuda"))),
                         build_and_run_us=_median_us(run_own)))
        print(rows[-1], flush=True)
    doc = dict(malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"), rows=rows)
    if not child:
        import json
        import subprocess
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 26), MALLOC_TRIM_THRESHOLD_=str(1 << 27))
        out = subprocess.run([sys.executable, __file__, "launch-detail", "--child"], env=env, capture_output=True,
                             text=True)
        print(out.stderr[-2000:])
        doc = dict(default_malloc=doc, heap_malloc=json.loads(out.stdout.strip().splitlines()[-1]))
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["logits", "noise", "launch", "launch-detail"])
    ap.add_argument("--out", default="logits-cuda.npz")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.check == "launch-detail":
        import json
        doc = launch_detail(a.child)
        if a.child:
            print(json.dumps(doc))
        else:
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
        return
    {"logits": lambda: logits_check(a.out), "noise": noise_check, "launch": launch_check}[a.check]()


if __name__ == "__main__":
    main()

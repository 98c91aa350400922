#!/usr/bin/env python3
"""Two checks for a GPU sitting (issue 50), written to files the sitting brings back:

    python3 scripts/gpu_cuda_checks.py logits --out logits-cuda.npz   # then the same here on the CPU, and compare
    python3 scripts/gpu_cuda_checks.py noise                            # the CPU's own logits under bf16-sized noise
    python3 scripts/gpu_cuda_checks.py launch                           # launch cost against the cubin's bytes

`logits`: tests/test_host_tier.py's prompt on the demo's tq3a-tqTe-down4-g32 conversion, resident and streamed
(12 slots, no host tier): the prompt's logits and 10 greedy tokens each, saved as .npz
(results/gpu-cuda-checks-h100.json compares them with the CPU's). `noise`: the CPU's own logits of that prompt with
every layer's output scaled by (1 + eps x noise). `launch`: the ELF sections of every cubin in tqbench's cache, and the
launch cost of one 512x512 matvec with its cubin padded by trailing zeros (a cost that grows with the bytes handed to
MLX, not the code).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["logits", "noise", "launch"])
    ap.add_argument("--out", default="logits-cuda.npz")
    a = ap.parse_args()
    {"logits": lambda: logits_check(a.out), "noise": noise_check, "launch": launch_check}[a.check]()


if __name__ == "__main__":
    main()

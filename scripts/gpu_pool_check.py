#!/usr/bin/env python3
"""Slot pools on the GPU: does a gathered expert product work on the largest pool array tqbench allows?

tqbench.stream splits slot pools so that no array exceeds `StreamConfig.max_array_bytes` (1 GiB) because MLX's CUDA
`gather_qmm` was seen failing on a 2.8 GB (512-expert) pool. This script builds K3-sized expert pools (3072 x 7168,
4-bit affine and TurboQuant 3-bit codes) just under 1 GiB and just over 2 GiB, runs 16-of-N gathered products on
each and checks them against the same experts taken out of the pool (plain matmul of their dequantized weights).

    PYTHONPATH=. python3 scripts/gpu_pool_check.py --out pool.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
import numpy as np

OUT, IN = 3072, 7168


def affine_pool(slots: int):
    w = mx.random.normal((1, OUT, IN)) * 0.02
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    # every slot a copy of one quantized expert with a different scale, so slots are distinguishable
    k = mx.arange(1, slots + 1, dtype=mx.float16).reshape(slots, 1, 1) / slots
    return mx.broadcast_to(q, (slots, *q.shape[1:])) + 0, s * k, b * k


def tq_pool(slots: int):
    words = -(-IN // 10)
    codes = mx.random.randint(0, 2**30, (1, OUT, words)).astype(mx.uint32)
    k = mx.arange(1, slots + 1, dtype=mx.float16).reshape(slots, 1, 1) / slots
    scales = mx.ones((1, OUT, IN // 64), dtype=mx.float16) * k
    return mx.broadcast_to(codes, (slots, OUT, words)) + 0, scales


def check(slots: int) -> dict:
    out = {"slots": slots}
    x = mx.random.normal((16, 1, 1, IN)).astype(mx.float16)
    idx = mx.array(np.random.default_rng(0).choice(slots, 16, replace=False).astype(np.uint32)).reshape(16, 1)
    try:
        q, s, b = affine_pool(slots)
        mx.eval(q, s, b)
        out["affine_pool_bytes"] = q.nbytes
        t = time.perf_counter()
        y = mx.gather_qmm(x, q, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)
        mx.eval(y)
        out["affine_gather_ms"] = (time.perf_counter() - t) * 1e3
        ref = mx.concatenate([mx.quantized_matmul(x[i], q[int(idx[i, 0])], s[int(idx[i, 0])], b[int(idx[i, 0])],
                                                  transpose=True, group_size=64, bits=4)[None] for i in range(16)])
        out["affine_max_abs_diff"] = float(mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)).max())
        del q, s, b
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out["affine_error"] = " ".join(str(e).split())[:300]
    try:
        from tqbench.runtime import codebook, kernels

        w, sc = tq_pool(slots)
        book = mx.array([-2.15, -1.34, -0.76, -0.25, 0.25, 0.76, 1.34, 2.15], dtype=mx.float16)
        mx.eval(w, sc)
        out["tq_pool_bytes"] = w.nbytes
        xr = x.astype(mx.float32)
        t = time.perf_counter()
        y = kernels.gather_matmul(xr, w, sc, book, idx)
        mx.eval(y)
        out["tq_gather_ms"] = (time.perf_counter() - t) * 1e3
        sel = [int(v) for v in np.array(idx).ravel()]
        ref = mx.concatenate([codebook.matmul(xr[i], w[j], sc[j], book)[None] for i, j in enumerate(sel)])
        out["tq_max_rel_diff"] = float(mx.abs(y - ref).max() / mx.abs(ref).max())
        del w, sc
    except Exception as e:  # noqa: BLE001
        out["tq_error"] = " ".join(str(e).split())[:300]
    mx.clear_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    a = ap.parse_args()
    per_expert = OUT * IN // 2  # 4-bit codes of one expert
    results = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.node(),
               "runs": [check(s) for s in ((1 << 30) // per_expert, 96, 256, 200 + (2 << 30) // per_expert)]}
    print(json.dumps(results, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

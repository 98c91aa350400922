#!/usr/bin/env python3
"""What calibrated rounding (recipe part `cal`, tqbench.quant.calibrate) costs per Kimi K3 expert, against nearest
rounding, on whatever device MLX uses (the calibrated steps are numpy: the CPU).

    python benchmarks/calibrate_cost.py --out bench-results/calibrate-cost.json     # ~2 min on 2 CPU cores
    python benchmarks/calibrate_cost.py --quick                                     # seconds

One K3 expert at `tq3a-tqTe-down4-g64`: gate and up (3072 x 3584, ternary, group 64) and down (3584 x 3072, 4-bit),
random float32 weights, searched scales (the default rule). Per matrix, the median of `--repeats` calls of
`turboquant.quantize` (what a conversion does today) and of `calibrate.quantize_calibrated` with an H from `--tokens`
random correlated inputs, plus the calibrated call's stages (H rotated, GPTQ, scale refit, polish sweep) timed once.
The projection multiplies the per-expert times by K3's 82,432 expert-layers (the resident part, ~3% of the bytes,
is left out of both); it leaves out the calibration pass itself (running the source model over the calibration text),
which for K3 needs the streamed model and is not measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import dump_json, peak_rss_bytes, with_openblas  # noqa: E402

K3_EXPERT = [("gate", 3072, 3584, "T"), ("up", 3072, 3584, "T"), ("down", 3584, 3072, "4")]
QUICK_EXPERT = [("gate", 96, 256, "T"), ("up", 96, 256, "T"), ("down", 256, 128, "4")]
K3_EXPERT_LAYERS = 82_432
GROUP = 64


def stages(w, kind: str, signs, h) -> dict:
    """The calibrated call's stages, each timed once (the same work quantize_calibrated does)."""
    import mlx.core as mx
    import numpy as np

    from tqbench.quant import calibrate as cal
    from tqbench.quant import turboquant as tq

    out = {}
    t = time.perf_counter()
    w_rot = np.array(tq.rotate(w, signs), dtype=np.float32)
    h_rot = cal.rotated_hessian(h, np.array(signs))
    out["rotate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    codes, scales = cal.gptq_codes(w_rot, h_rot, kind, GROUP)
    out["gptq_s"] = time.perf_counter() - t
    h_obj = cal.damped(h_rot)
    t = time.perf_counter()
    scales = cal.refit_scales(w_rot, h_obj, codes, scales, kind=kind, group=GROUP)
    out["refit_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cal.polish_codes(w_rot, h_obj, codes, scales, kind=kind, group=GROUP)
    out["polish_s"] = time.perf_counter() - t
    mx.eval(mx.zeros(1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="random inputs H is made of")
    p.add_argument("--quick", action="store_true", help="small matrices, one repeat")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    with_openblas()
    import mlx.core as mx
    import numpy as np

    from tqbench.quant import calibrate as cal
    from tqbench.quant import turboquant as tq

    shapes = QUICK_EXPERT if a.quick else K3_EXPERT
    repeats = 1 if a.quick else a.repeats
    rng = np.random.default_rng(0)
    rows = []
    for name, out, inp, kind in shapes:
        w = mx.array(rng.standard_normal((out, inp)).astype(np.float32) * 0.02)
        signs = mx.array(tq.rotation_signs(f"k3.{name}", inp))
        mix = rng.standard_normal((inp, inp)).astype(np.float32) * (rng.random(inp) ** 3).astype(np.float32)[None, :]
        x = rng.standard_normal((a.tokens, inp)).astype(np.float32) @ mix
        h = x.T.astype(np.float64) @ x
        tq.quantize(w, kind, GROUP, signs, rule="search")  # compile the kernels once
        nearest, calibrated = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            tq.quantize(w, kind, GROUP, signs, rule="search")
            nearest.append(time.perf_counter() - t)
            t = time.perf_counter()
            cal.quantize_calibrated(w, kind, GROUP, signs, h)
            calibrated.append(time.perf_counter() - t)
        row = dict(name=name, shape=[out, inp], codebook=kind, nearest_s=statistics.median(nearest),
                   calibrated_s=statistics.median(calibrated), nearest_times_s=nearest, calibrated_times_s=calibrated,
                   stages=stages(w, kind, signs, h))
        rows.append(row)
        print(f"{name} {out}x{inp} {kind}: nearest {row['nearest_s']:.2f} s, calibrated {row['calibrated_s']:.2f} s "
              f"({', '.join(f'{k} {v:.2f}' for k, v in row['stages'].items())})", flush=True)
    per_nearest = sum(r["nearest_s"] for r in rows)
    per_cal = sum(r["calibrated_s"] for r in rows)
    doc = dict(schema="tqbench.bench.calibrate-cost/1", date=time.strftime("%Y-%m-%d"), device=str(mx.default_device()),
               platform=platform.platform(), mlx=mx.__version__, quick=a.quick, tokens=a.tokens, repeats=repeats,
               refits=cal.REFITS, polish=cal.POLISH, matrices=rows, expert_nearest_s=per_nearest,
               expert_calibrated_s=per_cal, ratio=per_cal / per_nearest,
               k3_experts_nearest_hours=per_nearest * K3_EXPERT_LAYERS / 3600,
               k3_experts_calibrated_hours=per_cal * K3_EXPERT_LAYERS / 3600, peak_rss=peak_rss_bytes())
    print(f"one expert: nearest {per_nearest:.2f} s, calibrated {per_cal:.2f} s ({per_cal / per_nearest:.1f}x); "
          f"K3's {K3_EXPERT_LAYERS:,} expert-layers: {doc['k3_experts_nearest_hours']:.1f} h against "
          f"{doc['k3_experts_calibrated_hours']:.1f} h on this device")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(dump_json(doc))
    print(json.dumps({k: doc[k] for k in ("expert_nearest_s", "expert_calibrated_s", "ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

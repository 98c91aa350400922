#!/usr/bin/env python3
"""What a training step of the demo costs with mlx-lm's per-time-step KDA loop against tqbench's chunked gated delta
rule (`training.delta`), on whatever device MLX uses (the lent H200 with MLX's CUDA build is where it matters).

    python benchmarks/kda_training.py --out bench-results/kda.json      # --quick for a CPU smoke run

1. The recurrence alone, forward and backward, at the chat demo's training shape (64 x 128 tokens, 4 heads of 32):
   the loop and chunk sizes 8/16/32, median of --repeats after a warm-up, and the largest difference of outputs and
   gradients from the loop's.
2. Whole training steps of the chat spec (loss, gradients, AdamW update; random tokens, the same batch), loop against
   chunked: median seconds a step and tokens/s, and the losses of the first step side by side.
Ratios against the loop measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from harness import REPO


def timed(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def recurrence(B: int, T: int, H: int, D: int, repeats: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    from training.delta import chunked_gated_delta

    mx.random.seed(0)
    q = mx.random.normal((B, T, H, D))
    k = mx.random.normal((B, T, H, D))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D ** -0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, H, D))
    g = mx.exp(-5.0 * mx.sigmoid(mx.random.normal((B, T, H, D))))
    beta = mx.sigmoid(mx.random.normal((B, T, H)))
    args = (q, k, v, g, beta)

    def grad_of(f):
        def loss(*a):
            y, s = f(*a, None)
            return (y * y).sum() + 0.5 * (s * s).sum()
        return mx.value_and_grad(loss, argnums=tuple(range(5)))

    ref = grad_of(gated_delta_ops)
    ref_out = ref(*args)
    mx.eval(ref_out)
    rows = [{"kernel": "loop", "seconds": timed(lambda: ref(*args), repeats)}]
    for chunk in (8, 16, 32):
        f = grad_of(lambda *a, c=chunk: chunked_gated_delta(*a, chunk=c))
        out = f(*args)
        diff = max(mx.abs(a - b).max().item() for a, b in zip(ref_out[1], out[1]))
        rows.append({"kernel": f"chunk{chunk}", "seconds": timed(lambda: f(*args), repeats),
                     "loss_rel_diff": abs(out[0].item() - ref_out[0].item()) / abs(ref_out[0].item()),
                     "grad_max_abs_diff": diff})
    for r in rows:
        r["speedup_vs_loop"] = rows[0]["seconds"] / r["seconds"]
    return {"shape": {"batch": B, "seq_len": T, "heads": H, "head_dim": D}, "rows": rows}


def training_steps(B: int, T: int, steps: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from scripts import train_demo
    from tqbench.demo import CHAT_SPEC
    from training.delta import chunked_kda_training

    train_demo.SPEC = CHAT_SPEC
    x = mx.random.randint(0, CHAT_SPEC.vocab_size, (B, T + 1), key=mx.random.key(1))
    out = {"spec": "chat", "batch": B, "seq_len": T}
    for name in ("loop", "chunk16"):
        model = train_demo.build_model(0, CHAT_SPEC)
        model.train()
        opt = optim.AdamW(learning_rate=1e-3)

        def loss_fn(m, xb, yb):
            return nn.losses.cross_entropy(m(xb).astype(mx.float32), yb, reduction="mean")

        vg = nn.value_and_grad(model, loss_fn)

        def step():
            loss, grads = vg(model, x[:, :-1], x[:, 1:])
            opt.update(model, grads)
            return loss, model.parameters(), opt.state

        if name == "loop":
            first = step()[0].item()
            secs = timed(step, steps)
        else:
            with chunked_kda_training(16):
                first = step()[0].item()
                secs = timed(step, steps)
        out[name] = {"seconds_per_step": secs, "tokens_per_second": B * T / secs, "first_loss": first}
    out["speedup"] = out["loop"]["seconds_per_step"] / out["chunk16"]["seconds_per_step"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats (a CPU smoke run)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "kda_training.json")
    a = p.parse_args(argv)
    import mlx.core as mx

    B, T = (4, 32) if a.quick else (64, 128)
    started = time.time()
    rec = recurrence(B, T, 4, 32, 1 if a.quick else a.repeats)
    print(json.dumps(rec["rows"]), flush=True)
    steps = training_steps(B, T, 1 if a.quick else a.steps)
    print(json.dumps(steps), flush=True)
    doc = {"schema": "tqbench.bench.kda-training/1", "date": time.strftime("%Y-%m-%d"),
           "machine": {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__},
           "quick": a.quick, "recurrence": rec, "training": steps, "seconds": round(time.time() - started, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

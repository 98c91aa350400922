#!/usr/bin/env python3
"""What one training step of the chat demo costs at several batch sizes (issue 10: the demo's quality is bought with
tokens, and the lent GPU gives 25 minutes): the real step of scripts/train_demo.py (`training_step`: loss, gradients,
clipping, AdamW, the router-bias balancing), the chunked KDA recurrence, on whatever device MLX uses.

    python benchmarks/train_step.py --out bench-results/train_step.json               # batches 64,128,256
    python benchmarks/train_step.py --batches 64,128 --compile --out ...              # also the compiled step
    python benchmarks/train_step.py --batches 64 --optimizers mlx,flat --kda-chunks 16,64 --count-ops  # the step's overhead
    python benchmarks/train_step.py --quick                                           # a CPU smoke run (seconds)

Per batch size: the median seconds of --steps steps after --warmup steps (each step evaluated and its loss read, as
training does), tokens per second, and tokens per second relative to the first batch size in the list (measured in
the same run); the first step's seconds apart (on CUDA it compiles kernels); the forward pass alone (median, same
batches: the rest of a step is the backward pass and the update); MLX's peak memory; with --optimizers, each
optimizer at each batch size in turn and its step time relative to the first one's; with --count-ops, the operations
of one step's graph by name (those that are not mere views are what a backend launches). The model is the chat
spec from its seed; the tokens are random (speed does not depend on them). Peak RSS of the process at the end.
"""

from __future__ import annotations

from harness import REPO, openblas_mapped, peak_rss_bytes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def count_primitives(*outputs) -> dict[str, int]:
    """The operations of the graph that computes `outputs` (MLX's dot export, counted by name): what a backend must
    launch, before any fusion, and so a device-independent view of a step's overhead."""
    import tempfile
    from collections import Counter

    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        names = re.findall(r'\[label ="([A-Za-z]+)"', Path(f.name).read_text())
    return dict(Counter(names).most_common())


# Operations that only describe a view of their input (no kernel on any backend MLX has).
VIEWS = {"Broadcast", "Squeeze", "ExpandDims", "Reshape", "Flatten", "Unflatten", "Transpose", "Slice", "AsStrided"}


def measure(batch: int, seq_len: int, warmup: int, steps: int, compiled: bool, kind: str = "mlx",
            count_ops: bool = False) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from scripts import train_demo
    from tqbench.demo import CHAT_SPEC

    train_demo.SPEC = CHAT_SPEC
    a = argparse.Namespace(**{**train_demo.CHAT_DEFAULTS, "compile": compiled, "clip": 1.0, "weight_decay": 0.1,
                              "router_lr_mult": 0.1, "optimizer": kind})
    def fresh():  # the model from its seed, its step and optimizer at lr 1e-3
        model = train_demo.build_model(0, CHAT_SPEC)
        model.train()
        moes = train_demo.moe_layers(model)
        step, optimizer, set_lr = train_demo.training_step(model, moes, a)
        set_lr(1e-3)
        return model, moes, step, optimizer

    model, moes, step, optimizer = fresh()
    E = CHAT_SPEC.num_experts
    ema = mx.zeros((len(moes), E))
    u = mx.array(1e-3)
    rng = mx.random.key(batch)
    tokens = mx.random.randint(0, CHAT_SPEC.vocab_size, (warmup + steps + 1, batch, seq_len + 1), key=rng)
    mx.eval(tokens)
    ops = None
    if count_ops and not compiled:  # one step's graph, built and counted (then dropped: the timed steps start over)
        mx.eval(model.parameters())  # the initial values' own graph is not the step's
        out = step(tokens[0, :, :-1], tokens[0, :, 1:], u, ema)
        ops = count_primitives(*out, *[v for _, v in tree_flatten(model.parameters())],
                               *[v for _, v in tree_flatten(optimizer.state)])
        model, moes, step, optimizer = fresh()
    mx.reset_peak_memory()
    times, losses = [], []
    for i in range(warmup + steps + 1):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        t = time.perf_counter()
        loss, gnorm, counts, ema = step(x, y, u, ema)
        mx.eval(loss, gnorm, counts, ema, model.parameters(), optimizer.state)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    per_step = statistics.median(times[1 + warmup:])
    forward = []  # the forward pass alone (training mode), on the timed steps' batches: how much of a step it is
    for i in range(1 + warmup, 1 + warmup + steps):
        t = time.perf_counter()
        mx.eval(model(tokens[i, :, :-1]))
        forward.append(time.perf_counter() - t)
    counted = {} if ops is None else {"primitives": sum(ops.values()),
                                      "kernel_primitives": sum(v for k, v in ops.items() if k not in VIEWS),
                                      "primitives_by_name": ops}
    return {"batch": batch, "seq_len": seq_len, "compiled": compiled, "optimizer": kind, **counted,
            "first_step_s": times[0],
            "seconds_per_step": per_step, "forward_s": statistics.median(forward),
            "tokens_per_second": batch * seq_len / per_step,
            "steps_timed": steps, "first_loss": losses[0], "mlx_peak_memory": mx.get_peak_memory()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,128,256", help="sequences per step, comma-separated (first: the baseline)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="also time the mx.compile'd step at each batch size")
    p.add_argument("--optimizers", default="mlx",
                   help="comma-separated: mlx (MLX's AdamW per parameter), flat (training.flat_adamw); each batch "
                        "size is timed with each, in turn")
    p.add_argument("--kda-chunks", default="16",
                   help="comma-separated: time steps per chunk of the chunked KDA recurrence (powers of two); each "
                        "batch size is timed with each, in turn")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the operations of one uncompiled step's graph (what a backend launches)")
    p.add_argument("--quick", action="store_true", help="batches 2,4 of 32 tokens, 1 warm-up, 2 steps")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "train_step.json")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    import mlx.core as mx

    from training.delta import chunked_kda_training

    if a.quick:
        a.batches, a.seq_len, a.warmup, a.steps = "2,4", 32, 1, 2
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: comma-separated integers, not {a.batches!r}") from None
    if not batches or min(batches) < 1 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("--batches, --steps must be >= 1 and --warmup >= 0")
    try:
        chunks = [int(c) for c in a.kda_chunks.split(",")]
    except ValueError:
        chunks = []
    if not chunks or any(c < 1 or c & (c - 1) for c in chunks):
        raise SystemExit(f"--kda-chunks: comma-separated powers of two, not {a.kda_chunks!r}")
    optimizers = a.optimizers.split(",")
    if not optimizers or any(o not in ("mlx", "flat") for o in optimizers):
        raise SystemExit(f"--optimizers: a comma-separated list of mlx and flat, not {a.optimizers!r}")
    started = time.time()
    rows = []
    for compiled in (False, True) if a.compile else (False,):
        for b in batches:
            for chunk in chunks:
                with chunked_kda_training(chunk):
                    for opt in optimizers:
                        r = {**measure(b, a.seq_len, a.warmup, a.steps, compiled, opt, a.count_ops),
                             "kda_chunk": chunk}
                        rows.append(r)
                        ops = f", {r['kernel_primitives']:,} kernel operations" if "primitives" in r else ""
                        print(f"batch {b:4d}{' compiled' if compiled else ''} {opt} chunk {chunk}: "
                              f"{r['seconds_per_step'] * 1000:.1f} ms/step, {r['tokens_per_second']:,.0f} tokens/s, "
                              f"forward {r['forward_s'] * 1000:.1f} ms (first step {r['first_step_s']:.1f} s){ops}",
                              flush=True)
    base = rows[0]["tokens_per_second"]
    for r in rows:  # ratios within the run: to the first batch size, and at the same batch to the first optimizer/chunk
        r["tokens_per_second_vs_baseline"] = r["tokens_per_second"] / base
        key = (r["batch"], r["compiled"])
        first_opt = next(q for q in rows if (q["batch"], q["compiled"]) == key and q["kda_chunk"] == r["kda_chunk"]
                         and q["optimizer"] == optimizers[0])
        first_chunk = next(q for q in rows if (q["batch"], q["compiled"]) == key and q["kda_chunk"] == chunks[0]
                           and q["optimizer"] == r["optimizer"])
        r["step_time_vs_first_optimizer"] = r["seconds_per_step"] / first_opt["seconds_per_step"]
        r["step_time_vs_first_chunk"] = r["seconds_per_step"] / first_chunk["seconds_per_step"]
    doc = {"schema": "tqbench.bench.train-step/1", "date": time.strftime("%Y-%m-%d"),
           "machine": {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__},
           "quick": a.quick, "baseline": f"batch {batches[0]}", "kda_chunks": chunks, "rows": rows,
           "peak_rss": peak_rss_bytes(), "openblas_mapped": openblas_mapped(),
           "seconds": round(time.time() - started, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train the built-in demo model: a tiny Kimi K3 (mlx-lm's kimi_k3) on the Python standard library's own source.

    python scripts/train_demo.py all            # prepare, train, export (the shipped demo, into tqbench/demo/checkpoint)

Stages, each reading and writing files under --work (default build/demo-train):
  prepare  the corpus (the running interpreter's stdlib .py files, tests and generated data skipped, sorted), a
           train/validation split by file (a hash of the relative path), a byte-level BPE trained on the training
           split with tqbench's own trainer, written as tiktoken.model with the Kimi specials, token streams
  train    MLX training of `tqbench.demo.TRAINED_SPEC` (AdamW, warmup + cosine, clipping) with auxiliary-loss-free
           router balancing: after each step every MoE layer's `e_score_correction_bias` moves by
           -u * sign(load - mean load) over that step's top-k picks (the bias gets no gradient); validation loss
           every --eval-every steps; float weights (fp32) and train.json (setup, curve, final perplexity)
  export   the K3-layout source checkpoint through tqbench.demo's writer (routed experts mxfp4 via our packer, the rest
           bf16), checked against the float model; train.json copied into docs/demo-model.json ("training")

Seeded: the same stdlib, seed and step count give the same data order and initialisation. The defaults are the shipped
run (583 steps of 128 x 128 tokens: about 7 minutes on one H200 with MLX CUDA, hours on a CPU). `--steps 0
--time-budget S` instead times the first steps (inside the warmup, which does not depend on the total) and fixes the
total from them; train.json records it, and `--steps` with that number repeats the run.

On a machine without mlx-lm (the lent GPU), prepare here and carry the work directory and a copy of mlx_lm; the
engine modules this script uses need only numpy, tiktoken and regex.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project's engine, also where it is not installed (the GPU machine)

from tqbench.demo import (  # noqa: E402
    SHIPPED_DEMO,
    TRAINED_SPEC,
    corpus_files,
    encode_files,
    is_heldout,
    source_config,
    special_ids,
    stdlib_root,
)
from tqbench.tokenizer import load_encoding, read_tiktoken_model, train_bpe, write_tokenizer  # noqa: E402

SPEC = TRAINED_SPEC
DOCS_JSON = ROOT / "docs" / "demo-model.json"
FLOAT_SHARD_BYTES = 12 * 2**20  # float weights are saved in pieces below this size


def dump_json(obj) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[\s*([-\d.e, \n]+?)\s*\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text) + "\n"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- prepare --------------------------------------------------------------------------------------------------------


def prepare(work: Path, stdlib: Path | None) -> dict:
    root = Path(stdlib or stdlib_root())
    files = corpus_files(root)
    train_files = [f for f in files if not is_heldout(f)]
    val_files = [f for f in files if is_heldout(f)]
    train_text = b"".join((root / f).read_bytes() for f in train_files)
    t0 = time.time()
    ranks = train_bpe(train_text, SPEC.bpe_merges)
    if len(ranks) != SPEC.base_vocab:
        raise SystemExit(f"BPE stopped at {len(ranks)} tokens, {SPEC.base_vocab} wanted")
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tok_dir, ranks)
    log(f"BPE: {SPEC.bpe_merges} merges on {len(train_text):,} bytes in {time.time() - t0:.1f} s")

    enc = load_encoding(tok_dir)
    eos = special_ids(SPEC)["eos_token_id"]
    train = encode_files(enc, root, train_files, eos)
    val = encode_files(enc, root, val_files, eos)
    np.save(work / "train.npy", train.astype(np.uint16))
    np.save(work / "val.npy", val.astype(np.uint16))
    val_bytes = sum((root / f).stat().st_size for f in val_files)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.encode() + b"\0" + hashlib.sha256((root / f).read_bytes()).digest())
    corpus = {
        "source": "Python standard library .py files (test directories, site-packages, encodings/, pydoc_data/, "
                  "config-*/ and _sysconfigdata* skipped)",
        "python": platform.python_version(),
        "stdlib": str(root),
        "files": len(files),
        "sha256": digest.hexdigest(),
        "train": {"files": len(train_files), "bytes": len(train_text), "tokens": int(len(train))},
        "validation": {"files": len(val_files), "bytes": val_bytes, "tokens": int(len(val)),
                       "rule": "sha256(relative path)[:4] as big-endian int % 20 == 0"},
        "validation_files": val_files,
        "bytes_per_token": round(len(train_text) / len(train), 3),
        "tokenizer": {"merges": SPEC.bpe_merges, "vocab": SPEC.vocab_size, "trained_on": "the whole training split"},
    }
    (work / "corpus.json").write_text(json.dumps(corpus, indent=2) + "\n")
    log(f"corpus: {len(train_files)} train files ({len(train):,} tokens), {len(val_files)} held out "
        f"({len(val):,} tokens), {corpus['bytes_per_token']} bytes/token")
    return corpus


# ---- model ----------------------------------------------------------------------------------------------------------


def build_model(seed: int):
    import mlx.core as mx
    from mlx_lm.models import kimi_k3

    mx.random.seed(seed)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(source_config(SPEC)))
    model.freeze(keys=["e_score_correction_bias"], strict=False)  # moved by the balancing rule, never by gradients
    return model


def moe_layers(model) -> list:
    from mlx_lm.models.kimi_k3 import KimiK3SparseMoE

    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, KimiK3SparseMoE)]


def reset_attn_res_cache(model) -> None:
    """kimi_k3 caches AttnRes' effective weights in eval mode; clear them after the weights change."""
    for layer in model.layers:
        if hasattr(layer, "_attn_res_w_eff"):
            layer._attn_res_w_eff = layer._mlp_res_w_eff = None
    if hasattr(model.model, "_output_res_w_eff"):
        model.model._output_res_w_eff = None


def save_float(model, work: Path) -> list[str]:
    """The fp32 parameters in safetensors pieces of < 12 MiB (so they can travel back from the GPU machine)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    for old in work.glob("float-*.safetensors"):
        old.unlink()
    pieces, cur, size = [], {}, 0
    for k, v in params.items():
        if cur and size + v.nbytes > FLOAT_SHARD_BYTES:
            pieces.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.nbytes
    pieces.append(cur)
    names = []
    for i, piece in enumerate(pieces):
        name = f"float-{i:02d}.safetensors"
        mx.save_safetensors(str(work / name), piece)
        names.append(name)
    return names


def load_float(work: Path) -> dict:
    import mlx.core as mx

    params = {}
    for f in sorted(work.glob("float-*.safetensors")):
        params.update(mx.load(str(f)))
    if not params:
        raise SystemExit(f"no float-*.safetensors in {work}: run the train stage first")
    return params


# ---- train ----------------------------------------------------------------------------------------------------------


def train(work: Path, a: argparse.Namespace) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from tqbench.modelstats import capture_routing, perplexity, windows

    train_ids = np.load(work / "train.npy").astype(np.int32)
    val_ids = np.load(work / "val.npy").astype(np.int32)
    T, B, E = a.seq_len, a.batch, SPEC.num_experts
    model = build_model(a.seed)
    moes = moe_layers(model)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"device {mx.default_device()}, {n_params:,} parameters, {len(moes)} MoE layers, batch {B} x {T}")

    def loss_fn(model, x, y):
        with capture_routing(model) as picks:
            logits = model(x)
        loss = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
        experts = mx.arange(E)
        counts = mx.stack([(p.reshape(-1, 1) == experts).sum(axis=0) for p in picks])  # [moe layers, E]
        return loss, counts

    decay = lambda path, p: p.ndim >= 2 and "norm" not in path  # noqa: E731  (matrices only; not norms, A_log, biases)
    adamw = lambda wd: optim.AdamW(learning_rate=0.0, betas=[0.9, 0.95], eps=1e-8, weight_decay=wd)  # noqa: E731
    router = lambda path, p: path.endswith("mlp.gate.weight")  # noqa: E731
    optimizer = optim.MultiOptimizer([adamw(0.0), adamw(a.weight_decay), adamw(0.0)], [router, decay])
    lr_mults = [a.router_lr_mult, 1.0, 1.0]

    def lr_at(i: int, total: int | None) -> float:
        """Linear warmup, then cosine decay to final_lr_frac * lr (the warmup does not depend on the total)."""
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        t = min(1.0, (i - a.warmup) / max(total - a.warmup, 1))
        return a.lr * (a.final_lr_frac + (1 - a.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    rng = np.random.default_rng(a.seed)
    starts_max = len(train_ids) - T - 1

    def batch():
        s = rng.integers(0, starts_max, B)
        w = train_ids[s[:, None] + np.arange(T + 1)]
        return mx.array(w[:, :-1]), mx.array(w[:, 1:])

    ex, ey = windows(val_ids, T)
    pick = np.linspace(0, len(ex) - 1, min(a.eval_windows, len(ex))).round().astype(int)
    eval_tokens = np.concatenate([np.concatenate([ex[i], ey[i][-1:]]) for i in pick])  # windows back to back

    def evaluate(tokens=None):
        reset_attn_res_cache(model)
        model.eval()
        r = perplexity(model, val_ids if tokens is None else tokens, window=T, batch=a.eval_batch)
        model.train()
        return r

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(x, y, u):
        (loss, counts), grads = loss_and_grad(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, a.clip)
        optimizer.update(model, grads)
        loads = counts.astype(mx.float32)
        for moe, c in zip(moes, loads):  # auxiliary-loss-free balancing (DeepSeek-V3; K3's router bias)
            moe.e_score_correction_bias = moe.e_score_correction_bias - u * mx.sign(c - c.mean())
        return loss, gnorm, counts

    if a.compile:
        state = [model.state, optimizer.state]
        step = mx.compile(step, inputs=state, outputs=state)

    if a.steps is None and a.probe_steps + 5 >= a.warmup:
        raise SystemExit("--time-budget needs --probe-steps + 5 < --warmup (the total is fixed inside the warmup)")
    max_steps = min(a.max_steps, int(a.max_epochs * len(train_ids) / (B * T)))
    total = a.steps
    best = {"val_loss": math.inf, "step": 0, "params": None}
    curve, t_start, t_probe = [], time.time(), None
    val0 = evaluate(tokens=eval_tokens)  # also sets kimi_k3's AttnRes caches, so the compiled step traces once
    curve.append({"step": 0, "tokens": 0, "val_loss": round(val0["loss"], 4)})
    log(f"step 0: val_loss={val0['loss']:.4f}")
    run_loss, run_n, loads_acc = 0.0, 0, np.zeros((len(moes), E))
    i = 0
    while True:
        if total is None and i == a.probe_steps + 5:  # fix the step count from the timed steps (inside the warmup)
            per_step = (time.time() - t_probe) / a.probe_steps
            remaining = a.time_budget - (time.time() - t_start) - a.reserve
            total = int(min(max_steps, i + max(remaining, 0) / (per_step * (1 + a.eval_overhead))))
            total = max(total, a.warmup + 10)
            log(f"{per_step * 1000:.0f} ms/step -> {total} steps in the time budget")
        if total is not None and i >= total:
            break
        if i == 5:
            mx.eval(model.parameters())
            t_probe = time.time()
        x, y = batch()
        lr = lr_at(i, total)
        for o, mult in zip(optimizer.optimizers, lr_mults):
            o.learning_rate = lr * mult
        # The bias speed follows the learning rate: the router's scores drift as fast as the lr lets them.
        loss, gnorm, counts = step(x, y, mx.array(a.bias_lr * lr / a.lr))
        mx.eval(loss, gnorm, counts, model.parameters(), optimizer.state)
        run_loss += loss.item()
        run_n += 1
        loads_acc += np.array(counts)
        i += 1
        if i % a.eval_every == 0 or i == total or i == 1:
            val = evaluate(tokens=eval_tokens)
            lr_now = lr_at(i - 1, total)
            share = loads_acc / loads_acc.sum(axis=1, keepdims=True)
            biases = np.stack([np.array(m.e_score_correction_bias) for m in moes])
            entry = {
                "step": i,
                "tokens": i * B * T,
                "train_loss": round(run_loss / run_n, 4),
                "val_loss": round(val["loss"], 4),
                "lr": float(f"{lr_now:.3g}"),
                "grad_norm": round(gnorm.item(), 3),
                "load_max_over_mean": round(float((share.max(axis=1) * E).max()), 3),
                "load_min_over_mean": round(float((share.min(axis=1) * E).min()), 3),
                "bias_range": [round(float(biases.min()), 4), round(float(biases.max()), 4)],
                "elapsed_s": round(time.time() - t_start, 1),
            }
            curve.append(entry)
            log(" ".join(f"{k}={v}" for k, v in entry.items()))
            if val["loss"] < best["val_loss"]:  # arrays are immutable: holding the references keeps this state
                best.update(val_loss=val["loss"], step=i, params=dict(tree_flatten(model.parameters())))
            run_loss, run_n, loads_acc = 0.0, 0, np.zeros((len(moes), E))
    train_s = time.time() - t_start
    if best["step"] != total:
        log(f"keeping step {best['step']} (best validation subset loss {best['val_loss']:.4f})")
        model.load_weights(list(best["params"].items()))

    final = evaluate()
    log(f"final held-out: loss {final['loss']:.4f}, perplexity {final['perplexity']:.3f} over {final['tokens']:,} "
        "tokens")
    pieces = save_float(model, work)
    corpus = json.loads((work / "corpus.json").read_text())
    result = {
        "model": {**{k: v for k, v in asdict(SPEC).items()}, "parameters": int(n_params),
                  "vocab_size": SPEC.vocab_size, "mla_layers": SPEC.full_attn_layers},
        "setup": {
            "seed": a.seed, "steps": total, "kept_step": best["step"], "batch": B, "seq_len": T, "tokens_seen": total * B * T,
            "epochs": round(total * B * T / corpus["train"]["tokens"], 2),
            "optimizer": f"AdamW(betas 0.9/0.95, weight decay {a.weight_decay} on matrices)",
            "router_lr": f"{a.router_lr_mult} x lr (no weight decay)",
            "kept": "the weights of the evaluation with the lowest validation-subset loss",
            "lr": {"peak": a.lr, "warmup_steps": a.warmup, "schedule": "linear warmup, cosine decay",
                   "final": round(a.lr * a.final_lr_frac, 10)},
            "grad_clip": a.clip, "dtype": "float32",
            "balancing": {"rule": "bias -= u * sign(load - mean load) per MoE layer after every step, from that "
                                  "step's top-k picks", "u_peak": a.bias_lr, "u_schedule": "u = u_peak * lr / peak lr"},
            "compiled": a.compile, "time_budget_s": a.time_budget if a.steps is None else None,
            "device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
            "train_seconds": round(train_s, 1), "tokens_per_second": round(total * B * T / train_s),
        },
        "corpus": {k: v for k, v in corpus.items() if k != "validation_files"},
        "curve": curve,
        "final_float": {k: (round(v, 5) if isinstance(v, float) else v) for k, v in final.items()},
        "float_weights": pieces,
    }
    (work / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---- export ---------------------------------------------------------------------------------------------------------


def export(work: Path, dest: Path, check: bool = True) -> dict:
    import mlx.core as mx

    from tqbench.demo import mlx_weights, write_checkpoint
    from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4

    params = {k: np.array(v) for k, v in load_float(work).items()}
    ranks = read_tiktoken_model(work / "tokenizer" / "tiktoken.model")
    write_checkpoint(dest, SPEC, mlx_weights(SPEC, params), ranks)
    dest.chmod(0o755)  # a package folder: readable by all, as the files are
    size = sum(f.stat().st_size for f in dest.iterdir())
    log(f"wrote {dest} ({size / 1e6:.2f} MB)")
    out = {"path": str(dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest), "bytes": size}

    if check:  # mlx-lm loads exactly the float weights rounded to bf16, the experts through our mxfp4 packer
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        from tqbench.shards.writer import from_bf16, to_bf16

        loaded, _ = load_model(dest)
        got = dict(tree_flatten(loaded.parameters()))
        for k, v in params.items():
            w = got[k]
            if ".switch_mlp." in k:
                w = mx.dequantize(w, got[k.removesuffix("weight") + "scales"], None, group_size=32, bits=4,
                                  mode="mxfp4", dtype=mx.float32)
                want = unpack_mxfp4(*pack_mxfp4(v))
            elif k.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
                want = v
            else:
                want = from_bf16(to_bf16(v))
            if not np.array_equal(np.array(w.astype(mx.float32)), want):
                raise SystemExit(f"the exported checkpoint does not reproduce {k}")
        log(f"check: mlx-lm loads all {len(params)} tensors exactly (bf16 rounding, mxfp4 experts)")
        out["check"] = {"tensors_exact": len(params)}
    return out


def write_docs_training(work: Path, exported: dict | None, docs: Path = DOCS_JSON) -> None:
    doc = json.loads(docs.read_text()) if docs.exists() else {}
    doc["schema"] = "tqbench.demo-model/1"
    doc["training"] = json.loads((work / "train.json").read_text())
    if exported:
        doc["checkpoint"] = exported
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(dump_json(doc))
    log(f"wrote {docs}")


# ---- command line ---------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["prepare", "train", "export", "all"])
    p.add_argument("--work", type=Path, default=ROOT / "build" / "demo-train")
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: the running interpreter's)")
    p.add_argument("--dest", type=Path, default=SHIPPED_DEMO)
    p.add_argument("--docs", type=Path, default=DOCS_JSON, help="the JSON document whose \"training\" is written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=583, help="0: fix the step count from --time-budget instead")
    p.add_argument("--time-budget", type=float, default=520.0, help="seconds, with --steps 0")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--max-epochs", type=float, default=8.0, help="caps the steps at this many passes over the data")
    p.add_argument("--reserve", type=float, default=40.0, help="seconds kept for the final evaluation and saving")
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--eval-overhead", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--final-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--router-lr-mult", type=float, default=0.1, help="the router's learning rate relative to the rest")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-lr", type=float, default=1e-2, help="u of the balancing rule at the peak learning rate")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="mx.compile the training step (slow to trace: kimi_k3's KDA loops over time in training)")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args(argv)
    a.steps = a.steps or None
    a.work.mkdir(parents=True, exist_ok=True)
    if a.stage in ("prepare", "all"):
        prepare(a.work, a.stdlib)
    if a.stage in ("train", "all"):
        train(a.work, a)
    if a.stage in ("export", "all"):
        exported = export(a.work, a.dest, check=not a.no_check)
        write_docs_training(a.work, exported, a.docs)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Measure the shipped demo model on held-out Python and record it in results/demo-model.json ("eval").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python scripts/demo_stats.py

- perplexity on the held-out split (the stdlib files `tqbench.demo.is_heldout` picks, tokenized with the shipped
  tokenizer, cut into non-overlapping windows) of: the float model (fp32, from `scripts/train_demo.py`'s work directory,
  when present), the same weights in bf16 with float experts, and the shipped checkpoint as `mlx_lm.load` reads it
  (bf16 + mxfp4 experts);
- a small slice (the first windows of the held-out stream) that tests/test_demo_trained.py recomputes;
- per MoE layer, on the held-out split: how many experts take 50/80/90% of the routings, the hottest and coldest
  expert's share, the mean Jaccard overlap of consecutive tokens' expert sets, distinct experts per 16 and 256 tokens,
  the same coverage within each held-out file, per-layer LRU hit rates, random-routing baselines, and the raw routing
  counts (the full trace is left in the work directory as routing-trace.npy);
- greedy generations from Python prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import dump_json, log
from tqbench.demo import SHIPPED_DEMO, SHIPPED_SPEC, special_ids
from tqbench.tokenizer import load_encoding
from training.corpus import corpus_files, encode_files, is_heldout, stdlib_root

ROOT = Path(__file__).resolve().parent.parent

RECORD_JSON = ROOT / "results" / "demo-model.json"
WINDOW = 128  # the training sequence length
SLICE_WINDOWS = 8
PROMPTS = ["def fibonacci(n):\n", "def fibonacci(n):", "class Stack:\n    def __init__(self):\n",
           "import os\nimport sys\n\n\ndef main():\n"]


def heldout_tokens(root: Path | None = None) -> tuple[np.ndarray, list[str]]:
    """The held-out split of the running interpreter's stdlib, tokenized by the shipped tokenizer."""
    root = Path(root or stdlib_root())
    files = [f for f in corpus_files(root) if is_heldout(f)]
    enc = load_encoding(SHIPPED_DEMO)
    return encode_files(enc, root, files, special_ids(SHIPPED_SPEC)["eos_token_id"]), files


def slice_files(files: list[str], root: Path, n_tokens: int) -> list[dict]:
    """The held-out files that the first `n_tokens` of the stream come from, with their digests."""
    enc = load_encoding(SHIPPED_DEMO)
    out, seen = [], 0
    for f in files:
        data = (root / f).read_bytes()
        out.append({"file": f, "sha256": hashlib.sha256(data).hexdigest()})
        seen += len(enc.encode_ordinary(data.decode("utf-8"))) + 1
        if seen >= n_tokens:
            break
    return out


def round_dict(d: dict, n: int = 4) -> dict:
    return {k: (round(v, n) if isinstance(v, float) else v) for k, v in d.items()}


def routing_section(trace: np.ndarray, tokens: np.ndarray) -> dict:
    """The routing statistics of a held-out trace (`[moe layers, tokens, k]`), for results/demo-model.json."""
    from training.modelstats import routing_summary

    moe_ids = [i for i in range(SHIPPED_SPEC.num_hidden_layers) if SHIPPED_SPEC.is_moe(i)]
    doc_ends = (np.flatnonzero(tokens == special_ids(SHIPPED_SPEC)["eos_token_id"]) + 1).tolist()
    summary = routing_summary(trace, SHIPPED_SPEC.num_experts, moe_ids, doc_ends=doc_ends)
    summary["layers"] = [round_dict(row) for row in summary["layers"]]
    summary["distinct_random"] = round_dict(summary["distinct_random"], 2)
    if "per_document_random" in summary:
        summary["per_document_random"] = round_dict(summary["per_document_random"], 2)
    summary["jaccard_random"] = round(summary["jaccard_random"], 4)
    summary["lru_random"] = round_dict(summary["lru_random"])
    counts = [np.bincount(t.reshape(-1), minlength=SHIPPED_SPEC.num_experts).tolist() for t in trace]
    return {**summary, "model": "the shipped checkpoint (mxfp4 experts)",
            "counts": {str(i): c for i, c in zip(moe_ids, counts)}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "build" / "demo-train", help="train_demo.py's work directory")
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--limit", type=int, default=None, help="held-out windows to use (default: all); for a quick look")
    p.add_argument("--out", type=Path, default=RECORD_JSON, help="the JSON document to update")
    p.add_argument("--reuse-trace", action="store_true", help="reuse --work's routing-trace.npy of an earlier run")
    a = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import generate, load

    from training.modelstats import perplexity, trace_routing

    root = stdlib_root()
    tokens, files = heldout_tokens(root)
    if a.limit:
        tokens = tokens[: a.limit * a.window + 1]
    log(f"held-out: {len(files)} files, {len(tokens):,} tokens")
    ev: dict = {"window": a.window, "heldout_files": len(files), "heldout_tokens": int(len(tokens)),
                "python": sys.version.split()[0], "perplexity": {}}

    model, tok = load(str(SHIPPED_DEMO))
    t0 = time.time()
    ev["perplexity"]["mxfp4_checkpoint"] = round_dict(perplexity(model, tokens, a.window, a.batch))
    log(f"shipped checkpoint: {ev['perplexity']['mxfp4_checkpoint']} ({time.time() - t0:.0f} s)")

    floats = sorted(a.work.glob("float-*.safetensors"))
    if floats:
        import train_demo
        from train_demo import build_model, load_float

        train_demo.SPEC = SHIPPED_SPEC  # build_model builds train_demo's current spec
        params = load_float(a.work)
        params = {k: v.astype(mx.float32) if ".switch_mlp." in k else v for k, v in params.items()}
        fm = build_model(0)
        fm.load_weights(list(params.items()))
        fm.eval()
        ev["perplexity"]["float32"] = round_dict(perplexity(fm, tokens, a.window, a.batch))
        log(f"float model: {ev['perplexity']['float32']}")
        keep = ("A_log", "dt_bias", "e_score_correction_bias")
        bm = build_model(0)
        # experts as saved, in float32 (the chat demo saves them bf16; MLX's CPU gather_mm takes float32 only)
        bm.load_weights([(k, v.astype(mx.float32) if ".switch_mlp." in k else v if k.endswith(keep)
                          else v.astype(mx.bfloat16)) for k, v in params.items()])
        bm.eval()
        ev["perplexity"]["bf16_float_experts"] = round_dict(perplexity(bm, tokens, a.window, a.batch))
        log(f"bf16, float experts: {ev['perplexity']['bf16_float_experts']}")
    else:
        log(f"no float weights in {a.work}: float perplexities left as recorded")
        old = json.loads(a.out.read_text()).get("eval", {}) if a.out.exists() else {}
        for k in ("float32", "bf16_float_experts"):
            if k in old.get("perplexity", {}):
                ev["perplexity"][k] = old["perplexity"][k]

    n_slice = SLICE_WINDOWS * a.window + 1
    sl = perplexity(model, tokens[:n_slice], a.window, a.batch)
    ev["slice"] = {**round_dict(sl, 5), "tokens_from_stream_start": n_slice,
                   "files": slice_files(files, root, n_slice)}
    log(f"slice: {ev['slice']['perplexity']}")

    t0 = time.time()
    trace_file = a.work / "routing-trace.npy"
    if a.limit:
        trace_file = a.work / "routing-trace-limited.npy"
    if a.reuse_trace and trace_file.is_file():
        trace = np.load(trace_file)
    else:
        trace = trace_routing(model, tokens, a.window, a.batch)
        a.work.mkdir(parents=True, exist_ok=True)
        np.save(trace_file, trace)  # [moe layers, tokens, k] for later cache and profile work
    ev["routing"] = routing_section(trace, tokens)
    log(f"routing traced in {time.time() - t0:.0f} s")
    for row in ev["routing"]["layers"]:
        log("  " + " ".join(f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in row.items()))

    ev["generation"] = []
    for prompt in PROMPTS:
        text = generate(model, tok, prompt, max_tokens=a.max_tokens)
        ev["generation"].append({"prompt": prompt, "greedy": text, "max_tokens": a.max_tokens})
        log(f"--- {prompt!r}\n{prompt}{text}")

    doc = json.loads(a.out.read_text()) if a.out.exists() else {"schema": "tqbench.demo-model/1"}
    doc["eval"] = ev
    a.out.write_text(dump_json(doc))
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Re-pack the shipped demo's routed experts with tqbench's current mxfp4 packer, from their decoded values.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python scripts/repack_demo.py
    # tqbench/demo/checkpoint in place; prints what changed, compares old and new on held-out windows, and records
    # both in results/demo-model.json ("checkpoint": bytes and "repack")

For when the packer's rule changes and the float weights of `scripts/train_demo.py` are gone (they are not shipped):
every expert matrix is decoded exactly (`unpack_mxfp4`) and packed again (`pack_mxfp4`); every other tensor, the
tokenizer and the configs are written unchanged through `tqbench.demo.write_checkpoint`. The decoded values stay
bit-identical (checked), so the model computes the same function; only encodings of the same values change. A decoded
group's largest magnitude is an E2M1 value times a power of two (mantissa 1 or 1.5), so a scale rule that differs
only on mantissas of 1.75 and above cannot move any non-zero group's scale: re-packing cannot recover a choice the
float weights would have made. With the float weights, `train_demo.py export` is the faithful path.

The check loads the old and the new checkpoint with `mlx_lm.load` and compares their logits on the first held-out batch
and their perplexity over the first `--check-windows` held-out windows (as `scripts/demo_stats.py` cuts them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import dump_json
from tqbench.demo import SHIPPED_DEMO, TRAINED_SPEC, write_checkpoint
from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4
from tqbench.shards.header import read_header
from tqbench.tokenizer import read_tiktoken_model

ROOT = Path(__file__).resolve().parent.parent


def read_tensors(root: Path) -> dict[str, np.ndarray]:
    """Every tensor's raw bytes (uint8), shaped for U8 tensors."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        raw = (root / f).read_bytes()
        for t in read_header(root / f).tensors:
            data = np.frombuffer(raw, np.uint8, t.nbytes, t.offset)
            out[t.name] = data.reshape(t.shape) if t.dtype == "U8" else data
    return out


def compare_models(old: Path, new: Path, n_windows: int, window: int = 128, batch: int = 32) -> dict:
    """Logits of the first held-out batch (bit for bit) and perplexity over the first `n_windows` windows."""
    import mlx.core as mx
    from mlx_lm import load

    from demo_stats import heldout_tokens
    from training.modelstats import perplexity, windows

    tokens, _ = heldout_tokens()
    models = {k: load(str(p))[0] for k, p in (("old", old), ("new", new))}
    x, _ = windows(tokens, window, min(n_windows, batch))
    logits = [np.array(m(mx.array(x.astype(np.int32))).astype(mx.float32)) for m in models.values()]
    out = {"logits_bit_identical": bool(np.array_equal(*logits)), "logits_windows": len(x)}
    for k, m in models.items():
        r = perplexity(m, tokens, window, batch, limit=n_windows)
        out[f"perplexity_{k}"] = round(r["perplexity"], 4)
        out[f"loss_{k}"] = round(r["loss"], 6)
        out["windows"], out["tokens"] = r["windows"], r["tokens"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=SHIPPED_DEMO)
    p.add_argument("--dest", type=Path, default=None, help="default: --src, replaced atomically")
    p.add_argument("--check-windows", type=int, default=128, help="held-out windows to compare on (0: no check)")
    p.add_argument("--docs", type=Path, default=ROOT / "results" / "demo-model.json",
                   help="the JSON document to update")
    p.add_argument("--no-docs", action="store_true")
    a = p.parse_args(argv)
    dest = a.dest or a.src
    keep = Path(tempfile.mkdtemp(prefix="demo-before-repack."))
    shutil.copytree(a.src, keep / "old")  # the old checkpoint for the comparison, whatever happens to --src
    old = read_tensors(a.src)
    others = {f.name: f.read_bytes() for f in a.src.iterdir() if f.is_file() and not f.name.startswith("model")}
    new = dict(old)
    for name in old:
        if name.endswith(".weight_packed"):
            scale_name = name.removesuffix("_packed") + "_scale"
            w = unpack_mxfp4(old[name], old[scale_name])
            new[name], new[scale_name] = pack_mxfp4(w)
            if not np.array_equal(unpack_mxfp4(new[name], new[scale_name]), w):
                raise SystemExit(f"{name}: the re-packed values differ from the decoded ones")

    write_checkpoint(dest, TRAINED_SPEC, lambda t: new[t.name], read_tiktoken_model(a.src / "tiktoken.model"))
    dest.chmod(0o755)
    if read_tensors(dest).keys() != old.keys():
        raise SystemExit("the written checkpoint has other tensors")
    changed = [f for f, b in others.items() if (dest / f).read_bytes() != b]
    if changed:
        raise SystemExit(f"files other than the weights changed: {changed}")

    def nibbles(x: np.ndarray) -> np.ndarray:
        return np.stack([x & 0xF, x >> 4], axis=-1)

    packed = [n for n in old if n.endswith(".weight_packed")]
    scales = [n.removesuffix("_packed") + "_scale" for n in packed]
    s_old = np.concatenate([old[n].reshape(-1) for n in scales])
    s_new = np.concatenate([new[n].reshape(-1) for n in scales])
    c_old = np.concatenate([nibbles(old[n]).reshape(-1) for n in packed])
    c_new = np.concatenate([nibbles(new[n]).reshape(-1) for n in packed])
    moved = s_old != s_new
    print(f"{len(packed)} expert matrices, values bit-identical after re-packing")
    print(f"scale bytes: {int(moved.sum()):,} of {s_old.size:,} changed"
          + (f" ({sorted(set(zip(s_old[moved].tolist(), s_new[moved].tolist())))} old -> new)" if moved.any() else ""))
    flips = c_old != c_new
    kinds = sorted({(int(o), int(n)) for o, n in zip(c_old[flips], c_new[flips])})
    print(f"codes: {int(flips.sum()):,} of {c_old.size:,} changed, (old, new) pairs {kinds}")
    print(f"wrote {dest}")
    record = {"from": "the decoded mxfp4 values of the previous checkpoint (the float weights were not kept)",
              "rule": "compressed-tensors' (tqbench.quant.mxfp4)", "expert_matrices": len(packed),
              "values_bit_identical": True, "scale_bytes": int(s_old.size), "scale_bytes_changed": int(moved.sum()),
              "codes": int(c_old.size), "codes_changed": int(flips.sum()),
              "code_changes": [{"old": o, "new": n} for o, n in kinds]}
    if a.check_windows:
        record["check"] = compare_models(keep / "old", dest, a.check_windows)
        print(f"check: {record['check']}")
    shutil.rmtree(keep, ignore_errors=True)
    if not a.no_docs:
        doc = json.loads(a.docs.read_text())
        doc.setdefault("checkpoint", {})["bytes"] = sum(f.stat().st_size for f in dest.iterdir())
        doc["checkpoint"]["repack"] = record

        a.docs.write_text(dump_json(doc))
        print(f"wrote {a.docs}")


if __name__ == "__main__":
    main()

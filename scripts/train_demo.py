#!/usr/bin/env python3
"""Train the built-in demo model: a tiny Kimi K3 (mlx-lm's kimi_k3) on the Python standard library's own source.

    python scripts/train_demo.py all            # the first demo (into build/demo-train/checkpoint), for comparison
    python scripts/train_demo.py all --spec chat    # the shipped second-generation chat demo (tqbench/demo/checkpoint)

Two recipes (`--spec`): `code` (default; `tqbench.demo.TRAINED_SPEC`, 64 experts top-4, the standard library's code
alone, exactly the first demo's run) and `chat` (`tqbench.demo.CHAT_SPEC`, 448 experts top-8, code mixed with
conversations mined from the standard library by `training.conversations`, --chat-share of the tokens; work
directory build/demo-train-chat; exported into the package and results/demo-model.json, the first demo's into its work
directory and results/demo-model-v1.json, unless --dest and --docs say otherwise). The recipe is recorded in
corpus.json by prepare; train and export refuse a different --spec.

Stages, each reading and writing files under --work (default build/demo-train):
  prepare  the corpus (the running interpreter's stdlib .py files, tests and generated data skipped, sorted), a
           train/validation split by file (a hash of the relative path), a byte-level BPE trained on the training
           split with tqbench's own trainer, written as tiktoken.model with the Kimi specials, token streams; for
           `chat` also the conversations of the training and held-out files, rendered with the chat template, and the
           training stream of code files and conversations shuffled together (val.npy stays the held-out code;
           val_chat.npy is the held-out conversations; documents.json labels every document's kind and domain)
  train    MLX training of the spec (AdamW, warmup + cosine, clipping) with auxiliary-loss-free router balancing:
           after each step every MoE layer's `e_score_correction_bias` moves by -u * sign(load - mean load) over that
           step's top-k picks (the bias gets no gradient), or, with --bias-band LO HI, only for experts whose load is
           below LO or above HI times the mean, the loads averaged over --bias-window steps; --bias-schedule,
           --bias-freeze; validation loss every --eval-every steps (also on held-out conversations for `chat`); float
           weights (fp32; for `chat` the routed experts in bf16 plus their exact mxfp4 bytes) and train.json (setup,
           curve, final perplexity). --stop-after S / --stop-at N end a call early and keep the whole training state
           in <work>/resume; `train --resume` goes on exactly where it stopped (same batches, same result).
           `train --init CHECKPOINT` starts from an exported checkpoint's weights (its mxfp4 experts dequantized, the
           bf16 rest widened to fp32) instead of random ones: a fine-tune, e.g. of the shipped demo on data
           prepared with --copy-share (the tokenizer must be the checkpoint's)
  export   the K3-layout source checkpoint through tqbench.demo's writer (routed experts mxfp4 via our packer, the rest
           bf16), checked against the float model; train.json copied into the docs JSON ("training")

Seeded: the same stdlib, seed and step count give the same data order and initialisation. The defaults are the shipped
run (583 steps of 128 x 128 tokens: about 7 minutes on one H200 with MLX CUDA, hours on a CPU); `--spec chat` changes
the defaults to its own (`CHAT_DEFAULTS`: 5,683 steps of 64 x 128 tokens, 50% chat with the stdlib's test suites as
more code, the banded balancing, the chunked KDA recurrence); flags given
on the command line win. `--steps 0 --time-budget S` instead times the first steps (inside the warmup, which does not
depend on the total) and fixes the total from them; train.json records it, and `--steps` with that number repeats the
run.

On a machine without mlx-lm (the lent GPU), prepare here and carry the work directory and a copy of mlx_lm; the
engine modules this script uses need only numpy, tiktoken and regex. A device call is limited to 10 minutes: a longer
run is several calls of `train --stop-after S` (the first) and `train --resume --stop-after S` (until it finishes), its
state kept on the warm machine between them in --resume-dir (an ignored folder that is not carried: a carried folder
is replaced on every call).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.harness import dump_json, log
from tqbench.demo import DEMO_SPECS, SHIPPED_DEMO, TRAINED_SPEC, source_config, special_ids
from tqbench.tokenizer import load_encoding, read_tiktoken_model, train_bpe, write_tokenizer
from training.corpus import corpus_files, encode_files, is_heldout, stdlib_root

ROOT = Path(__file__).resolve().parent.parent

SPEC = TRAINED_SPEC
RECORD_JSON = ROOT / "results" / "demo-model.json"  # the shipped demo's record (the second, chat demo since v4)
RECORD_V1_JSON = ROOT / "results" / "demo-model-v1.json"  # the first demo's record, kept for comparison
FLOAT_SHARD_BYTES = 12 * 2**20  # float weights are saved in pieces below this size
PACKED_FILE = "experts-mxfp4.safetensors"  # --save-experts bf16: the experts' exact mxfp4 bytes


# ---- prepare --------------------------------------------------------------------------------------------------------


def prepare(work: Path, stdlib: Path | None, a: argparse.Namespace | None = None) -> dict:
    spec_name = a.spec if a is not None else "code"
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
    np.save(work / "val.npy", val.astype(np.uint16))
    val_bytes = sum((root / f).stat().st_size for f in val_files)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.encode() + b"\0" + hashlib.sha256((root / f).read_bytes()).digest())
    corpus = {
        "spec": spec_name,
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
    if spec_name == "chat":
        code_files = list(train_files)
        if getattr(a, "code_tests", False):  # the test suites as more training code (not held out; BPE unchanged)
            from training.corpus import test_files

            tests = [f for f in test_files(root) if not is_heldout(f)]
            code_files += tests
            corpus["code_tests"] = {"files": len(tests), "bytes": sum((root / f).stat().st_size for f in tests)}
        code_docs = [np.array(enc.encode_ordinary((root / f).read_text(encoding="utf-8")) + [eos], np.uint32)
                     for f in code_files]
        if getattr(a, "code_tests", False):
            corpus["code_tests"]["tokens"] = int(sum(len(d) for d in code_docs[len(train_files):]))
        corpus["chat"], train = prepare_chat(work, root, files, enc, code_docs, code_files, a)
        if getattr(a, "tools_per_tool", 0):
            corpus["tools"] = prepare_tools(work, enc, a)
    np.save(work / "train.npy", train.astype(np.uint16))
    (work / "corpus.json").write_text(json.dumps(corpus, indent=2) + "\n")
    log(f"corpus: {len(train_files)} train files ({corpus['train']['tokens']:,} tokens), {len(val_files)} held out "
        f"({len(val):,} tokens), {corpus['bytes_per_token']} bytes/token; training stream {len(train):,} tokens")
    return corpus


def prepare_chat(work: Path, root: Path, files: list[str], enc, code_docs: list[np.ndarray], train_files: list[str],
                 a: argparse.Namespace) -> tuple[dict, np.ndarray]:
    """The conversations of the training and held-out files and the mixed training stream (code documents and
    conversations shuffled together, --chat-share of the tokens chat); writes val_chat.npy and documents.json."""
    from collections import Counter

    from training.conversations import (
        build_conversations,
        domain_of,
        encode_conversation,
        mine_stdlib,
        mix_stream,
        split_items,
    )
    from tqbench.tokenizer import CHAT_TEMPLATE

    template = json.loads((work / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    if template != CHAT_TEMPLATE:
        raise SystemExit("the tokenizer's chat template is not tqbench.tokenizer.CHAT_TEMPLATE")
    t0 = time.time()
    items = mine_stdlib(root, files, wide=a.mine == "wide", rich=a.mine == "rich")
    train_items = split_items(items)[0]
    val_items = split_items(mine_stdlib(root, files))[1]  # always the public documented set, as demo_eval asks
    code_tokens = sum(len(d) for d in code_docs)
    want = a.chat_share / (1 - a.chat_share) * code_tokens
    one = build_conversations(train_items, a.seed, passes=1, copy_share=a.copy_share)
    per_pass = sum(len(encode_conversation(enc, c.messages, template)) for c in one)
    passes = max(1, math.ceil(want / per_pass)) if want else 0
    convs = (build_conversations(train_items, a.seed, passes=passes, greetings=a.greetings, copy_share=a.copy_share)
             if passes else [])
    chat_docs = [np.array(encode_conversation(enc, c.messages, template), np.uint32) for c in convs]
    mixed = mix_stream(code_docs, chat_docs, a.chat_share, a.seed, [domain_of(f) for f in train_files],
                       [c.domain for c in convs])
    val_convs = build_conversations(val_items, a.seed, passes=1)
    val_docs = [encode_conversation(enc, c.messages, template) for c in val_convs]
    val_chat = np.array([t for d in val_docs for t in d], np.uint16)
    np.save(work / "val_chat.npy", val_chat)
    documents = {
        "train": {"starts": mixed.starts.tolist(), "kinds": mixed.kinds, "domains": mixed.domains},
        "val_chat": {"starts": np.cumsum([0] + [len(d) for d in val_docs[:-1]]).tolist(),
                     "domains": [c.domain for c in val_convs], "names": [list(c.names) for c in val_convs]},
    }
    (work / "documents.json").write_text(json.dumps(documents) + "\n")
    used = Counter(mixed.kinds)
    info = {
        "source": "ast-mined conversations about the standard library's public modules, functions, classes and "
                  "methods with docstrings (training.conversations), rendered with the chat template"
                  + ("; training also on private names and on signature-only items (no docstring: only how to "
                     "call them is asked)" if a.mine in ("wide", "rich") else "")
                  + ("; and on what modules provide, what methods classes have, what functions return and which "
                     "module defines a name (rich)" if a.mine == "rich" else ""),
        "mine": a.mine,
        "items": {"train": len(train_items), "validation": len(val_items),
                  "train_signature_only": sum(not i.doc for i in train_items),
                  "kinds": dict(Counter(i.kind for i in items).most_common())},
        "passes": passes, "greetings": a.greetings, "chat_share_target": a.chat_share, "copy_share": a.copy_share,
        "train": {"conversations_built": len(convs), "conversations_used": used["chat"],
                  "tokens_per_pass": int(per_pass), **mixed.summary()},
        "validation": {"conversations": len(val_convs), "tokens": int(len(val_chat)),
                       "top_domains": _domain_tokens(val_convs, val_docs)},
        "seconds": round(time.time() - t0, 1),
    }
    log(f"chat: {len(train_items)} training items, {len(val_items)} held out; {passes} passes -> {len(convs):,} "
        f"conversations, {used['chat']:,} used ({mixed.chat_tokens:,} tokens, {mixed.chat_share:.1%} of "
        f"{len(mixed.tokens):,}); held-out {len(val_convs)} conversations ({len(val_chat):,} tokens)")
    return info, mixed.tokens


def prepare_tools(work: Path, enc, a: argparse.Namespace) -> dict:
    """Tool-call conversations (training/tools.py) as whole sequences, not cut into the stream's windows (a
    conversation is 400-870 tokens, its tool list far from its call): tools.npz (the training tools, --tools-per-tool
    conversations each) and val_tools.npz (the held-out tools, 4 each), each with the tokens back to back, a loss
    mask per token (1 on the assistant's call and answer) and each conversation's start."""
    from tqbench.tokenizer import CHAT_TEMPLATE
    from training.tools import build, encode_tool_conversation

    info = {}
    for name, heldout, per in (("tools", False, a.tools_per_tool), ("val_tools", True, 4)):
        convs = build(a.seed, per, heldout=heldout, alias_share=0.0 if heldout else a.tool_alias_share)
        tokens, mask, starts = [], [], []
        for c in convs:
            ids, m = encode_tool_conversation(enc, c, CHAT_TEMPLATE)
            starts.append(len(tokens))
            tokens += ids
            mask += m
        np.savez(work / f"{name}.npz", tokens=np.array(tokens, np.uint16), mask=np.array(mask, np.uint8),
                 starts=np.array(starts, np.int64))
        lengths = np.diff(starts + [len(tokens)])
        info[name] = {"conversations": len(convs), "tools": len({c.tool for c in convs}), "tokens": len(tokens),
                      "trained_tokens": int(sum(mask)), "longest": int(lengths.max()),
                      "median": int(np.median(lengths))}
    log(f"tools: {info['tools']['conversations']:,} conversations of {info['tools']['tools']} tools "
        f"({info['tools']['tokens']:,} tokens, {info['tools']['trained_tokens']:,} trained), held out "
        f"{info['val_tools']['conversations']} of {info['val_tools']['tools']} tools")
    return info


def load_tools(path: Path):
    """(tokens, mask, starts, lengths) of a tools.npz, or None when it is not there."""
    if not path.is_file():
        return None
    d = np.load(path)
    starts = d["starts"]
    return d["tokens"].astype(np.int32), d["mask"], starts, np.diff(np.append(starts, len(d["tokens"])))


def tool_batch(tools, pick: np.ndarray, pad: int, width_step: int = 128):
    """Whole tool conversations as one batch: inputs padded with `pad`, targets -1 where the loss is masked (the
    prompt's tokens, the padding). The width is rounded up to a multiple of `width_step`: on CUDA every new shape
    costs MLX kernel compiles, and conversations of 380-990 tokens would otherwise give almost every batch its own. The
    padding is computed but masked (about a tenth more tokens a tool batch); causal attention and KDA's recurrence keep
    it from the rows' own positions."""
    tokens, mask, starts, lengths = tools
    width = -(-(int(lengths[pick].max()) - 1) // width_step) * width_step
    x = np.full((len(pick), width), pad, np.int32)
    y = np.full((len(pick), width), -1, np.int32)
    for row, c in enumerate(pick):
        t = tokens[starts[c]:starts[c] + lengths[c]]
        m = mask[starts[c]:starts[c] + lengths[c]]
        x[row, :len(t) - 1] = t[:-1]
        y[row, :len(t) - 1] = np.where(m[1:] == 1, t[1:], -1)
    return x, y


def _domain_tokens(convs, docs, top: int = 20) -> dict:
    from collections import Counter

    c: Counter[str] = Counter()
    for conv, d in zip(convs, docs):
        c[conv.domain] += len(d)
    return dict(c.most_common(top))


# ---- model ----------------------------------------------------------------------------------------------------------


def build_model(seed: int, spec=None):
    import mlx.core as mx
    from mlx_lm.models import kimi_k3

    mx.random.seed(seed)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(source_config(spec or SPEC)))
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


def save_float(model, work: Path, experts: str = "float32") -> list[str]:
    """The parameters in safetensors pieces of < 12 MiB (so they can travel back from the GPU machine), fp32; with
    `experts` "bf16" the routed experts' weights are kept in bf16 there and, packed from their fp32 values, as the
    exact mxfp4 bytes the checkpoint gets in experts-mxfp4.safetensors (the chat demo's fp32 experts alone are 77 MB,
    more than a device call brings back)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tqbench.quant.mxfp4 import pack_mxfp4

    params = dict(tree_flatten(model.parameters()))
    for old in [*work.glob("float-*.safetensors"), work / PACKED_FILE]:
        old.unlink(missing_ok=True)
    names = []
    if experts == "bf16":
        packed = {}
        for k, v in params.items():
            if ".switch_mlp." in k:
                codes, scales = pack_mxfp4(np.array(v.astype(mx.float32)))
                packed[k + ".packed"], packed[k + ".scales"] = mx.array(codes), mx.array(scales)
                params[k] = v.astype(mx.bfloat16)
        mx.save_safetensors(str(work / PACKED_FILE), packed)
        names.append(PACKED_FILE)
    pieces, cur, size = [], {}, 0
    for k, v in params.items():
        if cur and size + v.nbytes > FLOAT_SHARD_BYTES:
            pieces.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.nbytes
    pieces.append(cur)
    for i, piece in enumerate(pieces):
        name = f"float-{i:02d}.safetensors"
        mx.save_safetensors(str(work / name), piece)
        names.append(name)
    return names


def load_float(work: Path) -> dict:
    """The saved parameters (mx arrays; routed experts in bf16 when they were saved so)."""
    import mlx.core as mx

    params = {}
    for f in sorted(work.glob("float-*.safetensors")):
        params.update(mx.load(str(f)))
    if not params:
        raise SystemExit(f"no float-*.safetensors in {work}: run the train stage first")
    return params


def load_packed(work: Path) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """The routed experts' mxfp4 bytes packed from their fp32 values at the end of training, if saved so:
    {parameter name: (codes, scales)}."""
    import mlx.core as mx

    f = work / PACKED_FILE
    if not f.is_file():
        return None
    raw = mx.load(str(f))
    return {k.removesuffix(".packed"): (np.array(v), np.array(raw[k.removesuffix(".packed") + ".scales"]))
            for k, v in raw.items() if k.endswith(".packed")}


def checkpoint_params(ckpt: Path) -> dict:
    """An exported checkpoint's parameters as mlx-lm loads them, in float32: the routed experts' mxfp4 codes
    dequantized (their scales dropped), the rest (bf16, a few float32) widened."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    loaded, _ = load_model(ckpt)
    got = dict(tree_flatten(loaded.parameters()))
    quantized = {k.removesuffix("weight") for k, w in got.items() if w.dtype == mx.uint32}  # mxfp4 codes + scales
    out = {}
    for k, w in got.items():
        if k.removesuffix("scales") in quantized:
            continue
        if k.removesuffix("weight") in quantized:
            w = mx.dequantize(w, got[k.removesuffix("weight") + "scales"], None, group_size=32, bits=4, mode="mxfp4",
                              dtype=mx.float32)
        out[k] = w.astype(mx.float32)
    return out


def load_init(model, ckpt: Path, work: Path) -> int:
    """Start training from an exported checkpoint's weights (`train --init`, a fine-tune: `checkpoint_params`).
    Refuses a checkpoint of another tokenizer or shape. Returns the number of tensors loaded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tok = ckpt / "tiktoken.model"
    if not tok.is_file():
        raise SystemExit(f"--init {ckpt}: no tiktoken.model there (not an exported demo checkpoint)")
    if tok.read_bytes() != (work / "tokenizer" / "tiktoken.model").read_bytes():
        raise SystemExit(f"--init {ckpt}: its tokenizer is not the one {work} was prepared with")
    try:
        got = checkpoint_params(ckpt)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--init {ckpt}: mlx-lm cannot load it ({e})") from None
    params = {}
    for k, v in tree_flatten(model.parameters()):
        w = got.get(k)
        if w is None:
            raise SystemExit(f"--init {ckpt}: no tensor {k}")
        if w.shape != v.shape:
            raise SystemExit(f"--init {ckpt}: {k} is {tuple(w.shape)}, the spec's {tuple(v.shape)}")
        params[k] = w
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return len(params)


# ---- train ----------------------------------------------------------------------------------------------------------

RESUME_KEYS = ("spec", "seed", "batch", "seq_len", "lr", "warmup", "final_lr_frac", "bias_lr", "bias_schedule",
               "bias_band", "bias_window", "bias_freeze", "router_lr_mult", "weight_decay", "clip", "eval_every", "kda",
               "kda_chunk", "optimizer", "init", "tool_share", "tool_batch")


def save_resume(d: Path, model, optimizer, rng, ema, i: int, total: int, curve: list, best: dict, run_loss: float,
                run_n: int, loads_acc: np.ndarray, elapsed: float, a: argparse.Namespace) -> None:
    """Everything the training loop holds after step `i`: parameters, optimizer state, the data generator's state,
    the balancing average, the curve, the best evaluation, the running sums (a device call is limited in time)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "params.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(d / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    extra = {"ema": ema, "loads_acc": mx.array(loads_acc.astype(np.float32))}
    if best["params"] is not None and best["step"] != i:
        extra.update({"best." + k: v for k, v in best["params"].items()})
    mx.save_safetensors(str(d / "extra.safetensors"), extra)
    state = {"step": i, "total": total, "rng": rng.bit_generator.state, "curve": curve,
             "best": {"val_loss": best["val_loss"], "step": best["step"]}, "run_loss": run_loss, "run_n": run_n,
             "elapsed_s": elapsed, "args": {k: getattr(a, k) for k in RESUME_KEYS}}
    (d / "state.json").write_text(json.dumps(state) + "\n")


def load_resume(d: Path, model, optimizer, rng, a: argparse.Namespace):
    """The inverse of `save_resume` into a freshly built model and optimizer; refuses a state of other settings."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    if not (d / "state.json").is_file():
        raise SystemExit(f"no training state in {d} to resume")
    state = json.loads((d / "state.json").read_text())
    args = {k: getattr(a, k) for k in RESUME_KEYS}
    state["args"].setdefault("init", None)  # (states kept before --init existed)
    if json.loads(json.dumps(args)) != state["args"]:
        raise SystemExit(f"--resume with other settings than the stopped run: {state['args']} vs {args}")
    if a.steps is not None and a.steps != state["total"]:
        raise SystemExit(f"--resume of a run of {state['total']} steps with --steps {a.steps}")
    model.load_weights(list(mx.load(str(d / "params.safetensors")).items()))
    reset_attn_res_cache(model)
    optimizer.init(model.trainable_parameters())
    saved = mx.load(str(d / "optimizer.safetensors"))
    optimizer.state = tree_map_with_path(lambda path, _: saved[path], optimizer.state)
    extra = mx.load(str(d / "extra.safetensors"))
    rng.bit_generator.state = state["rng"]
    best = {"val_loss": state["best"]["val_loss"], "step": state["best"]["step"], "params": None}
    if best["step"] == state["step"]:
        best["params"] = dict(mx.load(str(d / "params.safetensors")))
    elif best["step"]:
        best["params"] = {k.removeprefix("best."): v for k, v in extra.items() if k.startswith("best.")}
    return (state["step"], state["total"], state["curve"], best, state["run_loss"], state["run_n"],
            np.array(extra["loads_acc"]).astype(np.float64), extra["ema"], state["elapsed_s"])




def training_step(model, moes: list, a: argparse.Namespace):
    """The demo's training step (also timed by benchmarks/train_step.py): step(x, y, u, ema) -> (loss, grad norm, each
    MoE layer's top-k counts per expert, the loads the balancing rule saw); the optimizer (AdamW, the router at
    --router-lr-mult; --optimizer flat: the same on one vector) and set_lr(lr), which sets every group's learning
    rate. `--compile` compiles the step."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from training.flat_adamw import FlatAdamW
    from training.modelstats import capture_routing

    E = moes[0].e_score_correction_bias.shape[-1]
    band = tuple(float(v) for v in a.bias_band)
    ema_decay = 1.0 - 1.0 / a.bias_window if a.bias_window > 1 else 0.0
    first_rule = band == (1.0, 1.0) and not ema_decay  # the first demo's balancing, as it ran

    masked = getattr(a, "tool_share", 0) > 0  # tool batches mark the tokens without loss with target -1

    def loss_fn(model, x, y):
        with capture_routing(model) as picks:
            logits = model(x)
        if masked:
            keep = y >= 0
            per_token = nn.losses.cross_entropy(logits.astype(mx.float32), mx.maximum(y, 0), reduction="none")
            loss = (per_token * keep).sum() / mx.maximum(keep.sum(), 1)
        else:
            loss = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
        counts = mx.stack([mx.zeros(E, dtype=mx.int32).at[p.reshape(-1)].add(1) for p in picks])  # [moe layers, E]
        return loss, counts

    decay = lambda path, p: p.ndim >= 2 and "norm" not in path  # noqa: E731  (matrices only; not norms, A_log, biases)
    router = lambda path, p: path.endswith("mlp.gate.weight")  # noqa: E731
    flat = a.optimizer == "flat"
    if flat:  # the same AdamW on one vector: a few kernels a step instead of ~20 per parameter
        optimizer = FlatAdamW(0.0, [(router, a.router_lr_mult, 0.0), (decay, 1.0, a.weight_decay)],
                              default=(1.0, 0.0), betas=(0.9, 0.95), eps=1e-8)
        lr_mults = [1.0]
        groups = [optimizer]
    else:
        adamw = lambda wd: optim.AdamW(learning_rate=0.0, betas=[0.9, 0.95], eps=1e-8, weight_decay=wd)  # noqa: E731
        optimizer = optim.MultiOptimizer([adamw(0.0), adamw(a.weight_decay), adamw(0.0)], [router, decay])
        lr_mults = [a.router_lr_mult, 1.0, 1.0]
        groups = optimizer.optimizers

    def set_lr(lr: float) -> None:
        for o, mult in zip(groups, lr_mults):
            o.learning_rate = lr * mult

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(x, y, u, ema):
        (loss, counts), grads = loss_and_grad(model, x, y)
        if flat:
            gnorm = optimizer.clip_and_update(model, grads, a.clip)
        else:
            grads, gnorm = optim.clip_grad_norm(grads, a.clip)
            optimizer.update(model, grads)
        loads = counts.astype(mx.float32)
        if ema_decay:  # the loads the rule sees: an average over about --bias-window steps (a larger balancing batch)
            loads = ema_decay * ema + (1 - ema_decay) * loads
        for moe, c in zip(moes, loads):  # auxiliary-loss-free balancing (DeepSeek-V3; K3's router bias)
            if first_rule:  # every expert moves every step
                moe.e_score_correction_bias = moe.e_score_correction_bias - u * mx.sign(c - c.mean())
            else:  # only experts outside [lo, hi] x mean move: skew inside the band is left to the router
                rel = c / c.mean()
                push = mx.where(rel > band[1], -1.0, mx.where(rel < band[0], 1.0, 0.0))
                moe.e_score_correction_bias = moe.e_score_correction_bias + u * push
        return loss, gnorm, counts, loads

    if a.compile:
        state = [model.state, optimizer.state]
        step = mx.compile(step, inputs=state, outputs=state)
    return step, optimizer, set_lr


def set_cache_limit(gb: float) -> int | None:
    """Caps MLX's buffer cache at `gb` GiB (0: MLX's own default, nothing set); the bytes set. On CUDA, tool batches of
    whole conversations of changing widths leave freed buffers of many sizes cached; on an H100 tool batches of 6
    trained with the cache capped at 16 GiB, where batches of 8 ran out of memory (docs/gpu.md)."""
    import mlx.core as mx

    if gb <= 0:
        return None
    limit = int(gb * 2**30)
    mx.set_cache_limit(limit)
    return limit


def train(work: Path, a: argparse.Namespace) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from training.modelstats import experts_covering, perplexity, windows

    set_cache_limit(a.cache_limit_gb)
    train_ids = np.load(work / "train.npy").astype(np.int32)
    val_ids = np.load(work / "val.npy").astype(np.int32)
    chat_file = work / "val_chat.npy"
    val_chat = np.load(chat_file).astype(np.int32) if chat_file.is_file() else None
    corpus_info = json.loads((work / "corpus.json").read_text())
    chat_share = corpus_info.get("chat", {}).get("train", {}).get("chat_share", 0.0) if val_chat is not None else 0.0
    T, B, E = a.seq_len, a.batch, SPEC.num_experts
    band = tuple(float(v) for v in a.bias_band)
    ema_decay = 1.0 - 1.0 / a.bias_window if a.bias_window > 1 else 0.0
    first_rule = band == (1.0, 1.0) and not ema_decay  # the first demo's balancing, as it ran
    model = build_model(a.seed)
    if a.init and not a.resume:  # (a resumed run's weights come from its state)
        log(f"starting from {a.init}'s weights ({load_init(model, Path(a.init), work)} tensors)")
    moes = moe_layers(model)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"device {mx.default_device()}, {n_params:,} parameters, {len(moes)} MoE layers, batch {B} x {T}")

    step, optimizer, set_lr = training_step(model, moes, a)

    def lr_at(i: int, total: int | None) -> float:
        """Linear warmup, then cosine decay to final_lr_frac * lr (the warmup does not depend on the total)."""
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        t = min(1.0, (i - a.warmup) / max(total - a.warmup, 1))
        return a.lr * (a.final_lr_frac + (1 - a.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    rng = np.random.default_rng(a.seed)
    starts_max = len(train_ids) - T - 1

    tools = load_tools(work / "tools.npz") if a.tool_share > 0 else None
    val_tools = load_tools(work / "val_tools.npz") if tools is not None else None
    if a.tool_share > 0 and tools is None:
        raise SystemExit(f"--tool-share: no tools.npz in {work} (prepare it with --tools-per-tool N)")
    eos = special_ids(SPEC)["eos_token_id"]
    per_tool_batch = a.tool_batch or max(1, B * T // 1024)  # about a stream batch's tokens

    def batch():
        if tools is not None and rng.random() < a.tool_share:  # whole tool conversations, the prompt masked
            x, y = tool_batch(tools, rng.integers(0, len(tools[2]), per_tool_batch), eos)
            return mx.array(x), mx.array(y)
        s = rng.integers(0, starts_max, B)
        w = train_ids[s[:, None] + np.arange(T + 1)]
        return mx.array(w[:, :-1]), mx.array(w[:, 1:])

    def tool_loss():
        """The masked loss on the held-out tools' conversations (the assistant's calls and answers)."""
        import mlx.nn as nn

        reset_attn_res_cache(model)
        model.eval()
        total, count = 0.0, 0
        for i in range(0, len(val_tools[2]), 4):
            x, y = tool_batch(val_tools, np.arange(i, min(i + 4, len(val_tools[2]))), eos)
            logits = model(mx.array(x)).astype(mx.float32)
            yy = mx.array(y)
            keep = yy >= 0
            total += float((nn.losses.cross_entropy(logits, mx.maximum(yy, 0), reduction="none") * keep).sum())
            count += int(keep.sum())
        model.train()
        return total / max(count, 1)

    def eval_subset(ids):
        ex, ey = windows(ids, T)
        pick = np.linspace(0, len(ex) - 1, min(a.eval_windows, len(ex))).round().astype(int)
        return np.concatenate([np.concatenate([ex[i], ey[i][-1:]]) for i in pick])  # windows back to back

    eval_tokens = eval_subset(val_ids)
    eval_chat = eval_subset(val_chat) if val_chat is not None else None

    def evaluate(tokens=None):
        reset_attn_res_cache(model)
        model.eval()
        r = perplexity(model, val_ids if tokens is None else tokens, window=T, batch=a.eval_batch)
        model.train()
        return r

    if a.steps is None and a.probe_steps + 5 >= a.warmup:
        raise SystemExit("--time-budget needs --probe-steps + 5 < --warmup (the total is fixed inside the warmup)")
    max_steps = min(a.max_steps, int(a.max_epochs * len(train_ids) / (B * T)))
    total = a.steps
    best = {"val_loss": math.inf, "step": 0, "params": None}
    curve, t_start, t_probe = [], time.time(), None
    def selection_loss(val, chat):  # what picks the kept weights: the held-out mix, weighted as the training stream
        return val["loss"] if chat is None else (1 - chat_share) * val["loss"] + chat_share * chat["loss"]

    resume_dir, t_call = a.resume_dir or work / "resume", time.time()
    if a.resume:  # the state a --stop-after/--stop-at call left: the run continues as if never stopped
        i, total, curve, best, run_loss, run_n, loads_acc, ema, elapsed = load_resume(resume_dir, model, optimizer,
                                                                                     rng, a)
        t_start = time.time() - elapsed
        log(f"resumed at step {i} of {total} ({elapsed:.0f} s of training before)")
    else:
        val0 = evaluate(tokens=eval_tokens)  # also sets kimi_k3's AttnRes caches, so the compiled step traces once
        curve.append({"step": 0, "tokens": 0, "val_loss": round(val0["loss"], 4)})
        if eval_chat is not None:
            curve[0]["val_chat_loss"] = round(evaluate(tokens=eval_chat)["loss"], 4)
        if val_tools is not None:
            curve[0]["val_tools_loss"] = round(tool_loss(), 4)
        log(f"step 0: {curve[0]}")
        run_loss, run_n, loads_acc = 0.0, 0, np.zeros((len(moes), E))
        ema = mx.zeros((len(moes), E))
        i = 0
    first = i
    while True:
        if total is None and i == a.probe_steps + 5:  # fix the step count from the timed steps (inside the warmup)
            per_step = (time.time() - t_probe) / a.probe_steps
            remaining = a.time_budget - (time.time() - t_start) - a.reserve
            total = int(min(max_steps, i + max(remaining, 0) / (per_step * (1 + a.eval_overhead))))
            total = max(total, a.warmup + 10)
            log(f"{per_step * 1000:.0f} ms/step -> {total} steps in the time budget")
        if total is not None and i >= total:
            break
        if total is not None and i > first and ((a.stop_after and time.time() - t_call >= a.stop_after)
                                                or (a.stop_at and i >= a.stop_at)):
            save_resume(resume_dir, model, optimizer, rng, ema, i, total, curve, best, run_loss, run_n, loads_acc,
                        time.time() - t_start, a)
            log(f"stopped at step {i} of {total}: the state is in {resume_dir}; run train --resume to go on")
            return None
        if i == 5:
            mx.eval(model.parameters())
            t_probe = time.time()
        x, y = batch()
        lr = lr_at(i, total)
        set_lr(lr)
        # The bias speed follows the learning rate (--bias-schedule lr): the router's scores drift as fast as the lr
        # lets them; constant: always --bias-lr; no move at all from --bias-freeze x the steps on.
        u = a.bias_lr * lr / a.lr if a.bias_schedule == "lr" else a.bias_lr
        if total is not None and i >= a.bias_freeze * total:
            u = 0.0
        loss, gnorm, counts, ema = step(x, y, mx.array(u), ema)
        mx.eval(loss, gnorm, counts, ema, model.parameters(), optimizer.state)
        run_loss += loss.item()
        run_n += 1
        loads_acc += np.array(counts)
        i += 1
        if i % a.eval_every == 0 or i == total or i == 1:
            val = evaluate(tokens=eval_tokens)
            chat = evaluate(tokens=eval_chat) if eval_chat is not None else None
            lr_now = lr_at(i - 1, total)
            share = loads_acc / loads_acc.sum(axis=1, keepdims=True)
            biases = np.stack([np.array(m.e_score_correction_bias) for m in moes])
            entry = {
                "step": i,
                "tokens": i * B * T,
                "train_loss": round(run_loss / run_n, 4),
                "val_loss": round(val["loss"], 4),
                **({"val_chat_loss": round(chat["loss"], 4)} if chat is not None else {}),
                **({"val_tools_loss": round(tool_loss(), 4)} if val_tools is not None else {}),
                "lr": float(f"{lr_now:.3g}"),
                "grad_norm": round(gnorm.item(), 3),
                "load_max_over_mean": round(float((share.max(axis=1) * E).max()), 3),
                "load_min_over_mean": round(float((share.min(axis=1) * E).min()), 3),
                "bias_range": [round(float(biases.min()), 4), round(float(biases.max()), 4)],
                "experts_for_50pct": round(float(np.mean([experts_covering(c, 0.5) for c in loads_acc])), 1),
                "idle_experts": int((loads_acc == 0).sum()),
                "elapsed_s": round(time.time() - t_start, 1),
            }
            curve.append(entry)
            log(" ".join(f"{k}={v}" for k, v in entry.items()))
            if a.keep_every and i % a.keep_every == 0 and i != total:  # candidates to choose from afterwards
                (work / f"step-{i:05d}").mkdir(exist_ok=True)
                save_float(model, work / f"step-{i:05d}", a.save_experts)
            if selection_loss(val, chat) < best["val_loss"]:  # arrays are immutable: the references keep this state
                best.update(val_loss=selection_loss(val, chat), step=i, params=dict(tree_flatten(model.parameters())))
            run_loss, run_n, loads_acc = 0.0, 0, np.zeros((len(moes), E))
    train_s = time.time() - t_start
    if a.save_final and best["step"] != total:  # the last step's weights too, to compare with the kept ones
        (work / "final").mkdir(exist_ok=True)
        save_float(model, work / "final", a.save_experts)
        log(f"saved step {total}'s weights in {work / 'final'}")
    if best["step"] != total:
        log(f"keeping step {best['step']} (best validation subset loss {best['val_loss']:.4f})")
        model.load_weights(list(best["params"].items()))

    final = evaluate(tokens=val_ids[: a.final_windows * T + 1] if a.final_windows else None)
    log(f"final held-out: loss {final['loss']:.4f}, perplexity {final['perplexity']:.3f} over {final['tokens']:,} "
        "tokens")
    final_chat = evaluate(tokens=val_chat[: a.final_windows * T + 1] if a.final_windows else val_chat) \
        if val_chat is not None else None
    if final_chat is not None:
        log(f"final held-out conversations: loss {final_chat['loss']:.4f}, perplexity {final_chat['perplexity']:.3f}")
    pieces = save_float(model, work, a.save_experts)
    shutil.rmtree(resume_dir, ignore_errors=True)  # a finished run leaves no state to resume
    corpus = corpus_info
    result = {
        "spec": corpus.get("spec", "code"),
        "model": {**{k: v for k, v in asdict(SPEC).items()}, "parameters": int(n_params),
                  "vocab_size": SPEC.vocab_size, "mla_layers": SPEC.full_attn_layers},
        "setup": {
            "seed": a.seed, "init": a.init, "steps": total, "kept_step": best["step"], "batch": B, "seq_len": T,
            "tokens_seen": total * B * T,
            "epochs": round(total * B * T / len(train_ids), 2),  # passes over the training stream (code + chat)
            "optimizer": f"AdamW(betas 0.9/0.95, weight decay {a.weight_decay} on matrices)"
                         + (", on one flat vector (--optimizer flat)" if a.optimizer == "flat" else ""),
            "router_lr": f"{a.router_lr_mult} x lr (no weight decay)",
            "kept": "the weights of the evaluation with the lowest validation-subset loss",
            "lr": {"peak": a.lr, "warmup_steps": a.warmup, "schedule": "linear warmup, cosine decay",
                   "final": round(a.lr * a.final_lr_frac, 10)},
            "grad_clip": a.clip, "dtype": "float32",
            "balancing": {"rule": "bias -= u * sign(load - mean load) per MoE layer after every step, from that "
                                  "step's top-k picks" if first_rule else
                                  f"bias += u for experts below {band[0]} x mean load, -= u above {band[1]} x mean "
                                  "load (strictly), per MoE layer after every step, the loads an exponential average "
                                  "of the steps' top-k picks over --bias-window steps (1: that step's)",
                          "u_peak": a.bias_lr,
                          "u_schedule": "u = u_peak * lr / peak lr" if a.bias_schedule == "lr" else "constant",
                          "band": list(band), "window_steps": a.bias_window,
                          "frozen_from_step": math.ceil(a.bias_freeze * total) if a.bias_freeze < 1 else None},
            "tools": {"share_of_steps": a.tool_share, "conversations_per_batch": per_tool_batch,
                      "loss": "the assistant's tool calls and answers only"} if tools is not None else None,
            "compiled": a.compile, "cache_limit_gb": a.cache_limit_gb or None,
            "kda": a.kda, "kda_chunk": a.kda_chunk if a.kda == "chunked" else None,
            "time_budget_s": a.time_budget if a.steps is None else None,
            "device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
            "train_seconds": round(train_s, 1), "tokens_per_second": round(total * B * T / train_s),
        },
        "corpus": {k: v for k, v in corpus.items() if k != "validation_files"},
        "curve": curve,
        "final_float": {k: (round(v, 5) if isinstance(v, float) else v) for k, v in final.items()},
        **({"final_float_chat": {k: (round(v, 5) if isinstance(v, float) else v) for k, v in final_chat.items()}}
           if final_chat is not None else {}),
        "float_weights": pieces,
    }
    (work / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---- export ---------------------------------------------------------------------------------------------------------


def export(work: Path, dest: Path, check: bool = True, weights: Path | None = None) -> dict:
    """Write the checkpoint of the work folder's kept weights, or of `weights` (a folder the run saved: a
    --keep-every step or --save-final's `final`); the tokenizer is the work folder's."""
    import mlx.core as mx

    from tqbench.demo import mlx_weights, write_checkpoint
    from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4

    src = weights or work
    params = {k: np.array(v.astype(mx.float32)) for k, v in load_float(src).items()}
    packed = load_packed(src)  # the experts' mxfp4 bytes from their fp32 values, when they were saved in bf16
    ranks = read_tiktoken_model(work / "tokenizer" / "tiktoken.model")
    write_checkpoint(dest, SPEC, mlx_weights(SPEC, params, packed), ranks)
    dest.chmod(0o755)  # a package folder: readable by all, as the files are
    size = sum(f.stat().st_size for f in dest.iterdir())
    log(f"wrote {dest} ({size / 1e6:.2f} MB)")
    out = {"path": str(dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest), "bytes": size}
    if weights is not None:
        out["weights"] = weights.name  # which of the run's saved weights, when not the kept ones

    if check:  # mlx-lm loads exactly the float weights rounded to bf16, the experts through our mxfp4 packer
        from tqbench.shards.writer import from_bf16, to_bf16

        got = checkpoint_params(dest)
        for k, v in params.items():
            if ".switch_mlp." in k:
                want = unpack_mxfp4(*(packed[k] if packed else pack_mxfp4(v)))
            elif k.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
                want = v
            else:
                want = from_bf16(to_bf16(v))
            if not np.array_equal(np.array(got[k]), want):
                raise SystemExit(f"the exported checkpoint does not reproduce {k}")
        log(f"check: mlx-lm loads all {len(params)} tensors exactly (bf16 rounding, mxfp4 experts)")
        out["check"] = {"tensors_exact": len(params)}
    return out


def write_docs_training(work: Path, exported: dict | None, docs: Path = RECORD_JSON) -> None:
    """Write the run's training record into `docs`. A `lineage` (the runs a fine-tune started from, added to the
    record by hand) is kept when the record written is the same run's, so exporting again does not lose it."""
    doc = json.loads(docs.read_text()) if docs.exists() else {}
    doc["schema"] = "tqbench.demo-model/1"
    training = json.loads((work / "train.json").read_text())
    old = doc.get("training") or {}
    if "lineage" in old and "lineage" not in training and {k: v for k, v in old.items() if k != "lineage"} == training:
        training["lineage"] = old["lineage"]
    doc["training"] = training
    if exported:
        doc["checkpoint"] = exported
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(dump_json(doc))
    log(f"wrote {docs}")


# ---- command line ---------------------------------------------------------------------------------------------------


# What --spec sets when the flag is not given. code: the shipped first demo's run. chat: the second demo; see
# docs/demo-model.md for the choices (1,000 steps of 64 x 128 tokens: the routed rows per step, 64 x 128 x 8, equal the
# first run's 128 x 128 x 4, the size MLX CUDA is known to run; about 0.8-1.0 s a step on an H200, launch-bound like the
# first; 0.55 s measured). Balancing: experts between a quarter and four times their share of a step's routings are
# left alone (the sign rule only outside [0.25, 4] x mean), so the router may skew without collapse; in 100-step CPU
# trials this kept every expert in use where a window-averaged load left up to 2% idle (docs/demo-model.md). Data
# (v5): the wide item set (private names, signature-only items) at 50% chat; v4 was --mine public --chat-share 0.4
# --bias-band 0.5 2. v6: the stdlib's test suites as more code (--code-tests, a 16.5 M-token stream) and the chunked
# KDA recurrence (0.15 s a step on the H200), 5,683 steps (what --steps 0 --time-budget 1050 fixed there); v5 was
# --no-code-tests --kda loop --steps 1000.
CODE_DEFAULTS = {"work": ROOT / "build" / "demo-train", "dest": None, "docs": RECORD_V1_JSON, "steps": 583,
                 "save_experts": "float32",
                 "batch": 128, "bias_lr": 1e-2, "bias_schedule": "lr", "bias_band": [1.0, 1.0], "bias_window": 1,
                 "bias_freeze": 1.0, "chat_share": 0.0, "greetings": 0, "mine": "public", "code_tests": False,
                 "kda": "loop"}
CHAT_DEFAULTS = {"work": ROOT / "build" / "demo-train-chat", "dest": SHIPPED_DEMO, "docs": RECORD_JSON, "steps": 5683,
                 "batch": 64,
                 "save_experts": "bf16",
                 "bias_lr": 1e-2, "bias_schedule": "lr", "bias_band": [0.25, 4.0], "bias_window": 1,
                 "bias_freeze": 1.0, "chat_share": 0.5, "greetings": 400, "mine": "wide", "code_tests": True,
                 "kda": "chunked"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["prepare", "train", "export", "all"])
    p.add_argument("--spec", choices=sorted(DEMO_SPECS), default="code",
                   help="code: the first demo (TRAINED_SPEC, code only); chat: the second (CHAT_SPEC, code + chat)")
    p.add_argument("--work", type=Path, default=None, help="default: build/demo-train (code), build/demo-train-chat")
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib directory (default: the running interpreter's)")
    p.add_argument("--dest", type=Path, default=None,
                   help="default: tqbench/demo/checkpoint (chat), <work>/checkpoint (code)")
    p.add_argument("--docs", type=Path, default=None,
                   help="the JSON document whose \"training\" is written (default: results/demo-model.json (chat), "
                        "results/demo-model-v1.json (code))")
    p.add_argument("--weights", type=Path, default=None,
                   help="export: a folder of saved weights inside --work (step-NNNNN, final) instead of the kept ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None,
                   help="583 (code), 1000 (chat); 0: fix the step count from --time-budget instead")
    p.add_argument("--time-budget", type=float, default=520.0, help="seconds, with --steps 0")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--max-epochs", type=float, default=8.0, help="caps the steps at this many passes over the data")
    p.add_argument("--reserve", type=float, default=40.0, help="seconds kept for the final evaluation and saving")
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--eval-overhead", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=None, help="sequences per step: 128 (code), 64 (chat)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--final-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--router-lr-mult", type=float, default=0.1, help="the router's learning rate relative to the rest")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-lr", type=float, default=None,
                   help="u of the balancing rule (at the peak learning rate with --bias-schedule lr): 1e-2")
    p.add_argument("--bias-schedule", choices=["lr", "constant"], default=None,
                   help="lr: u follows the learning rate (both recipes); constant: u throughout")
    p.add_argument("--bias-band", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                   help="move only the biases of experts with a load below LO or above HI times the mean: 1 1 (code: "
                        "every expert every step), 0.5 2 (chat)")
    p.add_argument("--bias-window", type=int, default=None,
                   help="steps the balanced loads are averaged over (exponentially; both recipes 1: that step's "
                        "loads; longer windows delayed the correction and left experts idle in CPU trials)")
    p.add_argument("--bias-freeze", type=float, default=None,
                   help="stop moving the biases from this fraction of the steps on (DeepSeek-V3 stops for its last "
                        "3%%): 1 (never, both recipes)")
    p.add_argument("--chat-share", type=float, default=None,
                   help="prepare: the share of conversation tokens (chat: 0.5)")
    p.add_argument("--greetings", type=int, default=None, help="prepare: small-talk conversations (chat: 400)")
    p.add_argument("--copy-share", type=float, default=0.0,
                   help="prepare (chat): the share of training sessions asked under a made-up module path, so the "
                        "answer's name must be copied from the question (training.conversations.renamed; every "
                        "shipped demo: 0)")
    p.add_argument("--code-tests", action=argparse.BooleanOptionalAction, default=None,
                   help="prepare (chat): also train on the standard library's test suites (about 5 M more code "
                        "tokens; never held out, the BPE and the held-out split unchanged; chat: on since v6)")
    p.add_argument("--mine", choices=["public", "wide", "rich"], default=None,
                   help="prepare: the training conversations' items: public (documented public names, the v4 demo), "
                        "wide (also private names and signature-only items; chat since v5) or rich (wide, plus "
                        "training-only questions with new answers: what a module provides, what methods a class has, "
                        "what a function returns, which module defines a name)")
    p.add_argument("--tools-per-tool", type=int, default=0,
                   help="prepare: tool-call conversations per training tool (training/tools.py), kept whole in "
                        "tools.npz; the held-out tools' in val_tools.npz")
    p.add_argument("--tool-alias-share", type=float, default=0.0,
                   help="prepare: the share of training tool conversations whose tools are renamed (made-up function "
                        "and parameter names), so that names are copied, not learned by heart")
    p.add_argument("--tool-share", type=float, default=0.0,
                   help="train: the share of steps whose batch is whole tool conversations (loss on the assistant's "
                        "calls and answers only); their held-out loss joins the curve")
    p.add_argument("--tool-batch", type=int, default=0,
                   help="train: conversations per tool batch (0: about a stream batch's tokens, batch x seq-len / 1024)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-final", action="store_true",
                   help="also save the last step's weights in <work>/final when an earlier step is kept")
    p.add_argument("--keep-every", type=int, default=0,
                   help="also save the weights every N steps (a multiple of --eval-every) in <work>/step-NNNNN, to "
                        "choose between afterwards (scripts/demo_eval.py --docstring-items selection); each save "
                        "takes seconds that --time-budget does not plan for")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--final-windows", type=int, default=0,
                   help="windows of the final held-out evaluation (0: the whole split; fewer for a smoke run)")
    p.add_argument("--kda", choices=["loop", "chunked"], default=None,
                   help="train: KDA's recurrence as mlx-lm's per-time-step loop (code; chat up to v5) or tqbench's "
                        "chunked form (training.delta: the same values; 3.7x faster steps on the H200; chat)")
    p.add_argument("--kda-chunk", type=int, default=16,
                   help="time steps per chunk of the chunked KDA recurrence (a power of two; the same values up to "
                        "rounding: larger chunks mean fewer, larger operations, 16 for every shipped demo)")
    p.add_argument("--optimizer", choices=["mlx", "flat"], default="mlx",
                   help="mlx: MLX's AdamW per parameter (every shipped demo); flat: the same AdamW and clipping on "
                        "all parameters as one vector (training.flat_adamw: the same values up to rounding, a "
                        "few kernels a step instead of ~3,900)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="mx.compile the training step (slow to trace: kimi_k3's KDA loops over time in training)")
    p.add_argument("--save-experts", choices=["float32", "bf16"], default=None,
                   help="the routed experts in the saved weights: float32 (code), or bf16 plus their exact mxfp4 "
                        "bytes (chat: its fp32 weights are more than a device call brings back)")
    p.add_argument("--stop-after", type=float, default=0,
                   help="train: stop after this many seconds of this call and keep the state for --resume (a device "
                        "call is limited to 10 minutes)")
    p.add_argument("--stop-at", type=int, default=0, help="train: stop at this step, keeping the state for --resume")
    p.add_argument("--init", default=None,
                   help="train: start from this exported checkpoint's weights instead of the seed's random ones (a "
                        "fine-tune, e.g. of the shipped demo on data prepared with --copy-share; same tokenizer)")
    p.add_argument("--resume", action="store_true", help="train: go on from the state a stopped call kept")
    p.add_argument("--resume-dir", type=Path, default=None,
                   help="where a stopped call keeps its state (default <work>/resume); on the lent GPU an ignored "
                        "folder that is not carried, e.g. build/demo-resume, so carrying the work again keeps it")
    p.add_argument("--cache-limit-gb", type=float, default=0,
                   help="train: cap MLX's buffer cache at this many GiB (0: MLX's default); tool batches of 6 "
                        "conversations trained on an 80 GB H100 with 16, where batches of 8 ran out of memory")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args(argv)
    for k, v in (CHAT_DEFAULTS if a.spec == "chat" else CODE_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.dest = a.dest or a.work / "checkpoint"
    a.docs = a.docs or a.work / "demo-model.json"
    if not 0.0 <= a.copy_share <= 1.0:
        raise SystemExit(f"--copy-share: a share of the sessions between 0 and 1, not {a.copy_share}")
    if a.spec == "code" and a.chat_share:
        raise SystemExit("--chat-share needs --spec chat (the first demo trains on code alone)")
    global SPEC
    SPEC = DEMO_SPECS[a.spec]
    a.steps = a.steps or None
    a.work.mkdir(parents=True, exist_ok=True)
    if a.stage in ("prepare", "all"):
        prepare(a.work, a.stdlib, a)
    recorded = json.loads((a.work / "corpus.json").read_text()).get("spec", "code") \
        if (a.work / "corpus.json").is_file() else a.spec
    if recorded != a.spec:
        raise SystemExit(f"{a.work} was prepared for --spec {recorded}, not {a.spec}")
    if a.stage in ("train", "all"):
        from contextlib import nullcontext

        from training.delta import chunked_kda_training

        if a.kda_chunk < 1 or a.kda_chunk & (a.kda_chunk - 1):
            raise SystemExit(f"--kda-chunk: a power of two, not {a.kda_chunk}")
        if a.keep_every < 0 or (a.keep_every and a.keep_every % a.eval_every):
            raise SystemExit(f"--keep-every: a multiple of --eval-every ({a.eval_every}), not {a.keep_every}")
        with chunked_kda_training(a.kda_chunk) if a.kda == "chunked" else nullcontext():
            done = train(a.work, a)
        if done is None:
            return  # stopped early: the state waits for --resume
    if a.stage in ("export", "all"):
        if a.weights is not None and not (a.weights.is_dir() and a.weights.parent.resolve() == a.work.resolve()):
            raise SystemExit(f"--weights {a.weights}: not a folder of saved weights inside {a.work}")
        exported = export(a.work, a.dest, check=not a.no_check, weights=a.weights)
        write_docs_training(a.work, exported, a.docs)


if __name__ == "__main__":
    main()

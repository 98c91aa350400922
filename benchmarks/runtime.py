#!/usr/bin/env python3
"""Runtime benchmark on the shipped demo model: load time, memory, prefill and decode speed, and held-out quality per
recipe, with `source` (the shipped checkpoint itself) as the baseline measured in the same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/runtime.py
    python benchmarks/runtime.py --quick          # a smoke run (under a minute)
    python benchmarks/runtime.py --profile        # also: where a decode step's time goes, per module class

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset: MLX's
Linux CPU wheel ships a reference BLAS. `--no-openblas` opts out.)

What it does, all in one run:

1. In one subprocess with step 2, copies the shipped demo (`tqbench.demo.ensure_demo()`) into the work directory
   (`source`) and converts it with every recipe (`--recipes`, default tq3a-tqTe-down4-g64,tq4,affine4,src) by
   `tqbench.convert.convert`.
2. Tokenizes the held-out split (`tqbench.demo.is_heldout`) with the shipped tokenizer and fixes the inputs every model
   sees: a prompt (`--prompt-tokens`, default 512, from the start of the longest held-out file) and quality windows
   (`--windows` x `--window`, default 32 x 256, spread evenly over the held-out stream, each from an empty context).
   Every process runs a copy of the tqbench package taken at the start (`work/code`): the tree may change meanwhile.
3. Quality, one fresh subprocess per model: loss and perplexity over the windows, top-1 accuracy against the text, and
   each position's argmax; the parent compares every model's argmax with `source`'s (top-1 agreement).
4. Speed and memory, one fresh subprocess per model and repeat (its peak RSS is that process's own), the model order
   rotated between repeats: import, `tqbench.runtime.load.load` (timed), one warm-up generation, then one greedy
   generation of `--gen-tokens` (default 128) after the prompt with mlx-lm's `stream_generate` (what
   `tqbench.runtime.conversation.Conversation` runs; its prefill/decode tok/s are the ones ReplyDone reports), also counted
   per CPU-second of the process. The end-of-message token is masked so every model generates the same number of
   tokens. A floor subprocess per repeat does the imports only.
5. `--profile`: where a decode step's time goes per model (module classes timed; TurboQuant also with its weights
   decoded once up front).
6. Writes JSON (`--out`, default bench-results/runtime.json, schema tqbench.bench.runtime/1) and prints a table with
   medians and ratios against `source` (per-repeat pairs, then the median).
"""

from __future__ import annotations

import os
import platform
import sys

from harness import (REPO, add_size_options, changed_paths, current_rss_bytes, emit, machine_info, median,
                     peak_rss_bytes, run_child, sizes, with_openblas)

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SCHEMA = "tqbench.bench.runtime/1"
MiB = 2**20
BASELINE = "source"
DEFAULT_RECIPES = "tq3a-tqTe-down4-g64,tq4,affine4,src"
# full / --quick settings
DEFAULTS = dict(repeats=5, prompt_tokens=512, gen_tokens=128, warmup_tokens=16, windows=32, window=256, batch=8)
QUICK = dict(repeats=1, prompt_tokens=128, gen_tokens=16, warmup_tokens=4, windows=4, window=128, batch=4)
PROFILE_TOKENS = 32
CHILD_SCRIPT: Path | None = None  # the snapshot's copy of this script (snapshot_code)
CHILD_ENV: dict[str, str] = {}  # the children's PYTHONPATH: the snapshot first
# what a measurement here depends on in the repo
RELEVANT = ("tqbench", "benchmarks/runtime.py", "benchmarks/harness.py", "pyproject.toml")


# --- helpers shared by parent and children ---------------------------------------------------------------------------


def code_files() -> dict[str, str]:
    """sha256 (12 hex digits) of every tqbench module this process imported and of this script: what it ran (the
    parent checks that every measurement ran the same code)."""
    out = {"benchmarks/runtime.py": __file__}
    pkg = sys.modules.get("tqbench")
    if pkg is not None:
        root = Path(pkg.__file__).resolve().parent.parent
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if f and (name == "tqbench" or name.startswith("tqbench.")):
                out[Path(f).resolve().relative_to(root).as_posix()] = f
    return {k: hashlib.sha256(Path(f).read_bytes()).hexdigest()[:12] for k, f in sorted(out.items())}


def snapshot_code(work: Path) -> Path:
    """A copy of the tqbench package, of this script and of the harness under `work`, which every child (the
    conversions too) imports instead of the tree: other people edit the tree while a run takes minutes, and every
    measurement of one run must run the same code."""
    dest = work / "code"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO / "tqbench", dest / "tqbench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(Path(__file__).resolve(), dest / "runtime.py")
    shutil.copy2(Path(__file__).resolve().parent / "harness.py", dest / "harness.py")
    return dest


def _emit(result: dict) -> None:
    """A child's result, with the code it ran (`code_files`) and where it imported tqbench from."""
    emit(dict(result, code_files=code_files(), tqbench_file=getattr(sys.modules.get("tqbench"), "__file__", None)))


def _imports() -> float:
    """What every child imports before loading a model (the floor child stops here). Returns the seconds taken."""
    t0 = time.perf_counter()
    import mlx.core  # noqa: F401
    import mlx_lm.generate  # noqa: F401
    import mlx_lm.models.kimi_k3  # noqa: F401
    import mlx_lm.sample_utils  # noqa: F401
    import numpy  # noqa: F401

    import tqbench.runtime.load  # noqa: F401
    return time.perf_counter() - t0


def _mask_token(token: int):
    """A logits processor that makes `token` impossible (so greedy decoding never stops early)."""
    import mlx.core as mx

    def mask(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) == token, -mx.inf, logits)

    return mask


def _generate(loaded, prompt, max_tokens: int, eos: int) -> dict:
    """One greedy generation with mlx-lm's stream_generate; what it reports and the tokens."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens = []
    t0, c0 = time.perf_counter(), time.process_time()
    c1 = None
    last = None
    for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens,
                             sampler=make_sampler(0.0), logits_processors=[_mask_token(eos)]):
        if c1 is None:
            c1 = time.process_time()  # the prompt and the first token
        tokens.append(int(r.token))
        last = r
    wall, c2 = time.perf_counter() - t0, time.process_time()
    # CPU seconds of this process (all its threads): less sensitive than wall time to other people's jobs on the
    # machine, though not immune (shared caches, OpenBLAS threads that spin while waiting).
    decoded = last.generation_tokens - 1
    return dict(prefill_tps=last.prompt_tps, decode_tps=last.generation_tps, prompt_tokens=last.prompt_tokens,
                generated_tokens=last.generation_tokens, finish_reason=last.finish_reason, wall_s=wall,
                prefill_cpu_s=c1 - c0, decode_cpu_s=c2 - c1,
                prefill_cpu_tps=last.prompt_tokens / (c1 - c0) if c1 > c0 else None,
                decode_cpu_tps=decoded / (c2 - c1) if decoded > 0 and c2 > c1 else None,
                tokens=tokens, mlx_peak=int(mx.get_peak_memory()))


# --- children --------------------------------------------------------------------------------------------------------


def child_floor(a: dict) -> None:
    _emit(dict(mode="floor", import_s=_imports()))


def child_speed(a: dict) -> None:
    import_s = _imports()
    import mlx.core as mx
    import numpy as np

    from tqbench.runtime.load import load
    rss_after_import = peak_rss_bytes()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    loaded = load(a["path"])
    load_s = time.perf_counter() - t0
    after_load = dict(mlx_peak=int(mx.get_peak_memory()), mlx_active=int(mx.get_active_memory()),
                      peak_rss=peak_rss_bytes(), rss=current_rss_bytes())
    prompt = mx.array(np.load(a["prompt"]).astype(np.uint32))
    mx.reset_peak_memory()
    warm = _generate(loaded, prompt, a["warmup_tokens"], a["eos"])
    mx.reset_peak_memory()
    gen = _generate(loaded, prompt, a["gen_tokens"], a["eos"])
    _emit(dict(mode="speed", import_s=import_s, load_s=load_s, weight_bytes=loaded.weight_bytes,
               turboquant_modules=loaded.turboquant_modules, rss_after_import=rss_after_import,
               after_load=after_load, warmup=dict((k, warm[k]) for k in ("prefill_tps", "decode_tps", "mlx_peak")),
               mlx_peak_after_load=after_load["mlx_peak"],
               mlx_peak_generation=gen["mlx_peak"],
               mlx_peak_total=max(after_load["mlx_peak"], warm["mlx_peak"], gen["mlx_peak"]),
               **{k: gen[k] for k in ("prefill_tps", "decode_tps", "prompt_tokens", "generated_tokens",
                                      "finish_reason", "wall_s", "prefill_cpu_s", "decode_cpu_s", "prefill_cpu_tps",
                                      "decode_cpu_tps", "tokens")}))


def child_quality(a: dict) -> None:
    _imports()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from tqbench.runtime.load import load
    loaded = load(a["path"])
    data = np.load(a["windows"])
    x, y = data["x"], data["y"]
    b = a["batch"]
    losses, argmax, correct = [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(x), b):
        logits = loaded.model(mx.array(x[i: i + b].astype(np.int32))).astype(mx.float32)
        yy = mx.array(y[i: i + b].astype(np.int32))
        nll = nn.losses.cross_entropy(logits, yy, reduction="none").sum(axis=-1)
        top = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(nll, top)
        losses += [float(v) for v in np.array(nll)]
        top = np.array(top)
        argmax.append(top)
        correct += int((top == y[i: i + b]).sum())
    seconds = time.perf_counter() - t0
    np.save(a["argmax_out"], np.concatenate(argmax))
    tokens = int(y.size)
    loss = sum(losses) / tokens
    _emit(dict(mode="quality", loss=loss, perplexity=math.exp(loss), tokens=tokens, windows=len(x),
               window=int(x.shape[1]), batch=b, top1_accuracy=correct / tokens, window_loss_sums=losses,
               forward_seconds=seconds, forward_tps=tokens / seconds, argmax_file=a["argmax_out"],
               weight_bytes=loaded.weight_bytes))


def child_profile(a: dict) -> None:
    """Where a decode step's time goes, three ways, each over `tokens` greedy steps after the prompt (median of
    `runs`; the least disturbed run, the minimum, is reported too: on a shared machine it is the closest to the cost):
    - plain: the step as it runs (no timers);
    - by module class: every matmul module (each Linear / SwitchLinear kind, quantized or not) timed by class,
      evaluating its inputs before and its output inside its timer; the rest of the step (attention and KDA cores,
      router, norms, embedding, sampling) is the remainder. Each timer costs an evaluation, so small modules look
      slower than they run inside the lazy pipeline;
    - TurboQuant models also with their weights decoded once up front (float32 W_rot, the rotation still applied to
      the input per call): plain minus this is what decoding the codes on every call costs."""
    _imports()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.runtime import codebook, layers
    from tqbench.runtime.load import load
    loaded = load(a["path"])
    model = loaded.model
    prompt = mx.array(np.load(a["prompt"]).astype(np.uint32))
    n, runs = a["tokens"], a.get("runs", 3)

    def decode(after_prefill=lambda: None) -> float:
        cache = make_prompt_cache(model)
        logits = model(prompt[None], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        after_prefill()
        t0 = time.perf_counter()
        for _ in range(n):
            logits = model(tok[:, None], cache=cache)
            tok = mx.argmax(logits[:, -1], axis=-1)
            mx.eval(tok)
        return (time.perf_counter() - t0) / n * 1e3  # ms per token

    decode()  # warm-up: compiled graphs for these shapes
    plain = [decode() for _ in range(runs)]

    leaves = {type(m) for _, m in model.named_modules()
              if isinstance(m, (nn.Linear, nn.QuantizedLinear, layers.TurboQuantLinear, layers.TurboQuantSwitchLinear))
              or type(m).__name__ in ("SwitchLinear", "QuantizedSwitchLinear")}
    stats: dict[str, list] = {}
    busy = [False]

    def label(cls, m) -> str:
        mode, bits = getattr(m, "mode", None), getattr(m, "bits", None)
        return cls.__name__ + (f" ({mode} {bits}-bit)" if mode else "")

    def timed_call(cls, fn):
        def call(self, *args, **kw):
            if busy[0]:  # nested in a timed module: counted by it
                return fn(self, *args, **kw)
            arrays = [v for v in (*args, *kw.values()) if isinstance(v, mx.array)]
            if arrays:
                mx.eval(*arrays)  # the inputs' work belongs to whatever made them
            busy[0] = True
            t = time.perf_counter()
            try:
                r = fn(self, *args, **kw)
                mx.eval(r)
            finally:
                busy[0] = False
            s = stats.setdefault(label(cls, self), [0.0, 0])
            s[0] += time.perf_counter() - t
            s[1] += 1
            return r
        return call

    rot = codebook.rotate_input

    def rotate(x, signs, block):
        t = time.perf_counter()
        r = rot(x, signs, block)
        mx.eval(r)
        s = stats.setdefault("  within TurboQuant: rotate input (Hadamard)", [0.0, 0])
        s[0] += time.perf_counter() - t
        s[1] += 1
        return r

    originals = {cls: cls.__call__ for cls in leaves}
    by_run: list[dict] = []
    timed_totals = []
    for cls, fn in originals.items():
        cls.__call__ = timed_call(cls, fn)
    codebook.rotate_input = rotate
    try:
        for _ in range(runs):
            timed_totals.append(decode(stats.clear))  # the decode steps only, not the prefill
            by_run.append({k: (v[0] / n * 1e3, v[1] / n) for k, v in stats.items()})
    finally:
        for cls, fn in originals.items():
            cls.__call__ = fn
        codebook.rotate_input = rot
    best = min(range(runs), key=lambda i: timed_totals[i])  # the by-class split of the least disturbed timed run
    modules = {k: dict(ms_per_token=v[0], calls_per_token=v[1]) for k, v in by_run[best].items()}
    timed = timed_totals[best]
    out = dict(mode="profile", tokens=n, runs=runs, plain_ms_per_token=min(plain), plain_ms_per_token_median=
               statistics.median(plain), plain_ms_per_token_all=plain, timed_ms_per_token=timed,
               timed_ms_per_token_all=timed_totals, modules=modules,
               rest_ms_per_token=timed - sum(v["ms_per_token"] for k, v in modules.items() if not k.startswith(" ")))

    tq = [m for _, m in model.named_modules()
          if isinstance(m, (layers.TurboQuantLinear, layers.TurboQuantSwitchLinear))]
    if tq:
        wrot = {id(m): codebook.dequantize_rotated(m.weight, m.scales, m.codebook, m.signs.shape[0]) for m in tq}
        mx.eval(list(wrot.values()))
        originals = {cls: cls.__call__ for cls in (layers.TurboQuantLinear, layers.TurboQuantSwitchLinear)}

        def linear(self, x):
            y = codebook.rotate_input(x, self.signs, self.block) @ wrot[id(self)].T
            return (y + self.bias.astype(mx.float32) if "bias" in self else y).astype(x.dtype)

        def switch(self, x, indices, sorted_indices=False):
            y = mx.gather_mm(codebook.rotate_input(x, self.signs, self.block), wrot[id(self)].swapaxes(-1, -2),
                             rhs_indices=indices, sorted_indices=sorted_indices)
            if "bias" in self:
                y = y + mx.expand_dims(self.bias[indices].astype(mx.float32), -2)
            return y.astype(x.dtype)

        layers.TurboQuantLinear.__call__, layers.TurboQuantSwitchLinear.__call__ = linear, switch
        try:
            decode()
            pre = [decode() for _ in range(runs)]
        finally:
            for cls, fn in originals.items():
                cls.__call__ = fn
        out.update(predecoded_ms_per_token=min(pre), predecoded_ms_per_token_median=statistics.median(pre),
                   predecoded_ms_per_token_all=pre,
                   predecoded_weight_bytes=sum(w.nbytes for w in wrot.values()))
    _emit(out)


def tensor_bytes(path: Path) -> tuple[int, int, int]:
    """(packed tensor bytes over the shards, file bytes of the shards, shard count)."""
    from tqbench.shards.header import read_header
    shards = sorted(path.glob("*.safetensors"))
    return (sum(t.nbytes for f in shards for t in read_header(f).tensors), sum(f.stat().st_size for f in shards),
            len(shards))


def prepare_models(work: Path, recipes: list[str]) -> list[dict]:
    """The source copy and its conversions (made again every run: a few seconds each)."""
    from tqbench.convert import convert
    from tqbench.demo import ensure_demo
    from tqbench.events import ConvertFinished
    from tqbench.recipe import Recipe

    demo = ensure_demo()
    src = work / BASELINE
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(demo, src)
    models = [dict(label=BASELINE, recipe=None, path=str(src), convert_seconds=None)]
    for r in recipes:
        recipe = Recipe.parse(r)
        dst = work / f"model-{r}"
        shutil.rmtree(dst, ignore_errors=True)
        t0 = time.perf_counter()
        fin = None
        for ev in convert(src, dst, recipe, force=True):
            if isinstance(ev, ConvertFinished):
                fin = ev
        models.append(dict(label=r, recipe=recipe.name, path=str(dst), convert_seconds=time.perf_counter() - t0,
                           mean_rel_error=getattr(fin, "mean_rel_error", None)))
    for m in models:
        tb, fb, n = tensor_bytes(Path(m["path"]))
        m.update(disk_tensor_bytes=tb, disk_shard_bytes=fb, shards=n)
    return models


def prepare_inputs(work: Path, cfg: dict) -> dict:
    """The held-out split tokenized; the prompt and the quality windows written for the children."""
    import numpy as np

    from tqbench.demo import SHIPPED_DEMO, SHIPPED_SPEC, special_ids
    from tqbench.tokenizer import load_encoding
    from training.corpus import corpus_files, encode_files, is_heldout, stdlib_root

    root = stdlib_root()
    files = [f for f in corpus_files(root) if is_heldout(f)]
    enc = load_encoding(SHIPPED_DEMO)
    eos = special_ids(SHIPPED_SPEC)["eos_token_id"]
    per_file = [np.array(enc.encode_ordinary((root / f).read_text(encoding="utf-8")), dtype=np.uint32)
                for f in files]
    stream = encode_files(enc, root, files, eos)
    if not files or len(stream) < cfg["windows"] * cfg["window"] + 1:
        raise SystemExit(f"the held-out split of {root} has {len(stream)} tokens: too few for "
                         f"{cfg['windows']} windows of {cfg['window']}")
    # Prompt: the first prompt_tokens of the longest held-out file (a file's start, no end-of-message inside).
    longest = max(range(len(files)), key=lambda i: len(per_file[i]))
    prompt = per_file[longest][: cfg["prompt_tokens"]]
    if len(prompt) < cfg["prompt_tokens"]:
        raise SystemExit(f"the longest held-out file has {len(prompt)} tokens, fewer than --prompt-tokens")
    # Windows: evenly spread over the stream's non-overlapping windows (every window starts from an empty context).
    w, n = cfg["window"], (len(stream) - 1) // cfg["window"]
    idx = sorted({int(round(i)) for i in np.linspace(0, n - 1, cfg["windows"])})
    x = np.stack([stream[i * w: (i + 1) * w] for i in idx]).astype(np.int32)
    y = np.stack([stream[i * w + 1: (i + 1) * w + 1] for i in idx]).astype(np.int32)
    np.save(work / "prompt.npy", prompt)
    np.savez(work / "windows.npz", x=x, y=y)
    starts = np.cumsum([0] + [len(t) + 1 for t in per_file])  # stream offset of each file
    covered = sorted({files[int(np.searchsorted(starts, i * w, side="right")) - 1] for i in idx})
    digest = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
    return dict(stdlib=str(root), python=platform.python_version(), heldout_files=len(files),
                heldout_tokens=int(len(stream)), eos=eos,
                prompt=dict(file=files[longest], tokens=int(len(prompt)),
                            sha256=hashlib.sha256(prompt.tobytes()).hexdigest()),
                windows=dict(count=len(idx), window=w, predicted_tokens=int(y.size), window_indices=idx,
                             of_windows=n, files_covered=len(covered), tokens_sha256=digest),
                prompt_path=str(work / "prompt.npy"), windows_path=str(work / "windows.npz"))


def turboquant_path() -> str:
    """Which TurboQuant product serves decode: a fused GPU kernel, or the plain-MLX reference (CPU)."""
    try:
        from tqbench.runtime import kernels
        backend = getattr(kernels, "default_backend", lambda: None)()
        return (f"fused {backend} kernels (decode), reference otherwise" if backend else
                "reference (tqbench.runtime.codebook: codes decoded with plain MLX ops per call)")
    except Exception as e:  # pragma: no cover
        return f"unknown: {e}"


def child_prepare(a: dict) -> None:
    """The models and the inputs every measurement uses, made with the snapshot's code."""
    work = Path(a["work"])
    models = prepare_models(work, a["recipes"])
    _emit(dict(models=models, inputs=prepare_inputs(work, a["cfg"]), turboquant_path=turboquant_path()))


CHILDREN = {"prepare": child_prepare, "floor": child_floor, "speed": child_speed, "quality": child_quality,
            "profile": child_profile}


# --- parent ----------------------------------------------------------------------------------------------------------


CODE: dict[str, dict[str, set]] = {}  # file -> digest -> the measurements that ran it


def code_check() -> tuple[dict[str, str], list[str]]:
    """The code every child ran (file -> digest) and the files whose digest differed between children."""
    same = {f: next(iter(d)) for f, d in CODE.items() if len(d) == 1}
    return same, sorted(f for f, d in CODE.items() if len(d) > 1)


def measure(mode: str, args: dict, timeout: float) -> dict:
    """One child's measurement, checked to have run the snapshot's code, whose digests go into CODE."""
    result = run_child(CHILD_SCRIPT or Path(__file__).resolve(), mode, args, timeout, env=CHILD_ENV)
    where = result.pop("tqbench_file")
    if CHILD_SCRIPT is not None and where and not Path(where).resolve().is_relative_to(CHILD_SCRIPT.parent):
        raise RuntimeError(f"{mode} child imported tqbench from {where}, not from the snapshot {CHILD_SCRIPT.parent}")
    for f, digest in result.pop("code_files").items():
        CODE.setdefault(f, {}).setdefault(digest, set()).add(f"{mode} {args.get('path', '')}".strip())
    return result


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def summarize(models: list[dict], speed: list[dict], floors: list[dict], quality: dict[str, dict]) -> dict:
    import numpy as np

    base = {x["repeat"]: x for x in speed if x["model"] == BASELINE}
    base_q = quality[BASELINE]
    base_top = np.load(base_q["argmax_file"])
    base_tokens = base[min(base)]["tokens"] if base else []
    floor = median([f["peak_rss"] for f in floors])
    rows = []
    for m in models:
        runs = [x for x in speed if x["model"] == m["label"]]
        paired = [(x, base[x["repeat"]]) for x in runs if x["repeat"] in base]
        q = quality[m["label"]]
        top = np.load(q["argmax_file"])
        gen_tokens = runs[0]["tokens"] if runs else []
        same = 0
        for a_, b_ in zip(gen_tokens, base_tokens):
            if a_ != b_:
                break
            same += 1
        peak = median([x["peak_rss"] for x in runs])
        rows.append(dict(
            model=m["label"], recipe=m["recipe"], repeats=len(runs),
            disk_tensor_bytes=m["disk_tensor_bytes"], disk_shard_bytes=m["disk_shard_bytes"],
            weight_bytes=runs[0]["weight_bytes"], turboquant_modules=runs[0]["turboquant_modules"],
            load_s=median([x["load_s"] for x in runs]), load_s_all=[x["load_s"] for x in runs],
            import_s=median([x["import_s"] for x in runs]),
            prefill_tps=median([x["prefill_tps"] for x in runs]), prefill_tps_all=[x["prefill_tps"] for x in runs],
            decode_tps=median([x["decode_tps"] for x in runs]), decode_tps_all=[x["decode_tps"] for x in runs],
            prefill_ratio=median([x["prefill_tps"] / b["prefill_tps"] for x, b in paired]),
            decode_ratio=median([x["decode_tps"] / b["decode_tps"] for x, b in paired]),
            prefill_cpu_tps=median([x["prefill_cpu_tps"] for x in runs]),
            decode_cpu_tps=median([x["decode_cpu_tps"] for x in runs]),
            decode_cpu_tps_all=[x["decode_cpu_tps"] for x in runs],
            prefill_cpu_ratio=median([_ratio(x["prefill_cpu_tps"], b["prefill_cpu_tps"]) for x, b in paired]),
            decode_cpu_ratio=median([_ratio(x["decode_cpu_tps"], b["decode_cpu_tps"]) for x, b in paired]),
            decode_cpu_ratio_all=[_ratio(x["decode_cpu_tps"], b["decode_cpu_tps"]) for x, b in paired],
            prefill_ratio_all=[x["prefill_tps"] / b["prefill_tps"] for x, b in paired],
            decode_ratio_all=[x["decode_tps"] / b["decode_tps"] for x, b in paired],
            peak_rss_after_load=median([x["after_load"]["peak_rss"] for x in runs]),
            peak_rss=peak, peak_rss_all=[x["peak_rss"] for x in runs], rss_floor=floor,
            rss_growth=peak - floor if peak is not None and floor is not None else None,
            mlx_peak_after_load=median([x["mlx_peak_after_load"] for x in runs]),
            mlx_peak_generation=median([x["mlx_peak_generation"] for x in runs]),
            mlx_peak_total=median([x["mlx_peak_total"] for x in runs]),
            peak_rss_ratio=median([x["peak_rss"] / b["peak_rss"] for x, b in paired]),
            rss_growth_ratio=None,
            weight_bytes_ratio=None, mlx_peak_total_ratio=None,
            greedy_same_prefix=same, greedy_tokens=len(gen_tokens),
            perplexity=q["perplexity"], loss=q["loss"], quality_tokens=q["tokens"],
            top1_accuracy=q["top1_accuracy"],
            top1_agreement=float((top == base_top).mean()) if top.shape == base_top.shape else None,
            quality_forward_tps=q["forward_tps"], convert_seconds=m["convert_seconds"]))
    b = next(r for r in rows if r["model"] == BASELINE)
    for r in rows:
        r["weight_bytes_ratio"] = _ratio(r["weight_bytes"], b["weight_bytes"])
        r["disk_tensor_bytes_ratio"] = _ratio(r["disk_tensor_bytes"], b["disk_tensor_bytes"])
        r["mlx_peak_total_ratio"] = _ratio(r["mlx_peak_total"], b["mlx_peak_total"])
        r["rss_growth_ratio"] = _ratio(r["rss_growth"], b["rss_growth"])
        r["perplexity_ratio"] = _ratio(r["perplexity"], b["perplexity"])
        r["quality_forward_ratio"] = _ratio(r["quality_forward_tps"], b["quality_forward_tps"])
    return dict(baseline=BASELINE, rows=rows, rss_floor=floor)


def fmt_mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}"


def fmt_mib(b) -> str:
    return "-" if b is None else f"{b / MiB:.0f}"


def fmt_x(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def print_table(doc: dict) -> None:
    rows = doc["summary"]["rows"]
    cfg = doc["config"]
    print(f"speed and memory (median of {cfg['repeats']} fresh processes per model; ratios: per-repeat pairs with "
          f"{BASELINE}, median)")
    head = (f"{'model':<20} {'disk MB':>7} {'mem MB':>7} {'load s':>6} {'prefill':>8} {'x src':>6} {'decode':>7} "
            f"{'x src':>6} {'dec/cpu':>7} {'x src':>6} {'RSS MiB':>7} {'x src':>6} {'MLX pk':>6} {'x src':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cpu = "-" if r["decode_cpu_tps"] is None else f"{r['decode_cpu_tps']:.1f}"
        print(f"{r['model']:<20} {fmt_mb(r['disk_tensor_bytes']):>7} {fmt_mb(r['weight_bytes']):>7} "
              f"{r['load_s']:>6.2f} {r['prefill_tps']:>8.0f} {fmt_x(r['prefill_ratio']):>6} {r['decode_tps']:>7.1f} "
              f"{fmt_x(r['decode_ratio']):>6} {cpu:>7} {fmt_x(r['decode_cpu_ratio']):>6} "
              f"{fmt_mib(r['peak_rss']):>7} {fmt_x(r['peak_rss_ratio']):>6} "
              f"{fmt_mib(r['mlx_peak_total']):>6} {fmt_x(r['mlx_peak_total_ratio']):>6}")
    q = doc["inputs"]["windows"]
    print()
    print(f"quality on the held-out split ({q['count']} windows x {q['window']} tokens = {q['predicted_tokens']} "
          f"predicted tokens, from {q['files_covered']} files; same windows for every model)")
    head = (f"{'model':<20} {'ppl':>8} {'x src':>7} {'top-1 acc':>9} {'agree src':>9} {'greedy=src':>10} "
            f"{'fwd tok/s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<20} {r['perplexity']:>8.3f} {fmt_x(r['perplexity_ratio'], 4):>7} "
              f"{r['top1_accuracy']:>9.4f} {r['top1_agreement']:>9.4f} "
              f"{str(r['greedy_same_prefix']) + '/' + str(r['greedy_tokens']):>10} {r['quality_forward_tps']:>9.0f}")
    print()
    print(f"disk MB = packed tensor bytes of the shards; mem MB = the parameters as loaded (Loaded.weight_bytes); "
          f"prefill = {cfg['prompt_tokens']}-token prompt tok/s; decode = tok/s over {cfg['gen_tokens']} greedy tokens "
          f"(mlx-lm stream_generate); dec/cpu = decoded tokens per CPU-second of the process (all threads; steadier "
          f"than wall time on a shared machine); RSS = the process's peak RSS (import floor "
          f"{fmt_mib(doc['summary']['rss_floor'])} MiB); MLX pk = mx.get_peak_memory() over load + generation; "
          f"agree src = top-1 agreement with {BASELINE}'s argmax; greedy=src = leading generated tokens identical "
          f"to {BASELINE}'s; fwd tok/s = batched forward over the windows.")
    print(f"TurboQuant path: {doc['machine'].get('turboquant_path')}; machine: {doc['machine']['cpu_count']} CPUs, "
          f"load average {doc['machine'].get('load_average', ['?'])[0]:.1f} at the start, "
          f"{(doc['machine'].get('load_average_end') or ['?'])[0]:.1f} at the end.")
    if "profile" in doc:
        print()
        print(f"where a decode step goes (ms per token over {PROFILE_TOKENS} greedy steps, least disturbed of 3 runs; "
              f"modules timed by class, each evaluated inside its timer)")
        for label, p in doc["profile"].items():
            parts = ", ".join(f"{k.strip()} {v['ms_per_token']:.1f} ({v['calls_per_token']:.0f} calls)"
                              for k, v in sorted(p["modules"].items(), key=lambda kv: -kv[1]["ms_per_token"]))
            pre = (f", TurboQuant weights decoded once up front {p['predecoded_ms_per_token']:.1f}"
                   if "predecoded_ms_per_token" in p else "")
            print(f"  {label:<20} untimed {p['plain_ms_per_token']:.1f} ms/token{pre}; timed "
                  f"{p['timed_ms_per_token']:.1f}: {parts}; rest {p['rest_ms_per_token']:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated recipe names (default "
                                                              f"{DEFAULT_RECIPES}); '{BASELINE}' is always measured")
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--profile", action="store_true", help="also time a decode step per module class for every model")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary directory, removed afterwards)")
    p.add_argument("--out", type=Path, default=Path("bench-results/runtime.json"), help="JSON result file")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per child process")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)

    cfg = sizes(a, DEFAULTS, QUICK)
    recipes = [r.strip() for r in a.recipes.split(",") if r.strip()]
    tmp = a.work is None
    work = Path(tempfile.mkdtemp(prefix="tqbench-bench-runtime-")) if tmp else a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    global CHILD_SCRIPT
    code = snapshot_code(work)
    CHILD_SCRIPT = code / "runtime.py"
    CHILD_ENV["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    from tqbench.recipe import Recipe
    try:
        for r in recipes:
            Recipe.parse(r)  # fail early on a bad name
    except Exception:
        if tmp:
            shutil.rmtree(work, ignore_errors=True)
        raise
    t_start = time.perf_counter()
    doc: dict = dict(schema=SCHEMA, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=[sys.executable, *sys.argv],
                     machine=machine_info(work, RELEVANT),
                     config=dict(cfg, recipes=recipes, baseline=BASELINE, quick=a.quick, profile=a.profile,
                                 generation="mlx_lm.generate.stream_generate, greedy (make_sampler(0.0)), "
                                            "end-of-message masked; one warm-up generation per process first"))
    try:
        print("converting ...", end=" ", flush=True)
        prepared = measure("prepare", dict(work=str(work), recipes=recipes, cfg=cfg), a.timeout)
        models, inputs = prepared["models"], prepared["inputs"]
        doc["machine"]["turboquant_path"] = prepared["turboquant_path"]
        print(", ".join(f"{m['label']} {m['convert_seconds']:.1f}s" for m in models if m["convert_seconds"]),
              flush=True)
        doc.update(models=models, inputs={k: v for k, v in inputs.items() if not k.endswith("_path")})
        quality: dict[str, dict] = {}
        for m in models:
            x = measure("quality", dict(path=m["path"], windows=inputs["windows_path"], batch=cfg["batch"],
                                        argmax_out=str(work / f"argmax-{m['label']}.npy")), a.timeout)
            x["model"] = m["label"]
            quality[m["label"]] = x
            print(f"  quality {m['label']:<20} ppl {x['perplexity']:.3f}  top-1 {x['top1_accuracy']:.4f}  "
                  f"({x['forward_seconds']:.1f}s)", flush=True)
        speed, floors = [], []
        for rep in range(cfg["repeats"]):
            f = measure("floor", {}, a.timeout)
            f["repeat"] = rep
            floors.append(f)
            k = rep % len(models)
            order = models[k:] + models[:k]  # rotated: every model takes every position in turn
            if rep % 2:
                order = order[::-1]
            for m in order:
                x = measure("speed", dict(path=m["path"], prompt=inputs["prompt_path"], eos=inputs["eos"],
                                          gen_tokens=cfg["gen_tokens"], warmup_tokens=cfg["warmup_tokens"]),
                            a.timeout)
                x.update(model=m["label"], repeat=rep)
                speed.append(x)
                print(f"  [{rep + 1}/{cfg['repeats']}] {m['label']:<20} load {x['load_s']:.2f}s  prefill "
                      f"{x['prefill_tps']:6.0f} tok/s  decode {x['decode_tps']:6.1f} tok/s  peak RSS "
                      f"{x['peak_rss'] / MiB:.0f} MiB", flush=True)
        doc.update(measurements=dict(quality=list(quality.values()), speed=speed, floor=floors))
        if a.profile:
            doc["profile"] = {}
            for m in models:
                x = measure("profile", dict(path=m["path"], prompt=inputs["prompt_path"], tokens=PROFILE_TOKENS),
                            a.timeout)
                doc["profile"][m["label"]] = x
                print(f"  profile {m['label']:<20} {x['plain_ms_per_token']:.1f} ms/token", flush=True)
        doc["summary"] = summarize(models, speed, floors, quality)
        end = machine_info(work, RELEVANT)
        doc["machine"]["git_commit_end"], doc["machine"]["git_dirty_end"] = end.get("git_commit"), end.get("git_dirty")
        doc["machine"]["load_average_end"] = end.get("load_average")
        same, differ = code_check()
        doc["code"] = dict(files=same, changed_during_run={f: {d: sorted(w) for d, w in CODE[f].items()}
                                                           for f in differ},
                           snapshot_of=dict(commit=doc["machine"].get("git_commit"),
                                            uncommitted=doc["machine"].get("git_dirty_relevant")),
                           note="every process ran a copy of tqbench and of this script taken at the start; files: "
                                "sha256[:12] of every tqbench module the processes imported and of the script")
        if differ:
            doc.setdefault("notes", []).append(
                f"the code changed between measurements (other people edit the tree): {', '.join(differ)}; "
                f"measurements mix versions, run again")
        if end.get("git_commit") != doc["machine"].get("git_commit"):
            doc["machine"]["changed_during_run"] = changed_paths(doc["machine"].get("git_commit"),
                                                                 end.get("git_commit"), RELEVANT)
            doc.setdefault("notes", []).append(
                f"the repository moved from {doc['machine'].get('git_commit')[:10]} to {end.get('git_commit')[:10]} "
                f"during the run; the measurements ran the copy of the tree taken at the start (code.files)")
        doc["total_seconds"] = time.perf_counter() - t_start
    finally:
        if tmp:
            shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print_table(doc)
    for n in doc.get("notes", []):
        print("note:", n)
    print(f"\nwrote {a.out} ({doc['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        sys.exit(main())

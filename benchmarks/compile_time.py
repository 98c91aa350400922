#!/usr/bin/env python3
"""What a process pays for compiling kernels before its first tokens (issue 14), with caches empty and filled.

    PYTHONPATH=. python3 benchmarks/compile_time.py --work /tmp/k3c --out compile.json    # on the GPU machine
    python benchmarks/compile_time.py --quick --work /tmp/ct                              # a CPU smoke run

A small K3-shaped streaming model (`k3_gpu.py`'s: K3's expert shapes, `--layers` layers of `--experts` experts, so
every kernel shape of the large one) is built once. Then each run is a fresh process that loads it streamed and
times, one after another: a 4-token prompt, two decode tokens, a `--long`-token prompt in a new cache (past the fused
kernels' row limit: mlx-lm's prefill through the reference path), two more tokens. Every step is evaluated before
the next starts, so its time holds the kernels it compiled. Runs:

- `mlx fresh` / `nvrtc fresh`: MLX's kernel cache (MLX_PTX_CACHE_DIR) and tqbench's (TQBENCH_CACHE_DIR) empty, as
  on a fresh machine; tqbench's CUDA kernels built by `mx.fast.cuda_kernel` (the old way) or NVRTC cubins;
- `mlx warm` / `nvrtc warm`: the same caches the fresh run filled, as for a second process on that machine.

Per run: each step's seconds, the kernels tqbench built (and NVRTC's compile seconds), the modules MLX compiled (its
cache directory listed: names, count, the span of their write times), self-check warnings, and the greedy tokens,
which must agree across runs. On the CPU no CUDA kernel exists; the smoke run checks the plumbing and the tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import emit, machine_info, run_child
from k3_gpu import QUICK_SPEC, SPEC, build_model

SCHEMA = "tqbench.bench.compile/1"
RUNS = ("mlx fresh", "nvrtc fresh", "mlx warm", "nvrtc warm")
DEFAULTS = dict(layers=5, experts=32, long=40, budget_gb=2.0)
QUICK = dict(layers=3, experts=16, long=12, budget_gb=0.004)


def _mlx_modules(ptx_dir: Path) -> dict:
    """The modules MLX compiled into its cache directory: count, names without their hash, and the span of their
    write times (MLX compiles one at a time on the thread that evaluates, so the span bounds their compile time)."""
    files = sorted(ptx_dir.glob("*.ptx")) if ptx_dir.is_dir() else []
    kinds: dict[str, int] = {}
    for f in files:
        kind = re.sub(r"(_[0-9a-f]{8,})+$", "", f.stem)
        kind = re.sub(r"\d+", "#", kind)[:60]
        kinds[kind] = kinds.get(kind, 0) + 1
    times = sorted(f.stat().st_mtime for f in files)
    return dict(count=len(files), bytes=sum(f.stat().st_size for f in files),
                span_s=(times[-1] - times[0]) if times else 0.0,
                kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1])))


def child_first_tokens(a: dict) -> None:
    t0 = time.perf_counter()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench import cubin
    from tqbench.runtime import kernels
    from tqbench.runtime.load import load
    from tqbench.stream.streamer import StreamConfig

    kernels.CUDA_BUILD = a["build"]
    import_s = time.perf_counter() - t0
    steps: list[dict] = []
    tokens: list[int] = []

    def step(name: str, fn) -> None:
        t = time.perf_counter()
        out = fn()
        mx.eval(out)
        steps.append(dict(step=name, seconds=time.perf_counter() - t))
        tokens.append(int(out.item()))

    t = time.perf_counter()
    loaded = load(a["path"], streaming=StreamConfig(budget_bytes=a["budget_bytes"], workers=4, page_cache="off"),
                  tokenizer=False)
    load_s = time.perf_counter() - t
    model = loaded.model
    for name in ("short", "long"):
        cache = make_prompt_cache(model)
        prompt = mx.array(np.array(a["prompts"][name], dtype=np.uint32))[None]

        def first():
            return mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)

        step(f"{name} prompt ({prompt.size} tokens)", first)
        for i in (1, 2):
            tok = mx.array([tokens[-1]], dtype=mx.uint32)[None]
            step(f"{name}: token {i}", lambda: mx.argmax(model(tok, cache=cache)[:, -1], axis=-1))
    loaded.streamer.close()
    specs = kernels._compiled.cache_info().currsize
    emit(dict(import_s=import_s, load_s=load_s, steps=steps, tokens=tokens, kernel_specs=specs,
              nvrtc=dict(compiled=cubin.STATS.compiled, compile_s=cubin.STATS.compile_s, loaded=cubin.STATS.loaded),
              nvrtc_error=kernels.NVRTC_ERROR, self_check_warnings=list(kernels.dispatcher.warnings),
              device=str(mx.default_device()), mlx=mx.__version__))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a CPU smoke run at tiny shapes")
    p.add_argument("--work", type=Path, help="work directory (the model is kept there and reused)")
    p.add_argument("--out", type=Path, default=Path("bench-results/compile_time.json"))
    p.add_argument("--runs", default=",".join(RUNS), help=f"any of: {', '.join(RUNS)} (a warm run needs its fresh one)")
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--long", type=int, help="tokens of the second prompt")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_first_tokens(json.loads(a.child[1]))
        return 0
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad or any(r.endswith("warm") and r.replace("warm", "fresh") not in runs for r in runs):
        p.error(f"--runs takes {', '.join(RUNS)}, each warm run with its fresh one; got {a.runs!r}")
    if a.work is None:
        p.error("--work is required")
    cfg = dict(QUICK if a.quick else DEFAULTS)
    cfg.update({k: v for k, v in dict(layers=a.layers, experts=a.experts, long=a.long).items() if v is not None})
    spec_kw = QUICK_SPEC if a.quick else SPEC
    top_k = spec_kw["num_experts_per_token"]
    if cfg["layers"] < 2 or cfg["experts"] < top_k or cfg["long"] < 1:
        p.error(f"--layers takes 2 or more (the first is dense), --experts {top_k} or more (the top-k), --long 1 or "
                f"more; got {cfg['layers']}, {cfg['experts']}, {cfg['long']}")
    a.work.mkdir(parents=True, exist_ok=True)
    doc: dict = dict(schema=SCHEMA, machine=machine_info(), config=cfg, quick=a.quick, runs={})
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    model = doc["model"] = build_model(a.work, spec_kw, cfg, a.timeout)
    log(f"model: {model['moe_layers']} MoE layers x {model['experts_per_layer']} experts "
        f"({model['model_bytes'] / 1e9:.2f} GB)" + ("" if model["reused"] else f", built in {model['write_source_s'] + model['convert_s']:.0f} s"))
    save()
    vocab = 256 + spec_kw["bpe_merges"]
    rng = np.random.default_rng(21)
    prompts = dict(short=rng.integers(0, vocab, 4).tolist(), long=rng.integers(0, vocab, cfg["long"]).tolist())
    caches = Path(tempfile.mkdtemp(prefix="compile-caches-", dir=a.work))
    script = Path(__file__).resolve()
    try:
        for run in runs:
            build, state = run.split()
            d = caches / build
            if state == "fresh" and d.exists():
                shutil.rmtree(d)
            env = dict(MLX_PTX_CACHE_DIR=str(d / "mlx"), TQBENCH_CACHE_DIR=str(d / "tqbench"))
            args = dict(path=model["path"], build=build, prompts=prompts, budget_bytes=int(cfg["budget_gb"] * 1e9))
            before = _mlx_modules(d / "mlx")["count"]
            res = run_child(script, "first", args, a.timeout, env=env)
            res["mlx_modules"] = _mlx_modules(d / "mlx")
            res["mlx_modules"]["compiled_here"] = res["mlx_modules"]["count"] - before
            doc["runs"][run] = res
            first = sum(s["seconds"] for s in res["steps"])
            log(f"{run:12s} process {res['process_wall_s']:.1f} s (import {res['import_s']:.1f}, load "
                f"{res['load_s']:.1f}); steps " + ", ".join(f"{s['seconds']:.2f}" for s in res["steps"])
                + f" = {first:.1f} s; tqbench kernels {res['kernel_specs']} (NVRTC compiled {res['nvrtc']['compiled']}"
                f" in {res['nvrtc']['compile_s']:.1f} s, loaded {res['nvrtc']['loaded']}); MLX modules compiled "
                f"{res['mlx_modules']['compiled_here']}" + (f"; NVRTC error: {res['nvrtc_error']}"
                                                           if res["nvrtc_error"] else "")
                + (f"; {len(res['self_check_warnings'])} self-check warnings" if res["self_check_warnings"] else ""))
            save()
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    done = doc["runs"]
    tokens = {r: v["tokens"] for r, v in done.items()}
    doc["tokens_agree"] = len({tuple(t) for t in tokens.values()}) <= 1
    totals = {r: sum(s["seconds"] for s in v["steps"]) for r, v in done.items()}
    doc["steps_total_s"] = totals
    if "mlx fresh" in totals and "nvrtc fresh" in totals:
        doc["fresh_ratio_nvrtc_vs_mlx"] = totals["nvrtc fresh"] / totals["mlx fresh"]
    if "mlx warm" in totals and "nvrtc warm" in totals:
        doc["warm_ratio_nvrtc_vs_mlx"] = totals["nvrtc warm"] / totals["mlx warm"]
    save()
    log("tokens agree across runs" if doc["tokens_agree"] else f"TOKENS DIFFER: {tokens}")
    return 0 if doc["tokens_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

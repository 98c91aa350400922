#!/usr/bin/env python3
"""Real prompts, streamed and resident, give the same tokens: the check every GPU change runs.

Streaming on CUDA once worked only for prompts of a few tokens (MLX's CUDA gather_mm holds at most 1,024 matrices and
offsets them in 32-bit bytes; tqbench.runtime.codebook says how the reference gather stays inside both). This script
runs what a user runs, with prompts of thousands of tokens:

1. The models: `--k3 WORK` builds (or reuses) the K3-shaped model of `benchmarks/k3_gpu.py` (K3's expert shapes,
   top-16; `--k3-layers`, `--k3-experts`); `--demo CKPT` converts the demo with `tq4` and with the K3 recipe
   (`--bits 3 -g 64 --ternary-experts --expert-down-bits 4`) through `tqbench convert`; `--model PATH` adds any other.
2. Prompts: for each of `--lengths` (default 16, 512, 2,048 and 8,192 tokens), text of this repository's own source
   cut where the model's tokenizer reaches that many tokens.
3. Per model, three modes, each in a process of its own (a CUDA fault ends a process: it is reported, not fatal):
   resident, streamed at the budget, and streamed at the budget over a host tier (`--k3-budget`/`--k3-host` for the
   K3-shaped model, `--budget`/`--host` for the others). Each runs every prompt in a fresh cache through tqbench's
   engine (`tqbench.runtime.conversation.generate`: the loop chat and serve run) and keeps the first `--tokens` greedy tokens.
   A streamed mode passes when its tokens equal resident's (`--cpu-reference`: the CPU's, where resident fails).
4. `--faces`: on the first model, streamed at its budget, the prompt of `--face-length` tokens through `tqbench chat
   --prompt --json`, through `tqbench serve` (one /v1/completions request over loopback, the server stopping after
   it) and `tqbench eval` (perplexity over windows of that length, streamed and resident, which must agree).

`--mlx-limits` first runs MLX's gather_mm past each limit directly (and tqbench's gather on the same case), each in a
process of its own, to show what the limits do on this machine.

    python3 scripts/gpu_prompt_check.py --k3 /tmp/gpc --demo tqbench/demo/checkpoint --faces --out check.json

Writes JSON after every step (`--out`) and exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from harness import RESULT_MARK, emit, source_text  # noqa: E402

K3_RECIPE = ["--bits", "3", "-g", "64", "--ternary-experts", "--expert-down-bits", "4"]
GB = 10**9


def parse_bytes(text: str) -> int:
    from tqbench.recipe.fit import parse_size

    return parse_size(text)


def cut_to_tokens(tokenizer, text: str, n: int) -> tuple[str, int]:
    """The shortest prefix of `text` whose encoding (with special tokens, as a plain-text prompt) has >= n tokens."""
    def count(chars: int) -> int:
        return len(tokenizer.encode(text[:chars], add_special_tokens=True))

    lo, hi = 1, len(text)
    if count(hi) < n:
        raise SystemExit(f"the source text holds fewer than {n} tokens")
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < n else (lo, mid)
    return text[:lo], count(lo)


# --- a child: one model, one mode, every prompt -------------------------------------------------------------------


def child_run(a: dict) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.runtime.conversation import Sampling, generate
    from tqbench.runtime.complete import text_prompt
    from tqbench.runtime.load import load
    from tqbench.stream.streamer import StreamConfig

    if a["device"] == "cpu":
        mx.set_default_device(mx.cpu)
    stream = None
    if a["budget"] is not None:
        stream = StreamConfig(budget_bytes=a["budget"], workers=4, host_budget_bytes=a["host"])
    t0 = time.perf_counter()
    loaded = load(a["model"], streaming=stream)
    rows = []
    for text in a["texts"]:
        tokens = text_prompt(loaded, text)
        t = time.perf_counter()
        ids: list[int] = []  # every token generated (a last token with no text yet yields no TokenOut)
        for _ in generate(loaded, tokens, make_prompt_cache(loaded.model), Sampling(max_tokens=a["tokens"]), 0, ids):
            pass
        row = dict(prompt_tokens=len(tokens), tokens=ids, seconds=time.perf_counter() - t,
                   mlx_peak_bytes=int(mx.get_peak_memory()))
        if loaded.streamer is not None:
            s = loaded.streamer.stats
            row.update(reads=s.reads, misses=s.misses, hits_host=s.hits_host, slots=s.slots)
        rows.append(row)
        print(f"  {a['label']}: {len(tokens)} tokens -> {ids} in {row['seconds']:.1f} s", file=sys.stderr, flush=True)
    if loaded.streamer is not None:
        loaded.streamer.close()
    emit(dict(rows=rows, load_s=time.perf_counter() - t0, device=str(mx.default_device())))


def run_mode(label: str, model: Path, budget: int | None, host: int, texts: list[str], tokens: int, device: str,
             timeout: float) -> dict:
    args = dict(label=label, model=str(model), budget=budget, host=host, texts=texts, tokens=tokens, device=device)
    cmd = [sys.executable, __file__, "--child", json.dumps(args)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error=f"timed out after {timeout:.0f} s")
    sys.stderr.write(p.stderr[-3000:] if p.returncode else "")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if p.returncode or not lines:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-3:]
        return dict(ok=False, error=f"exit {p.returncode}: " + " | ".join(tail)[-600:],
                    seconds=time.perf_counter() - t0)
    return dict(ok=True, **json.loads(lines[-1][len(RESULT_MARK):]), seconds=time.perf_counter() - t0)


# --- MLX's own limits, shown directly ---------------------------------------------------------------------------------


def child_probe(name: str) -> None:
    """One gather_mm past a limit (sorted, one row of x per routing: mlx-lm's SwitchGLU from 64 routings on), checked
    against per-expert products: "groups" has 1,025 small matrices, "bytes" 64 K3-sized float32 ones (2.8 GB);
    "tqbench-bytes" runs the "bytes" case through tqbench's reference gather instead."""
    import mlx.core as mx
    import numpy as np

    from tqbench.runtime import codebook
    from tqbench.runtime.kernels import random_case

    experts, out, n = (1025, 8, 64) if name == "groups" else (64, 3072, 3584)
    rows = 2 * experts
    idx = mx.array(np.repeat(np.arange(experts), 2).astype(np.uint32))
    x = mx.random.normal((rows, 1, n), key=mx.random.key(0))
    if name == "tqbench-bytes":
        weight, scales, book = random_case(16, 64, n, out, experts, key=3)
        y = codebook.gather_matmul(x, weight, scales, book, idx, True)
        w = codebook.dequantize_rotated(weight, scales, book, n)
    else:
        w = mx.random.normal((experts, out, n), key=mx.random.key(1))
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
    mx.eval(y)
    err = max(float(mx.abs(y[r, 0] - x[r, 0] @ w[r // 2].T).max()) for r in range(0, rows, max(1, rows // 16)))
    emit(dict(probe=name, max_abs_err=err, b_bytes=experts * out * n * 4))


def probe_limits(timeout: float) -> dict:
    out = {}
    for name in ("groups", "bytes", "tqbench-bytes"):
        p = subprocess.run([sys.executable, __file__, "--probe", name], capture_output=True, text=True,
                           timeout=timeout)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_MARK)]
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:]
        out[name] = (json.loads(lines[-1][len(RESULT_MARK):]) if lines and not p.returncode
                     else dict(error=f"exit {p.returncode}: {' '.join(tail)[-400:]}"))
        print(f"probe {name}: {out[name]}"[:300], file=sys.stderr, flush=True)
    return out


# --- the models -------------------------------------------------------------------------------------------------------


def build_k3(work: Path, layers: int, experts: int) -> Path:
    from k3_gpu import SPEC, build_model

    info = build_model(work, SPEC, dict(layers=layers, experts=experts), timeout=1800)
    print(f"K3-shaped model: {info['moe_layers']} MoE layers x {info['experts_per_layer']} experts, "
          f"{info['expert_total_bytes'] / GB:.1f} GB of experts", file=sys.stderr)
    return Path(info["path"])


def convert_demo(ckpt: Path, work: Path) -> list[Path]:
    out = []
    for name, recipe in (("demo-tq4", ["-r", "tq4"]), ("demo-k3-recipe", K3_RECIPE)):
        dest = work / name
        if not (dest / "model.safetensors.index.json").is_file():
            subprocess.run([sys.executable, "-m", "tqbench", "convert", "--hf-path", str(ckpt), "--mlx-path",
                            str(dest), *recipe], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        out.append(dest)
    return out


# --- the faces --------------------------------------------------------------------------------------------------------


def tq(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tqbench", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_faces(model: Path, text: str, want: list[int], budget: str, tokens: int, window: int, eval_text: str,
                timeout: float) -> dict:
    """chat and serve on the streamed model (`want`: the engine's streamed tokens for `text`), and eval of
    `eval_text` in windows of `window` tokens, streamed and resident."""
    stream = ["--cache-budget-gb", budget, "--host-cache-gb", "off"]
    out: dict = {}
    p = tq("chat", "--model", str(model), "--no-chat-template", "--prompt", text, "--max-tokens", str(tokens),
           "--temp", "0", "--json", *stream, timeout=timeout)
    got = [json.loads(ln)["id"] for ln in p.stdout.splitlines() if '"event": "token"' in ln]
    # its token events: every token with text (a last token whose text is not complete yet prints none)
    ok = p.returncode == 0 and len(got) >= len(want) - 1 and got == want[:len(got)]
    out["chat"] = dict(ok=ok, tokens=got, exit=p.returncode,
                       error=p.stderr.strip().splitlines()[-1][-400:] if p.returncode else None)

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tqbench", "serve", "--model", str(model), "--port", str(port),
                               "--max-requests", "1", "--temp", "0", *stream], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
        body = json.dumps(dict(model=models["data"][0]["id"], prompt=text, max_tokens=tokens, temperature=0)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=timeout).read())
        served = reply["choices"][0]["text"]
        server.wait(timeout=60)
        out["serve"] = dict(text=served, prompt_tokens=reply["usage"]["prompt_tokens"], exit=server.returncode)
    except Exception as e:  # noqa: BLE001 - reported
        server.kill()
        out["serve"] = dict(ok=False, error=f"{type(e).__name__}: {e}; server: {server.stderr.read()[-600:]}")

    scores = {}
    text_file = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_prompt_check_eval.txt"
    text_file.write_text(eval_text, encoding="utf-8")
    for name, budget_flag in (("streamed", budget), ("resident", "off")):
        p = tq("eval", str(model), "--text", str(text_file), "--window", str(window), "--tokens", str(window),
               "--prompts", "0", "--json", "--cache-budget-gb", budget_flag, "--host-cache-gb", "off", timeout=timeout)
        scores[name] = json.loads(p.stdout) if p.returncode == 0 else dict(error=p.stderr.strip()[-400:])
    ppl = {k: v["total"]["perplexity"] if "total" in v else None for k, v in scores.items()}
    out["eval"] = dict(perplexity=ppl, ok=None not in ppl.values() and
                       abs(ppl["streamed"] - ppl["resident"]) <= 1e-4 * ppl["resident"], raw=scores)
    return out


# --- main -------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--mlx-limits", action="store_true", help="first show MLX's gather_mm limits directly")
    ap.add_argument("--k3", type=Path, help="work directory for the K3-shaped model (built once)")
    ap.add_argument("--k3-layers", type=int, default=3)
    ap.add_argument("--k3-experts", type=int, default=384)
    ap.add_argument("--k3-budget", default="6GB")
    ap.add_argument("--k3-host", default="24GB")
    ap.add_argument("--demo", type=Path, help="the demo's checkpoint: converted with tq4 and the K3 recipe")
    ap.add_argument("--model", type=Path, action="append", default=[], help="another converted model")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-prompt-check"))
    ap.add_argument("--budget", default="4MB", help="expert cache budget for the demo and --model models")
    ap.add_argument("--host", default="16MB", help="host tier for the demo and --model models")
    ap.add_argument("--lengths", default="16,512,2048,8192")
    ap.add_argument("--tokens", type=int, default=4, help="greedy tokens compared per prompt")
    ap.add_argument("--cpu-reference", action="store_true", help="where resident fails, compare with the CPU")
    ap.add_argument("--faces", action="store_true", help="chat, serve and eval on the first model")
    ap.add_argument("--face-length", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.child:
        child_run(json.loads(a.child))
        return 0
    if a.probe:
        child_probe(a.probe)
        return 0

    from tqbench.runtime.load import load

    a.work.mkdir(parents=True, exist_ok=True)
    models: list[tuple[Path, int, int]] = []  # (path, budget bytes, host bytes)
    if a.k3:
        models.append((build_k3(a.k3, a.k3_layers, a.k3_experts), parse_bytes(a.k3_budget), parse_bytes(a.k3_host)))
    for m in (convert_demo(a.demo, a.work) if a.demo else []) + a.model:
        models.append((m, parse_bytes(a.budget), parse_bytes(a.host)))
    lengths = [int(x) for x in a.lengths.split(",")]
    text = source_text()
    result: dict = dict(lengths=lengths, tokens=a.tokens, models=[])
    failed = 0
    if a.mlx_limits:
        result["mlx_limits"] = probe_limits(a.timeout)

    def save() -> None:
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))

    for path, budget, host in models:
        tokenizer = load(path, lazy=True).tokenizer
        cut = [cut_to_tokens(tokenizer, text, n) for n in lengths]
        texts = [t for t, _ in cut]
        modes = {"resident": (None, 0), "streamed": (budget, 0), "streamed+host": (budget, host)}
        runs = {}
        for label, (b, h) in modes.items():
            print(f"{path.name}: {label}", file=sys.stderr, flush=True)
            runs[label] = run_mode(f"{path.name} {label}", path, b, h, texts, a.tokens, "default", a.timeout)
        ref = runs["resident"]
        if not ref["ok"] and a.cpu_reference:
            ref = runs["cpu"] = run_mode(f"{path.name} cpu", path, None, 0, texts, a.tokens, "cpu", a.timeout)
        rows = []
        for i, (n, (_, count)) in enumerate(zip(lengths, cut)):
            want = ref["rows"][i]["tokens"] if ref["ok"] else None
            row = dict(length=n, prompt_tokens=count, reference=want)
            for label in ("streamed", "streamed+host"):
                r = runs[label]
                got = r["rows"][i]["tokens"] if r["ok"] else None
                row[label] = dict(tokens=got, ok=want is not None and got == want,
                                  **({k: v for k, v in r["rows"][i].items() if k != "tokens"} if r["ok"] else
                                     dict(error=r["error"])))
                failed += not row[label]["ok"]
            rows.append(row)
            print(f"{path.name} {count:>6} tokens: reference {want}; "
                  + "; ".join(f"{lb} {'ok' if row[lb]['ok'] else 'FAIL'}" for lb in ("streamed", "streamed+host")),
                  file=sys.stderr, flush=True)
        entry = dict(model=str(path), budget_bytes=budget, host_bytes=host, rows=rows,
                     modes={k: {x: y for x, y in v.items() if x != "rows"} for k, v in runs.items()})
        result["models"].append(entry)
        save()

    if a.faces and models:
        path, budget, _ = models[0]
        first = result["models"][0]
        i = lengths.index(a.face_length) if a.face_length in lengths else len(lengths) - 1
        tokenizer = load(path, lazy=True).tokenizer
        face_text, _ = cut_to_tokens(tokenizer, text, lengths[i])
        want = first["rows"][i]["streamed"]["tokens"]
        eval_text, _ = cut_to_tokens(tokenizer, text, 2 * lengths[i] + 2)
        faces = check_faces(path, face_text, want, f"{budget / GB}GB", a.tokens, lengths[i], eval_text, a.timeout)
        if "text" in faces["serve"]:
            served = faces["serve"]["text"]  # as chat's: a last token's incomplete text may be held back
            faces["serve"]["ok"] = want is not None and bool(served) and tokenizer.decode(want).startswith(served)
        for name in ("chat", "serve", "eval"):
            failed += not faces[name].get("ok")
            print(f"{name}: {'ok' if faces[name].get('ok') else 'FAIL'} {faces[name]}"[:400], file=sys.stderr)
        result["faces"] = faces
    result["failed"] = failed
    save()
    print(f"{failed} check(s) failed" if failed else "every check passed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Long prompts, streamed (issue 48): a prompt's processing before its first token, chunk by chunk (mlx-lm's order,
which tqbench ran before) against layer by layer (tqbench.runtime.prefill), cold and continued from the prompt cache
on disk (tqbench.runtime.prompt_store), in the same run.

    python benchmarks/prefill.py                     # the demo with tq4: 512 / 2,048 / 8,192 tokens at 2 MB and 6 MB
    python benchmarks/prefill.py --quick             # a smoke run: 512 and 2,500 tokens at 4 MB
    python benchmarks/prefill.py --model /tmp/k3/k3-stream --budgets 6GB --lengths 2048,8192   # a converted model

(On Linux the script re-executes itself with Debian's OpenBLAS preloaded when it exists and LD_PRELOAD is unset;
`--no-openblas` opts out.)

The prompt is this repository's Python source, cut where the model's tokenizer reaches each length (real code, no
repeated text). For every budget and length, three fresh processes, each after the model's files (and the prompt
cache's) are dropped from the page cache:
- `chunked`: the prompt chunk by chunk through the whole model (2,048 tokens a chunk), as mlx-lm's generate_step
  does it, no prompt cache: the baseline;
- `layer-major`: as `tqbench chat` runs it today, with a prompt cache in an empty directory (the checkpoint it
  writes before the first token is in its time);
- `disk-cache`: the same prompt again in a new process, continuing from that checkpoint (a restart).
Before them, untimed, one chunked and one layer-major process at the first length pay for compiling kernels
(`--no-warmup` skips them). Each runs the prompt through tqbench's Conversation (the loop chat and serve run) to one greedy token and reports the
time to the first token (from the reply's start, the prompt cache lookup included), the experts and bytes read for
the prompt, the distinct (layer, expert) pairs it routed to, the first token, peak RSS and (CUDA) MLX's peak memory.
The disk's raw rate (O_DIRECT reads of expert-sized chunks of the model's files, `benchmarks/streaming.py`) is
measured in the same run, so `ttft_over_disk` says how close the first token comes to reading the distinct experts'
bytes at disk speed (goal <= 1.2 where reading dominates: the K3-shaped model on a GPU).
"""

from __future__ import annotations

import sys

from harness import emit, run_child, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import convert_demo, drop_cache, dump_json, log, machine_info, source_text  # noqa: E402

SCHEMA = "tqbench.bench.prefill/1"
SCRIPT = Path(__file__).resolve()
MODES = ("chunked", "layer-major", "disk-cache")


def child_prompt(a: dict) -> None:
    """One prompt in this process: load the model streamed, run the prompt to its first token, report."""
    import mlx.core as mx

    import tqbench.runtime.prefill as P
    from tqbench.events import PageIn, ReplyDone, TokenOut
    from tqbench.recipe.fit import LAYER_MAJOR_TOKENS, prefill_bound
    from tqbench.runtime.conversation import Conversation, Sampling
    from tqbench.runtime.load import load
    from tqbench.runtime.prompt_store import PromptStore, model_key
    from tqbench.stream.streamer import StreamConfig

    if a["mode"] == "chunked":
        P.layer_major = lambda *_: False  # mlx-lm's order: each chunk through every layer before the next
    t0 = time.perf_counter()
    loaded = load(a["model"], streaming=StreamConfig(budget_bytes=a["budget"], workers=a["workers"],
                                                     host_budget_bytes=a["host"]))
    load_s = time.perf_counter() - t0
    store = PromptStore(a["store"], model_key(a["model"])) if a["mode"] != "chunked" else None
    conv = Conversation(loaded=loaded, chat_template=False, store=store)
    source = Path(a["text"]).read_text(encoding="utf-8")
    tokens = list(loaded.tokenizer.encode(source[:a["length"] * 16], add_special_tokens=True))[:a["length"]]
    text = loaded.tokenizer.decode(tokens)
    stats = loaded.streamer.stats
    loaded.streamer.drain()
    before = stats.prefill_misses, stats.prefill_bytes
    t = time.perf_counter()
    ttft = done = None
    for ev in conv.reply(text, Sampling(temp=0.0, max_tokens=1)):
        if isinstance(ev, (TokenOut, ReplyDone)) and ttft is None:
            ttft = time.perf_counter() - t
        if isinstance(ev, ReplyDone):
            done = ev
    first = conv.tokens[-1]
    routed = {(e.layer, x) for e in loaded.streamer.drain() if isinstance(e, PageIn) for x in e.experts}
    emit(dict(mode=a["mode"], prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens, ttft_s=ttft,
              prefill_s=done.prefill_s, first_token=first, reads=stats.prefill_misses - before[0],
              read_bytes=stats.prefill_bytes - before[1], distinct=len(routed), load_s=load_s,
              mlx_peak_bytes=int(mx.get_peak_memory()), device=str(mx.default_device()),
              bound_bytes=prefill_bound(loaded.config).held_bytes(min(len(tokens) - 1, LAYER_MAJOR_TOKENS)),
              store_warnings=list(store.warnings) if store is not None else []))
    conv.close()
    if store is not None:
        store.close()


def raw_disk(model: Path, expert_bytes: int, workers: int) -> dict:
    """The disk's rate reading expert-sized chunks of the model's own files with O_DIRECT (up to 1 GB)."""
    from streaming import raw_direct

    files = sorted(model.glob("*.safetensors"))
    total = min(sum(f.stat().st_size for f in files), 1 << 30)
    drop_cache(files)
    return raw_direct(files, expert_bytes, total, workers)


def parse_size(text: str) -> int:
    from tqbench.recipe.fit import parse_size as parse

    return parse(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a converted model (default: the demo converted with tq4)")
    p.add_argument("--lengths", help="prompt lengths in tokens (default 512,2048,8192; --quick 512,2500)")
    p.add_argument("--budgets", help="expert cache budgets (default 2MB,6MB; --quick 4MB)")
    p.add_argument("--host", default="off", help="host tier (default off: every read comes from the disk)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed afterwards)")
    p.add_argument("--out", type=Path, default=Path("bench-results/prefill.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up processes (chunked and layer-major at the first length)")
    p.add_argument("--no-openblas", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_prompt(json.loads(a.child[1]))
        return 0
    lengths = [int(x) for x in (a.lengths or ("512,2500" if a.quick else "512,2048,8192")).split(",")]
    budgets = (a.budgets or ("4MB" if a.quick else "2MB,6MB")).split(",")
    host = 0 if a.host == "off" else parse_size(a.host)
    work = a.work or Path(tempfile.mkdtemp(prefix="tq-prefill-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or convert_demo(work)
    doc: dict = dict(schema=SCHEMA, machine=machine_info(work, ("tqbench/runtime", "tqbench/stream")),
                     config=dict(model=str(model), lengths=lengths, budgets=budgets, host=a.host, workers=a.workers),
                     rows=[])
    files = sorted(model.glob("*.safetensors"))
    text = work / "prompt.txt"
    text.write_text(source_text(), encoding="utf-8")

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(dump_json(doc))

    try:
        # MLX's CUDA build compiles its kernels the first time a shape is run and keeps them on disk: on a fresh H100
        # machine the first timed process spent 50 s of its 57 s doing so. Untimed processes pay for it first.
        doc["warmup"] = [] if a.no_warmup else [
            run_child(SCRIPT, mode, dict(mode=mode, model=str(model), budget=parse_size(budgets[0]), host=host,
                                         workers=a.workers, store=str(work / f"warmup-{mode}"), text=str(text),
                                         length=lengths[0]), a.timeout, env={"TQBENCH_CACHE_DIR": str(work / "cache")})
            for mode in ("chunked", "layer-major")]
        for w in doc["warmup"]:
            log(f"warm-up {w['mode']}: {w['ttft_s']:.1f} s (untimed)")
        for budget in budgets:
            for length in lengths:
                store = work / f"prompts-{budget}-{length}"
                shutil.rmtree(store, ignore_errors=True)
                row: dict = dict(budget=budget, length=length)
                for mode in MODES:
                    drop_cache(files + [f for f in store.rglob("*") if f.is_file()])
                    args = dict(mode=mode, model=str(model), budget=parse_size(budget), host=host,
                                workers=a.workers, store=str(store), text=str(text), length=length)
                    r = run_child(SCRIPT, mode, args, a.timeout, env={"TQBENCH_CACHE_DIR": str(work / "cache")})
                    row[mode] = r
                    log(f"{budget} {r['prompt_tokens'] + r['cached_tokens']:>6} tokens {mode:>11}: "
                        f"first token in {r['ttft_s']:7.2f} s, "
                        f"{r['reads']:>6} reads ({r['read_bytes'] / 1e6:,.0f} MB; {r['distinct']} distinct), "
                        f"peak RSS {r['peak_rss'] / 1e6:,.0f} MB")
                c, lm, dc = row["chunked"], row["layer-major"], row["disk-cache"]
                row.update(same_first_token=c["first_token"] == lm["first_token"] == dc["first_token"],
                           reads_over_distinct=lm["reads"] / lm["distinct"] if lm["distinct"] else None,
                           chunked_reads_over_distinct=c["reads"] / c["distinct"] if c["distinct"] else None,
                           ttft_ratio=lm["ttft_s"] / c["ttft_s"], disk_cache_ttft_ratio=dc["ttft_s"] / lm["ttft_s"],
                           # what layer by layer holds beyond chunk by chunk, against the plan's bound for the window
                           extra_peak_bytes=lm["mlx_peak_bytes"] - c["mlx_peak_bytes"],
                           bound_bytes=lm["bound_bytes"])
                doc["rows"].append(row)
                save()
        lm0 = doc["rows"][0]["layer-major"]
        expert = lm0["read_bytes"] // max(lm0["reads"], 1)  # an expert's bytes on disk (the mean of those read)
        doc["disk"] = raw_disk(model, expert, a.workers)
        for row in doc["rows"]:
            lm = row["layer-major"]
            at_disk = lm["read_bytes"] / (doc["disk"]["gbps"] * 1e9)
            row["distinct_bytes_at_disk_s"] = at_disk
            row["ttft_over_disk"] = lm["ttft_s"] / at_disk if at_disk else None
        save()
        log(f"disk: {doc['disk']['gbps']:.2f} GB/s (O_DIRECT={doc['disk']['direct']}); wrote {a.out}")
        bad = [r for r in doc["rows"] if not r["same_first_token"]]
        return 1 if bad else 0
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What a pipeline of ranks costs per token (issue 34), on loopback: the demo converted with tq4 answering the same
greedy `tqbench chat --prompt` in one process and split across 2 and 3 ranks by `mlx.launch` (MLX's ring backend over
127.0.0.1), each round in rotated order so a drift in the machine's speed hits every setting alike.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/distributed.py
    python benchmarks/distributed.py --quick          # a smoke run

Per run: decode tok/s as the face reports it (mlx-lm's figure, from `--json`'s done event), and its ratio to the one
process of the same round; the greedy tokens (they must be the one process's); with `--budget` (the experts
streamed from disk through that cache on every rank) each rank's expert bytes read per token, from rank 0's
`--stats-json` (`ranks`). Peak RSS: the largest process of the run (the launcher's children included). On one
2-core machine the ranks share the cores, so the ratio bounds the pipeline's cost from above: on separate machines
the ranks' compute does not compete.

Writes JSON (`--out`, default bench-results/distributed.json, schema tqbench.bench.distributed/1).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import add_size_options, convert_demo, machine_info, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

SCHEMA = "tqbench.bench.distributed/1"
DEFAULTS = dict(rounds=5, tokens=48, ranks="1,2,3", budget="300KB")
QUICK = dict(rounds=1, tokens=8, ranks="1,2", budget="300KB")
PROMPT = "def fib(n):"
BIN = Path(sys.executable).parent


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: Path, ranks: int, tokens: int, budget: str | None, stats: Path, timeout: float) -> dict:
    args = ["chat", "--model", str(model), "--prompt", PROMPT, "--max-tokens", str(tokens), "--no-learn", "--json"]
    if budget:
        args += ["--cache-budget-gb", budget, "--stats-json", str(stats)]
    cmd = [str(BIN / "tqbench"), *args]
    if ranks > 1:
        cmd = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(ranks), "--starting-port", str(port()), *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{ranks} rank(s) failed: {p.stderr[-2000:]}")
    events = [json.loads(line) for line in p.stdout.splitlines()]
    done = next(e for e in events if e["event"] == "done")
    out = dict(ranks=ranks, decode_tps=done["decode_tps"], prefill_tps=done["prefill_tps"],
               tokens=[e["id"] for e in events if e["event"] == "token"],
               largest_process_peak_rss=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
               if resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss > before else None)
    if budget:
        doc = json.loads(stats.read_text())
        passes = max(1, doc["tokens"])
        per_rank = doc.get("ranks") or [dict(rank=0, layers=None, critical_bytes=doc["critical_bytes"],
                                             misses=doc["misses"], tokens=doc["tokens"])]
        out["bytes_per_pass_by_rank"] = {str(r["rank"]): r["critical_bytes"] / max(1, r["tokens"]) for r in per_rank}
        out["layers_by_rank"] = {str(r["rank"]): r.get("layers") for r in per_rank}
        out["bytes_per_pass"] = doc["critical_bytes"] / passes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--work", type=Path, help="keep the converted demo here (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench-results/distributed.json"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)
    work = a.work or Path(tempfile.mkdtemp(prefix="tqbench-distributed-"))
    work.mkdir(parents=True, exist_ok=True)
    model = convert_demo(work)
    settings = [int(x) for x in cfg["ranks"].split(",")]
    rounds = []
    for i in range(cfg["rounds"]):
        order = settings[i % len(settings):] + settings[:i % len(settings)]
        got = {}
        for budget in (None, cfg["budget"]):
            for n in order:
                got[(n, budget)] = run(model, n, cfg["tokens"], budget, work / "stats.json", a.timeout)
        for (n, budget), r in got.items():
            r["budget"] = budget
            r["vs_one_process"] = r["decode_tps"] / got[(1, budget)]["decode_tps"]
            r["same_tokens_as_one_process"] = r["tokens"] == got[(1, budget)]["tokens"]
        rounds.append(list(got.values()))
        print(f"round {i + 1}: " + ", ".join(f"{r['ranks']} rank(s){' streamed' if r['budget'] else ''} "
                                             f"{r['decode_tps']:.1f} tok/s ({r['vs_one_process']:.2f}x)"
                                             for r in got.values()), flush=True)
    summary = []
    for budget in (None, cfg["budget"]):
        for n in settings:
            rows = [r for rnd in rounds for r in rnd if r["ranks"] == n and r["budget"] == budget]
            last = rows[-1]
            summary.append(dict(ranks=n, budget=budget, vs_one_process=[r["vs_one_process"] for r in rows],
                                vs_one_process_median=statistics.median(r["vs_one_process"] for r in rows),
                                decode_tps_median=statistics.median(r["decode_tps"] for r in rows),
                                same_tokens=all(r["same_tokens_as_one_process"] for r in rows),
                                bytes_per_pass_by_rank=last.get("bytes_per_pass_by_rank"),
                                layers_by_rank=last.get("layers_by_rank"),
                                largest_process_peak_rss=max((r["largest_process_peak_rss"] or 0) for r in rows)
                                or None))
    doc = dict(schema=SCHEMA, machine=machine_info(work), config=cfg, quick=a.quick, model=str(model),
               summary=summary, rounds=rounds)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for s in summary:
        per = s["bytes_per_pass_by_rank"]
        reads = "; read per pass by rank " + ", ".join(f"{k}: {v / 1e3:.1f} kB" for k, v in per.items()) if per else ""
        print(f"{s['ranks']} rank(s), {'experts streamed' if s['budget'] else 'resident'}: "
              f"{s['decode_tps_median']:.2f} tok/s, {s['vs_one_process_median']:.2f}x one process "
              f"(same tokens: {s['same_tokens']}){reads}")
    print(f"wrote {a.out}")
    return 0 if all(s["same_tokens"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())

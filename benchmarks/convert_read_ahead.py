#!/usr/bin/env python3
"""The converter's read-ahead into MLX memory against one unit ahead read as bytes, on this machine (issue 14).

    python benchmarks/convert_read_ahead.py --out bench-results/convert-read-ahead.json   # 8x64, two recipes, 3 rounds
    python benchmarks/convert_read_ahead.py --quick                                      # a smoke run (seconds)

`tqbench.convert.convert(..., read_ahead=N)` reads the tensors it decodes into an MLX-owned arena of N bytes on its
helper threads, up to N/2 bytes of units ahead; `read_ahead=0` reads one unit ahead as bytes and copies them into MLX
memory. Which is the default depends on the device (`default_read_ahead`). This converts one seeded source (the
shapes of `benchmarks/convert.py`, `--size`) with each, in fresh processes, alternating which goes first per round,
the page cache dropped before each: seconds, MB/s of source, peak RSS and MLX's peak, and per round the bytes path's
seconds over the arena's (above 1: the arena is faster).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from convert import SCRIPT as CONVERT, build_source, source_files
from harness import drop_cache, machine_info, output_digest, run_child, with_openblas

SCHEMA = "tqbench.bench.convert-read-ahead/1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8x64", help="LAYERSxEXPERTS (benchmarks/convert.py's shapes)")
    p.add_argument("--recipes", default="tq3a-tqTe-down4-g64,mxfp4e")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--read-ahead", type=int, help="arena bytes (default: tqbench.convert.pipeline.READ_AHEAD)")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed)")
    p.add_argument("--quick", action="store_true", help="size 2x8, one recipe, one round")
    p.add_argument("--out", type=Path, default=Path("bench-results/convert-read-ahead.json"))
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    with_openblas()
    from tqbench.convert.pipeline import READ_AHEAD, default_read_ahead
    size, recipes, rounds = ("2x8", ["tq3a-tqTe-down4-g64"], 1) if a.quick else (a.size, a.recipes.split(","),
                                                                                   a.rounds)
    if a.read_ahead is not None and a.read_ahead <= 0:
        raise SystemExit(f"--read-ahead: the arena's bytes, a positive number, not {a.read_ahead}")
    arena = a.read_ahead or READ_AHEAD
    work = a.work or Path(tempfile.mkdtemp(prefix="tqbench-read-ahead-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        layers, experts = map(int, size.split("x"))
        m = build_source(work, layers, experts, 0)
        files = source_files(Path(m["path"]))
        rows = []
        for recipe in recipes:
            for rnd in range(rounds):
                for mode in (("arena", "bytes") if rnd % 2 == 0 else ("bytes", "arena")):
                    dst = work / "out"
                    shutil.rmtree(dst, ignore_errors=True)
                    drop_cache(files)
                    r = run_child(CONVERT, "convert", dict(src=m["path"], dst=str(dst), recipe=recipe,
                                                           shard_size=5 * 2**30,
                                                           read_ahead=arena if mode == "arena" else 0), 1800)
                    digest = output_digest(dst)
                    shutil.rmtree(dst, ignore_errors=True)
                    rows.append(dict(recipe=recipe, round=rnd, mode=mode, seconds=r["seconds"],
                                     mb_per_s=m["source_bytes"] / r["seconds"] / 1e6, peak_rss=r["peak_rss"],
                                     mlx_peak_memory=r["mlx_peak_memory"], output_bytes=r["output_bytes"],
                                     output_digest=digest))
                    print(f"{recipe:<22} round {rnd} {mode:<5} {r['seconds']:6.2f} s "
                          f"{rows[-1]['mb_per_s']:7.1f} MB/s  peak RSS {r['peak_rss'] / 2**20:.0f} MiB", flush=True)
        summary = []
        for recipe in recipes:
            mine = [r for r in rows if r["recipe"] == recipe]
            sec = {mode: [r["seconds"] for r in mine if r["mode"] == mode] for mode in ("arena", "bytes")}
            paired = [b / x for x, b in zip(sec["arena"], sec["bytes"])]
            rss = {mode: max(r["peak_rss"] for r in mine if r["mode"] == mode) for mode in ("arena", "bytes")}
            summary.append(dict(recipe=recipe, arena_seconds=statistics.median(sec["arena"]),
                                bytes_seconds=statistics.median(sec["bytes"]), bytes_over_arena_paired=paired,
                                peak_rss_arena=rss["arena"], peak_rss_bytes=rss["bytes"],
                                same_output_bytes=len({r["output_digest"] for r in mine}) == 1))
            print(f"{recipe}: bytes / arena seconds per round {', '.join(f'{x:.2f}' for x in paired)}; peak RSS "
                  f"{rss['arena'] / 2**20:.0f} MiB with the arena, {rss['bytes'] / 2**20:.0f} MiB without")
        doc = dict(schema=SCHEMA, date=time.strftime("%Y-%m-%d"), machine=machine_info(work), size=size,
                   source_bytes=m["source_bytes"], read_ahead=arena, default_read_ahead=default_read_ahead(),
                   rows=rows, summary=summary, seconds=time.perf_counter() - t0)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

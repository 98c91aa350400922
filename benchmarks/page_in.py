#!/usr/bin/env python3
"""The streamer's page-in path against the disk (issues 11 and 14): the real `Streamer` paging K3-sized experts in
with the page cache bypassed, against raw O_DIRECT reads of the same experts in the same run.

    python benchmarks/page_in.py --work /tmp/page-in          # 96 experts of 10.96 MB (1.05 GB on disk), 4 workers
    git show REV:tqbench/stream/streamer.py > /tmp/old_streamer.py
    python benchmarks/page_in.py --work /tmp/page-in --before /tmp/old_streamer.py   # an older streamer, alternated
    git show REV:tqbench/stream/pagein.py > /tmp/old_pagein.py   # a REV whose read path is in pagein.py
    python benchmarks/page_in.py --work /tmp/page-in --before /tmp/old_streamer.py --before-pagein /tmp/old_pagein.py
    python benchmarks/page_in.py --work /tmp/page-in --reads-in-flight 0,1,2 --rounds 4   # the read gate, alternated
    python benchmarks/page_in.py --quick --work /tmp/page-in-q                        # a smoke run (seconds)

(On Linux the script re-executes itself with Debian's OpenBLAS preloaded when it exists and LD_PRELOAD is unset;
`--no-openblas` opts out.)

The store is `streaming.py`'s: one file of seeded random bytes after a 1,000-byte prefix (offsets not page aligned, as
in a real shard) and its `expert_map.json`, one MoE layer of `--experts` experts. Each round runs every variant in a
fresh process (`after` = this checkout's streamer; `before` = the file given to --before, in place of
`tqbench/stream/streamer.py` in a copy of the package that process imports, and the one given to --before-pagein,
if any, in place of `tqbench/stream/pagein.py`, where the read path lives since it left streamer.py; `in-flight-N` =
this checkout's with `StreamConfig.reads_in_flight` N, from `--reads-in-flight`, 0 being `after`), alternating which
goes first. In each process:
- raw: the experts' page-aligned ranges, in the order the page-ins will ask for them, read with O_DIRECT by
  `--workers` threads into one aligned buffer each (`streaming.timed_reads`), right before and right after the
  page-ins; their mean is that process's baseline (the disk varies by tens of percent between minutes); and the same
  with one thread (`raw1_gbps`): some disks read faster with one read in flight than with several, so the ratio to
  the better of the two (`ratio_best_raw`) is the one against the disk's bandwidth;
- page-in: `--calls` demand page-ins of `--per-call` distinct experts each (seeded random sets: one layer's misses),
  through `Streamer.page_in` with `--workers` workers and a pool of `--slots` slots (LRU), so every read, staging
  buffer, slot copy and (on CUDA) slot prefetch is the streamer's own; between page-ins a computation reads every
  pool array, as a layer would (on CUDA the pages go back to the GPU), and is evaluated outside the timing;
- results: GB/s on misses (expert bytes / seconds in page-ins), the ratio to raw (goal >= 0.9), ms per miss against
  the raw ms per expert, and the streamer's own split of a miss (its `miss_*` totals per timed miss, where the
  streamer has them).
The JSON (`--out`) keeps every process's row and the medians per variant.
"""

from __future__ import annotations

import os
import sys

from harness import REPO, emit, run_child, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SCHEMA = "tqbench.bench.page_in/1"
SCRIPT = Path(__file__).resolve()  # the children run this file
LAYER = 1
DEFAULTS = dict(experts=96, expert_bytes=10_960_896, workers=4, calls=30, per_call=8, slots=16, rounds=3)
QUICK = dict(experts=12, expert_bytes=1 << 20, workers=2, calls=6, per_call=4, slots=6, rounds=1)


def package_with_streamer(streamer: Path, dest: Path, pagein: Path | None = None) -> Path:
    """A copy of the tqbench package under `dest` with `streamer` as its tqbench/stream/streamer.py (and `pagein`, if
    given, as its tqbench/stream/pagein.py); a process with `dest` first on PYTHONPATH runs that streamer with the
    rest of this checkout."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO / "tqbench", dest / "tqbench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(streamer, dest / "tqbench" / "stream" / "streamer.py")
    if pagein is not None:
        shutil.copy2(pagein, dest / "tqbench" / "stream" / "pagein.py")
    return dest


def child(a: dict) -> None:
    import mlx.core as mx

    import tqbench.stream.streamer as S
    from streaming import timed_reads
    from tqbench.stream.store import ALIGN, ExpertStore

    root = Path(a["store"])
    store = ExpertStore.open(root)
    lay = store.layers[LAYER]
    eb, workers = lay.nbytes, a["workers"]
    buffers = S.read_buffers(workers) if hasattr(S, "read_buffers") else workers  # older streamers: one per worker
    budget = buffers * store.buffer_bytes(LAYER) + a["slots"] * eb
    extra = {"reads_in_flight": a["reads_in_flight"]} if a.get("reads_in_flight") else {}
    st = S.Streamer(store, S.StreamConfig(budget_bytes=budget, workers=workers, policy="lru", fanout=False,
                                          page_cache="off", **extra))
    if not st.direct:
        raise SystemExit("this file system refuses O_DIRECT: the page cache cannot be bypassed here")
    pool = st.pool_of[LAYER]
    rng = np.random.default_rng(a["seed"])
    calls = [sorted(int(e) for e in rng.choice(lay.experts, a["per_call"], replace=False)) for _ in range(a["calls"])]
    data = root / store.files[0]

    def aligned(e: int) -> tuple[Path, int, int]:
        (x,) = lay.extents[e]
        lo = x.offset // ALIGN * ALIGN
        return data, lo, -(-(x.offset + x.length) // ALIGN) * ALIGN - lo

    # warm-up reads (not timed) then the same experts in the page-ins' order
    order = [aligned(e) for e in calls[0][:workers]] + [aligned(e) for call in calls for e in call]
    got1, raw1, _ = timed_reads(order, workers)
    one1, one_s1, _ = timed_reads(order[workers - 1:], 1)
    st.page_in(LAYER, pool, [e for e in range(a["per_call"]) if e not in calls[0]], {}, set(), timed=False)
    seconds, misses = 0.0, 0
    for i, call in enumerate(calls):
        st._tick = i + 2
        missing = [e for e in call if (LAYER, e) not in pool.cache]
        locked = {(LAYER, e) for e in call if (LAYER, e) in pool.cache}
        t0 = time.perf_counter()
        st.page_in(LAYER, pool, missing, {}, locked)
        seconds += time.perf_counter() - t0
        misses += len(missing)
        mx.eval(sum(mx.sum(arr.reshape(arr.shape[0], -1)[:, :1024].astype(mx.float32)) for arr in pool.arrays.values()))
    one2, one_s2, _ = timed_reads(order[workers - 1:], 1)
    got2, raw2, _ = timed_reads(order, workers)
    raw_s_per_expert = (raw1 + raw2) / (len(order) - workers) / 2
    raw_gbps = (got1 + got2) / (raw1 + raw2) / 1e9
    gbps = misses * eb / seconds / 1e9
    raw1_gbps = (one1 + one2) / (one_s1 + one_s2) / 1e9
    s = st.stats
    split = {k[5:]: getattr(s, k) / s.miss_timed * 1e3 for k in type(s).__dataclass_fields__
             if k.startswith("miss_") and k not in ("miss_timed",) and getattr(s, "miss_timed", 0)}
    st.close()
    emit(dict(workers=workers, buffers=buffers, expert_bytes=eb, misses=misses, page_in_s=seconds,
              gbps_on_misses=gbps, raw_gbps=raw_gbps, ratio=gbps / raw_gbps, raw1_gbps=raw1_gbps,
              ratio_best_raw=gbps / max(raw_gbps, raw1_gbps), reads_in_flight=a.get("reads_in_flight", 0),
              ms_per_miss=seconds / misses * 1e3,
              raw_ms_per_expert=raw_s_per_expert * 1e3, miss_split_ms=split, device=str(mx.default_device()),
              gpu_prefetch=bool(getattr(st, "prefetch", None) and st.prefetch.active)))


def summarize(rows: list[dict]) -> dict:
    out = {}
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant]
        out[variant] = {k: statistics.median(r[k] for r in mine)
                        for k in ("ratio", "ratio_best_raw", "gbps_on_misses", "raw_gbps", "raw1_gbps", "ms_per_miss",
                                  "raw_ms_per_expert")}
        out[variant]["processes"] = len(mine)
    if "before" in out and "after" in out:
        # per round, after against the before of the same round (the disk drifts between rounds)
        pairs = [(a["ratio"], b["ratio"]) for a in rows if a["variant"] == "after"
                 for b in rows if b["variant"] == "before" and b["round"] == a["round"]]
        out["after_over_before_ratio"] = statistics.median(x / y for x, y in pairs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=False, help="a directory on the disk to measure (the store is kept)")
    p.add_argument("--before", help="an older tqbench/stream/streamer.py to alternate with this checkout's")
    p.add_argument("--before-pagein", help="the tqbench/stream/pagein.py of --before's revision (where it has one)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small experts, one round")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} (--quick: {QUICK[k]})")
    p.add_argument("--reads-in-flight", default="0", metavar="N,N,...",
                   help="this checkout's streamer with each of these StreamConfig.reads_in_flight (0: one per worker)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results/page_in.json"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    if a.work is None:
        p.error("--work is required (a directory on the disk to measure)")
    cfg = {k: getattr(a, k) if getattr(a, k) is not None else (QUICK if a.quick else DEFAULTS)[k] for k in DEFAULTS}
    if min(cfg.values()) < 1:
        p.error("every size option must be at least 1")
    if cfg["per_call"] > cfg["slots"] or cfg["per_call"] > cfg["experts"]:
        p.error("--per-call must not exceed --slots or --experts")
    if a.before and not Path(a.before).is_file():
        p.error(f"--before {a.before}: no such file")
    if a.before_pagein and not a.before:
        p.error("--before-pagein goes with --before")
    if a.before_pagein and not Path(a.before_pagein).is_file():
        p.error(f"--before-pagein {a.before_pagein}: no such file")
    try:
        gates = sorted({int(v) for v in a.reads_in_flight.split(",")})
    except ValueError:
        p.error(f"--reads-in-flight: whole numbers separated by commas, not {a.reads_in_flight!r}")
    if gates[0] < 0:
        p.error("--reads-in-flight: 0 or more")
    from streaming import build_store

    store = build_store(a.work / "store", [LAYER], cfg["experts"], cfg["expert_bytes"], seed=a.seed)
    variants = [("after" if g == 0 else f"in-flight-{g}", None, g) for g in gates]
    if a.before:
        pagein = Path(a.before_pagein) if a.before_pagein else None
        variants.append(("before", package_with_streamer(Path(a.before), a.work / "before-code", pagein), 0))
    rows = []
    for rnd in range(cfg["rounds"]):
        for variant, package, gate in (variants if rnd % 2 == 0 else variants[::-1]):
            args = dict(store=store["path"], workers=cfg["workers"], calls=cfg["calls"], per_call=cfg["per_call"],
                        slots=cfg["slots"], seed=a.seed + rnd, reads_in_flight=gate)
            env = None
            if package:  # the copy of tqbench with the older streamer, before everything else
                env = dict(PYTHONPATH=os.pathsep.join([str(package), *filter(None, [os.environ.get("PYTHONPATH")])]))
            row = dict(variant=variant, round=rnd, **run_child(SCRIPT, "page-in", args, a.timeout, env=env))
            rows.append(row)
            print(f"round {rnd} {variant:11s}: {row['gbps_on_misses']:.2f} GB/s on misses, raw "
                  f"{row['raw_gbps']:.2f} GB/s ({row['raw1_gbps']:.2f} with one thread), ratio {row['ratio']:.2f} "
                  f"({row['ratio_best_raw']:.2f} to the better raw); {row['ms_per_miss']:.1f} ms per miss against "
                  f"{row['raw_ms_per_expert']:.1f} ms raw", flush=True)
    summary = summarize(rows)
    doc = dict(schema=SCHEMA, config=cfg, quick=a.quick, before=a.before, store=store, rows=rows, summary=summary,
               machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count()),
               date=time.strftime("%Y-%m-%d"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for variant, s in summary.items():
        if isinstance(s, dict):
            print(f"{variant}: ratio {s['ratio']:.2f} (goal 0.9; {s['ratio_best_raw']:.2f} to the better raw), "
                  f"{s['ms_per_miss']:.1f} ms per miss, raw {s['raw_ms_per_expert']:.1f} ms per expert; "
                  f"{s['processes']} processes")
    if "after_over_before_ratio" in summary:
        print(f"after / before, paired by round: {summary['after_over_before_ratio']:.2f}x")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[3]))
    else:
        sys.exit(main())

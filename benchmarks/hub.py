#!/usr/bin/env python3
"""What reading a checkpoint from the hub costs, against reading the same files from a directory, on a loopback hub
(the test suite's `tests/hubserver.py`: real HTTP on 127.0.0.1, the real huggingface_hub client).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/hub.py
    python benchmarks/hub.py --quick          # a smoke run

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset.)

1. Plan: Kimi K3's layout (292 sparse shards with its real headers) planned with `tq3a-tqTe-down4-g64` from the
   directory, from the hub with an empty cache (every header fetched), and from the hub again (headers from tqbench's
   cache). Per run: seconds, bytes the server sent, peak RSS. `--plan-runs` times each, alternating.
2. Convert: the shipped demo (4 shards of ~4.6 MB) converted with tq4 into 4 MB output shards from the directory and
   from the hub (an empty Hugging Face cache each time: every shard downloaded, converted, removed), `--pairs` pairs in
   alternating order, each in a fresh process. Per run: seconds, peak RSS; for the hub also the most shard bytes that
   were in the Hugging Face cache at once (measured from the directory at every engine event) against the two largest
   shards, and whether the output equals the directory's conversion byte for byte. Loopback moves bytes at memory
   speed, so this measures what streaming adds (gating, marks, removals), not a network.

Writes JSON (`--out`, default bench-results/hub.json, schema tqbench.bench.hub/1) and prints a summary.
"""

from __future__ import annotations

import sys

from harness import REPO, add_size_options, emit, log, machine_info, median, run_child, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import hashlib  # noqa: E402

from harness import dump_json  # noqa: E402

SCHEMA = "tqbench.bench.hub/1"
RELEVANT = ("tqbench/source", "tqbench/convert", "tqbench/shards", "benchmarks/hub.py")
DEFAULTS = dict(plan_runs=3, pairs=3)
QUICK = dict(plan_runs=1, pairs=1)
PLAN_RECIPE = "tq3a-tqTe-down4-g64"
K3 = "moonshotai/Kimi-K3"
DEMO = "bench/demo"  # not a path in the repository: an existing path is always read as a directory


def model_digest(dst: Path) -> str:
    """sha256 over the converted model's files, names and bytes: all but the report and the journal, which record
    where and how the run went (the source's name, timings, the downloads)."""
    h = hashlib.sha256()
    for f in sorted(p for p in dst.iterdir() if p.is_file() and p.name not in ("convert-report.json",
                                                                             ".tqbench-convert.json")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


# --- children -----------------------------------------------------------------------------------------------------------

def child_plan(args: dict) -> None:
    from tqbench.recipe import Recipe, group_sources, make_plan
    from tqbench.source import open_checkpoint

    t0 = time.perf_counter()
    ckpt = open_checkpoint(args["source"])
    plan = make_plan(group_sources(ckpt), Recipe.parse(PLAN_RECIPE))
    emit(dict(seconds=time.perf_counter() - t0, total_bytes=plan.total_bytes,
              fetched_bytes=ckpt.origin.fetched_bytes if ckpt.origin else 0))


def child_convert(args: dict) -> None:
    from tqbench.convert import convert
    from tqbench.recipe import Recipe

    blobs = Path(args["cache"]) / "models--bench--demo" / "blobs"

    def on_disk() -> int:  # shard bytes in the Hugging Face cache now (the small files are not counted)
        total = 0
        for p in blobs.iterdir() if blobs.is_dir() else ():
            try:
                size = p.stat().st_size
            except FileNotFoundError:  # a finished download renames its partial file while we look
                continue
            total += size if size > 1_000_000 else 0
        return total

    high = 0
    t0 = time.perf_counter()
    for _ in convert(args["source"], args["dest"], Recipe.parse("tq4"), 4_000_000):
        high = max(high, on_disk())
    emit(dict(seconds=time.perf_counter() - t0, source_high_water=high))


# --- the parent ---------------------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "hub.json")
    p.add_argument("--work", type=Path, default=None, help="Work directory (default: a temporary one).")
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--no-openblas", action="store_true", help="Do not preload OpenBLAS.")
    a = p.parse_args()
    n = sizes(a, DEFAULTS, QUICK)
    work = Path(a.work or tempfile.mkdtemp(prefix="tqbench-bench-hub-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "tests"))
    from hubserver import HubServer

    from tqbench.demo import ensure_demo
    from tqbench.skeleton import write_k3_skeleton

    k3 = work / "Kimi-K3"
    if not (k3 / "config.json").is_file():
        log("writing K3's layout as sparse shards (headers only)")
        write_k3_skeleton(k3)
    demo = ensure_demo()
    shards = sorted(demo.glob("*.safetensors"))
    two_largest = sum(sorted((s.stat().st_size for s in shards), reverse=True)[:2])
    script = Path(__file__).resolve()
    result: dict = dict(schema=SCHEMA, machine=machine_info(work, RELEVANT), sizes=n)

    with HubServer() as hub:
        hub.add_repo(K3, k3)
        hub.add_repo(DEMO, demo)

        def env(name: str) -> dict:
            return dict(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(work / f"hf-{name}"), HF_HUB_DISABLE_TELEMETRY="1",
                        TQBENCH_CACHE_DIR=str(work / f"tq-{name}"), PYTHONPATH=str(REPO))

        def fresh(name: str) -> dict:
            for d in (work / f"hf-{name}", work / f"tq-{name}"):
                shutil.rmtree(d, ignore_errors=True)
            return env(name)

        plans: dict[str, list] = {"directory": [], "hub_cold": [], "hub_cached": []}
        for i in range(n["plan_runs"]):
            for kind in (("directory", "hub_cold", "hub_cached") if i % 2 == 0
                         else ("hub_cold", "hub_cached", "directory")):
                e = fresh("plan") if kind == "hub_cold" else env("plan")
                hub.reset_stats()
                r = run_child(script, "plan", dict(source=str(k3) if kind == "directory" else K3), 1800, e)
                r["server_body_bytes"] = hub.stats().body_bytes
                plans[kind].append(r)
                log(f"plan {kind}: {r['seconds']:.1f} s, {r['fetched_bytes'] / 1e6:.2f} MB fetched, "
                    f"{r['server_body_bytes'] / 1e6:.2f} MB sent, peak RSS {r['peak_rss'] / 2**20:.0f} MiB")
        result["plan"] = {k: dict(runs=v, seconds=median([r["seconds"] for r in v]),
                                  fetched_bytes=median([r["fetched_bytes"] for r in v]),
                                  server_body_bytes=median([r["server_body_bytes"] for r in v]),
                                  peak_rss=median([r["peak_rss"] for r in v])) for k, v in plans.items()}

        converts: dict[str, list] = {"directory": [], "hub": []}
        digests: dict[str, set] = {"directory": set(), "hub": set()}
        for i in range(n["pairs"]):
            for kind in (("directory", "hub") if i % 2 == 0 else ("hub", "directory")):
                dest = work / f"out-{kind}"
                shutil.rmtree(dest, ignore_errors=True)
                e = fresh("convert")
                r = run_child(script, "convert", dict(source=str(demo) if kind == "directory" else DEMO,
                                                      dest=str(dest), cache=e["HF_HUB_CACHE"]), 1800, e)
                digests[kind].add(model_digest(dest))
                converts[kind].append(r)
                log(f"convert {kind}: {r['seconds']:.1f} s, source at once {r['source_high_water'] / 1e6:.2f} MB, "
                    f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB")
        seconds = {k: median([r["seconds"] for r in v]) for k, v in converts.items()}
        result["convert"] = dict(
            runs=converts, seconds=seconds, hub_over_directory=seconds["hub"] / seconds["directory"],
            pair_ratios=[h["seconds"] / d["seconds"] for h, d in zip(converts["hub"], converts["directory"])],
            peak_rss={k: median([r["peak_rss"] for r in v]) for k, v in converts.items()},
            source_high_water=max(r["source_high_water"] for r in converts["hub"]), two_largest_shards=two_largest,
            identical_output=len(digests["directory"] | digests["hub"]) == 1)

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump_json(result))
    pl, cv = result["plan"], result["convert"]
    log(f"K3 plan: directory {pl['directory']['seconds']:.1f} s; hub cold {pl['hub_cold']['seconds']:.1f} s "
        f"({pl['hub_cold']['fetched_bytes'] / 1e6:.2f} MB fetched); hub cached {pl['hub_cached']['seconds']:.1f} s "
        f"({pl['hub_cached']['fetched_bytes'] / 1e6:.2f} MB)")
    log(f"demo convert: hub / directory {cv['hub_over_directory']:.3f}x; source on disk at most "
        f"{cv['source_high_water'] / 1e6:.2f} MB (two largest shards {two_largest / 1e6:.2f} MB); "
        f"identical output: {cv['identical_output']}")
    print(json.dumps({"plan_seconds": {k: v["seconds"] for k, v in pl.items()},
                      "hub_over_directory": cv["hub_over_directory"]}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        {"plan": child_plan, "convert": child_convert}[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        main()

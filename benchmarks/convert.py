#!/usr/bin/env python3
"""Conversion benchmark: throughput against a raw read+write baseline, and peak RSS at two model sizes.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/convert.py
    python benchmarks/convert.py --quick          # a small smoke run (about 20 s)

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset: MLX's
Linux CPU wheel ships a reference BLAS. `--no-openblas` opts out.)

What it does, all in one run on one disk (the work directory):

1. Writes seeded random Kimi-K3-layout source checkpoints (`tqbench.demo.write_source`) of two sizes that differ only in
   layer and expert counts (`--sizes LAYERSxEXPERTS,...`): every tensor has the same shape at both sizes, so a
   conversion that holds one tensor / one expert at a time must show the same peak RSS at both.
2. For each size, recipe and repeat, each in a fresh subprocess (so its peak RSS is that process's own):
   - convert: `tqbench.convert.convert` to a fresh directory; wall seconds of the conversion itself (imports excluded,
     reported separately), source bytes, output bytes, peak RSS, MLX peak memory.
   - raw: read every source shard with os.pread in 16 MiB blocks and write the same number of bytes as that
     conversion's output into one file on the same disk, fsync. conversion seconds / raw seconds is the ratio.
   - floor: import tqbench + MLX and open the source checkpoint (headers only). RSS growth due to the conversion is
     peak - floor.
   Convert and raw alternate order between repeats so a drift in the machine's speed hits both alike.
3. Before every measurement the source files are fsynced and dropped from the page cache with
   posix_fadvise(POSIX_FADV_DONTNEED) (no root needed), and the fraction still resident (mincore) is recorded.
4. Writes JSON (`--out`, default bench-results/convert.json): machine, config, every measurement, medians, the RSS
   scaling verdict; prints a table. `--profile` adds a cProfile of one conversion of the smallest model and a per-stage
   timing of a second one.
"""

from __future__ import annotations

import os
import sys

from harness import with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import drop_cache, emit, machine_info, median, peak_rss_bytes, resident_fraction, run_child  # noqa: E402

SCHEMA = "tqbench.bench.convert/1"
BLOCK = 16 * 2**20
MiB = 2**20
SCRIPT = Path(__file__).resolve()  # the children run this file

# Every tensor shape is fixed by these; the sizes vary only the layer and expert counts.
BASE_SPEC = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, routed_expert_hidden_size=256,
                 num_experts_per_token=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=256,
                 kda_num_heads=8, kda_head_dim=64, num_shards=4)
PEAK_RATIO_GOAL = 1.1  # peak RSS of a ~4x larger model over the smaller one's
DEFAULT_SIZES = "8x64,12x160"  # ~130 MB and ~420 MB of source
QUICK_SIZES = "4x16,4x48"
DEFAULT_RECIPES = "tq3a-tqTe-down4-g64,affine4,mxfp4e"
QUICK_RECIPES = "tq3a-tqTe-down4-g64,affine4"


# --- helpers shared by parent and children ---------------------------------------------------------------------------


def source_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


# --- children --------------------------------------------------------------------------------------------------------


def child_convert(a: dict) -> None:
    t0 = time.perf_counter()
    import mlx.core as mx
    from tqbench.convert import convert
    from tqbench.events import ConvertFinished, ConvertStarted, UnitConverted
    from tqbench.recipe import Recipe
    import_s = time.perf_counter() - t0
    rss_after_import = peak_rss_bytes()
    recipe = Recipe.parse(a["recipe"])
    stages = _install_stage_timers() if a.get("stages") else None
    profiler = None
    if a.get("profile"):
        import cProfile
        profiler = cProfile.Profile()
    mx.reset_peak_memory()
    started = finished = None
    units = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t1 = time.perf_counter()
    if profiler:
        profiler.enable()
    kw = {"read_ahead": a["read_ahead"]} if a.get("read_ahead") is not None else {}
    for ev in convert(a["src"], a["dst"], recipe, a["shard_size"], True, **kw):
        if isinstance(ev, UnitConverted):
            units += 1
        elif isinstance(ev, ConvertStarted):
            started = ev
        elif isinstance(ev, ConvertFinished):
            finished = ev
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - t1
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    out: dict = dict(mode="convert", recipe=recipe.name, seconds=seconds, import_s=import_s,
                     cpu_seconds=cpu, cores_busy=cpu / seconds if seconds > 0 else None,
                     rss_after_import=rss_after_import, mlx_peak_memory=mx.get_peak_memory(),
                     engine_seconds=finished.seconds, engine_bytes_in=started.bytes_in,
                     engine_bytes_out=finished.bytes_out, units=units, shards=finished.shards,
                     mean_rel_error=finished.mean_rel_error, max_rel_error=finished.max_rel_error,
                     output_bytes=tree_bytes(Path(a["dst"])))
    if profiler:
        import io
        import pstats
        profiler.dump_stats(a["profile"])
        st = pstats.Stats(profiler)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append(dict(function=f"{_short(file)}:{line}({fn})", calls=nc, tottime=tt, cumtime=ct))
        out["profile_top_tottime"] = sorted(rows, key=lambda r: -r["tottime"])[:25]
        out["profile_top_cumtime"] = sorted(rows, key=lambda r: -r["cumtime"])[:25]
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(30)
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
        Path(a["profile"]).with_suffix(".txt").write_text(buf.getvalue())
    if stages is not None:
        out["stages"] = {k: dict(seconds=v[0], calls=v[1]) for k, v in stages.items()}
    emit(out)


def _short(file: str) -> str:
    for marker in ("/tqbench/", "/mlx/", "/numpy/", "/lib/python"):
        i = file.find(marker)
        if i >= 0:
            return file[i + 1:]
    return file


def _install_stage_timers() -> dict[str, list]:
    """Wrap the conversion's stages with timers. MLX is lazy: a wrapped stage's MLX results are evaluated inside its
    timer, so the time lands on the stage that builds the graph, and for nested MLX stages their array inputs are
    evaluated before the timer starts (this splits fused work; totals stay comparable)."""
    import mlx.core as mx
    from tqbench.convert import pipeline, produce
    from tqbench.quant import turboquant as tq
    from tqbench.source import reader
    from tqbench.shards import writer

    stats: dict[str, list] = {}

    def wrap(owner, name: str, label: str, evaluate: bool = False, eval_args: bool = False) -> None:
        orig = getattr(owner, name, None)
        if orig is None:  # the engine changed: time what is still there
            stats[f"{label} [not found]"] = [0.0, 0]
            return

        def timed(*args, **kw):
            if eval_args:  # the lazy inputs' work belongs to the caller's stage, not this one
                inputs = [x for x in (*args, *kw.values()) if isinstance(x, mx.array)]
                if inputs:
                    mx.eval(*inputs)
            t = time.perf_counter()
            r = orig(*args, **kw)
            if evaluate:
                arrays = [x for x in (r if isinstance(r, (tuple, list)) else (r,)) if isinstance(x, mx.array)]
                if arrays:
                    mx.eval(*arrays)
            s = stats.setdefault(label, [0.0, 0])
            s[0] += time.perf_counter() - t
            s[1] += 1
            return r

        setattr(owner, name, timed)

    wrap(reader.ShardReader, "read_bytes", "read source bytes (pread)")
    wrap(produce.Producer, "decode", "decode source to f32 (mxfp4/bf16)", evaluate=True)
    wrap(produce.Producer, "signs", "rotation signs")
    wrap(tq, "quantize", "turboquant quantize (rotate, scales, codes, pack, error)")
    wrap(tq, "rotate", "  within it: Hadamard rotate", evaluate=True, eval_args=True)
    wrap(tq, "pack", "  within it: pack codes", evaluate=True, eval_args=True)
    wrap(mx, "quantize", "mx.quantize (affine)", evaluate=True, eval_args=True)
    wrap(mx, "dequantize", "mx.dequantize (mxfp4 decode, affine error check)", evaluate=True, eval_args=True)
    wrap(produce, "to_numpy", "to_numpy (MLX -> numpy)")
    wrap(produce.Producer, "module_outputs", "module_outputs (total per module)")
    wrap(writer.ShardWriter, "write", "ShardWriter.write (copy + sha256 + write)")
    wrap(writer.ShardWriter, "close", "ShardWriter.close (flush + fsync)")
    wrap(pipeline, "make_plan", "make_plan")
    wrap(pipeline, "file_units", "file_units")
    wrap(pipeline, "open_checkpoint", "open_checkpoint (headers)")
    wrap(pipeline, "_finish", "final step (expert map, config, report, index)")
    return stats


def child_heap(a: dict) -> None:
    """Python heap (tracemalloc) by conversion phase: resident at each phase's end and the peak within it. MLX buffers
    are not traced (they are reported by mx.get_peak_memory), so this is the metadata side of peak RSS."""
    import tracemalloc

    from tqbench.convert import convert
    from tqbench.recipe import Recipe
    tracemalloc.start(1)
    phases = []
    label = "open checkpoint + plan"
    first_unit = True
    snap = None
    for ev in convert(a["src"], a["dst"], Recipe.parse(a["recipe"]), a["shard_size"], True):
        name = type(ev).__name__
        if name == "UnitConverted" and not first_unit:
            continue
        cur, peak = tracemalloc.get_traced_memory()
        phases.append(dict(phase=label, until=name, current=cur, peak=peak))
        if name == "UnitConverted":  # what stays resident while units are converted
            snap = tracemalloc.take_snapshot()
        tracemalloc.reset_peak()
        label = {"ConvertStarted": "open first shard writer + first unit", "UnitConverted": "units + shard close",
                 "ShardWritten": "final step (expert map, config, report, index)"}.get(name, name)
        first_unit = first_unit and name != "UnitConverted"
    emit(dict(mode="heap", phases=phases,
              top_resident_during_units=[dict(where=str(st.traceback), bytes=st.size, count=st.count)
                            for st in (snap.statistics("lineno")[:12] if snap else [])]))


def child_raw(a: dict) -> None:
    files = [Path(f) for f in a["files"]]
    want = a["write_bytes"]
    buf = bytearray(BLOCK)
    mv = memoryview(buf)
    read = written = 0
    last = 0
    t0 = time.perf_counter()
    out = os.open(a["dst"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                off = 0
                while True:
                    n = os.preadv(fd, [mv], off)
                    if not n:
                        break
                    off += n
                    read += n
                    last = n
                    if written < want:
                        written += os.write(out, mv[:min(n, want - written)])
            finally:
                os.close(fd)
        while written < want:  # more output than source: write the last block again
            written += os.write(out, mv[:min(last or BLOCK, want - written)])
        os.fsync(out)
    finally:
        os.close(out)
    seconds = time.perf_counter() - t0
    os.unlink(a["dst"])
    emit(dict(mode="raw", seconds=seconds, read_bytes=read, written_bytes=written))


def child_floor(a: dict) -> None:
    t0 = time.perf_counter()
    import mlx.core  # noqa: F401
    import tqbench.convert  # noqa: F401
    from tqbench.source.opening import open_checkpoint
    import_s = time.perf_counter() - t0
    ckpt = open_checkpoint(a["src"])
    emit(dict(mode="floor", import_s=import_s, tensors=len(ckpt.tensors)))


CHILDREN = {"convert": child_convert, "raw": child_raw, "floor": child_floor, "heap": child_heap}


# --- parent ----------------------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        layers, _, experts = part.strip().lower().partition("x")
        sizes.append((int(layers), int(experts)))
    return sizes


def build_source(work: Path, layers: int, experts: int, seed: int) -> dict:
    """Write (or reuse, when its spec marker matches) the source checkpoint of one size."""
    from dataclasses import asdict

    from tqbench.demo import DemoSpec, write_source
    spec = DemoSpec(**BASE_SPEC, num_hidden_layers=layers, num_experts=experts)
    name = f"{layers}x{experts}"
    src = work / f"src-{name}"
    marker = work / f"src-{name}.spec.json"
    want = dict(spec=asdict(spec), seed=seed)
    write_s = None
    if not (src.is_dir() and marker.exists() and json.loads(marker.read_text()) == want):
        t0 = time.perf_counter()
        write_source(src, spec, seed)
        write_s = time.perf_counter() - t0
        marker.write_text(json.dumps(want))
    files = source_files(src)
    from tqbench.source.opening import open_checkpoint
    tensors = open_checkpoint(src).tensors
    tensor_bytes = sum(t.entry.nbytes for t in tensors)
    return dict(name=name, layers=layers, experts=experts, path=str(src), spec=asdict(spec), seed=seed,
                source_bytes=sum(f.stat().st_size for f in files), source_tensor_bytes=tensor_bytes,
                source_tensors=len(tensors),
                source_files=len(files), write_seconds=write_s)


def prepare_measurement(files: list[Path], drop: bool) -> dict:
    dropped = drop_cache(files) if drop else False
    return dict(cache_dropped=dropped, source_resident_before=resident_fraction(files))


def summarize(models: list[dict], recipes: list[str], ms: list[dict]) -> dict:
    rows = []
    floors = {m["name"]: median([x["peak_rss"] for x in ms if x["mode"] == "floor" and x["model"] == m["name"]])
              for m in models}
    for m in models:
        for r in recipes:
            conv = [x for x in ms if x["mode"] == "convert" and x["model"] == m["name"] and x["recipe_arg"] == r]
            raw = [x for x in ms if x["mode"] == "raw" and x["model"] == m["name"] and x["recipe_arg"] == r]
            raw_by_rep = {x["repeat"]: x for x in raw}
            ratios = [c["seconds"] / raw_by_rep[c["repeat"]]["seconds"] for c in conv if c["repeat"] in raw_by_rep]
            conv_s, raw_s = median([c["seconds"] for c in conv]), median([x["seconds"] for x in raw])
            peak = median([c["peak_rss"] for c in conv])
            src = m["source_bytes"]
            rows.append(dict(
                model=m["name"], recipe=conv[0]["recipe"], recipe_arg=r, source_bytes=src,
                source_tensor_bytes=m["source_tensor_bytes"],
                output_bytes=conv[0]["output_bytes"], engine_bytes_in=conv[0]["engine_bytes_in"],
                repeats=len(conv), convert_seconds=conv_s, convert_seconds_all=[c["seconds"] for c in conv],
                source_mb_per_s=src / conv_s / 1e6, raw_seconds=raw_s, raw_seconds_all=[x["seconds"] for x in raw],
                raw_source_mb_per_s=src / raw_s / 1e6,
                ratio_to_raw=median(ratios), ratio_to_raw_all=ratios,
                convert_process_wall_s=median([c["process_wall_s"] for c in conv]),
                import_s=median([c["import_s"] for c in conv]),
                peak_rss=peak, peak_rss_all=[c["peak_rss"] for c in conv], rss_floor=floors[m["name"]],
                rss_growth=peak - floors[m["name"]],
                mlx_peak_memory=median([c["mlx_peak_memory"] for c in conv]),
                cores_busy=median([c.get("cores_busy") for c in conv]),
                mean_rel_error=conv[0]["mean_rel_error"],
                source_resident_before_convert=median([c.get("source_resident_before") for c in conv]),
                source_resident_before_raw=median([x.get("source_resident_before") for x in raw])))
    scaling = []
    if len(models) >= 2:
        small, large = min(models, key=lambda m: m["source_bytes"]), max(models, key=lambda m: m["source_bytes"])
        size_ratio = large["source_bytes"] / small["source_bytes"]
        for r in recipes:
            a = next(x for x in rows if x["model"] == small["name"] and x["recipe_arg"] == r)
            b = next(x for x in rows if x["model"] == large["name"] and x["recipe_arg"] == r)
            ga, gb = a["rss_growth"], b["rss_growth"]
            growth_ratio = gb / ga if ga > 0 else None
            exponent = (math.log(growth_ratio) / math.log(size_ratio)
                        if growth_ratio and growth_ratio > 0 and size_ratio > 1 else None)
            grows = (gb - ga) > max(8 * MiB, 0.10 * max(ga, 0))
            scaling.append(dict(recipe=a["recipe"], small=small["name"], large=large["name"], size_ratio=size_ratio,
                                growth_small=ga, growth_large=gb, growth_ratio=growth_ratio,
                                peak_small=a["peak_rss"], peak_large=b["peak_rss"],
                                peak_ratio=b["peak_rss"] / a["peak_rss"] if a["peak_rss"] else None,
                                peak_goal=PEAK_RATIO_GOAL,
                                mlx_peak_small=a["mlx_peak_memory"], mlx_peak_large=b["mlx_peak_memory"],
                                tensors_small=small["source_tensors"], tensors_large=large["source_tensors"],
                                growth_per_extra_tensor=((gb - ga) / (large["source_tensors"] - small["source_tensors"])
                                                         if large["source_tensors"] != small["source_tensors"]
                                                         else None),
                                scaling_exponent=exponent,
                                verdict="grows with model size" if grows else "flat (does not grow with model size)",
                                rule="grows if growth_large - growth_small > max(8 MiB, 10% of growth_small); "
                                     "scaling_exponent = log(growth ratio) / log(size ratio): 0 flat, 1 proportional"))
    return dict(rows=rows, rss_scaling=scaling, rss_floor=floors)


def cache_note(ms: list[dict], drop: bool) -> str:
    res = [x.get("source_resident_before") for x in ms if x["mode"] in ("convert", "raw")]
    res = [r for r in res if r is not None]
    worst = max(res) if res else None
    if drop and worst is not None and worst < 0.05:
        return (f"Source pages were dropped from the page cache (posix_fadvise DONTNEED) before every convert and raw "
                f"measurement: at most {worst:.1%} resident at the start, so both read from the disk (on a virtual "
                f"disk the host may still cache it). Output is fsynced by both.")
    if drop:
        w = "unknown" if worst is None else f"up to {worst:.1%}"
        return (f"Tried to drop the source from the page cache before every measurement, but {w} of it was resident "
                f"at the start: reads are (partly) served from memory, for conversion and raw baseline alike.")
    return ("Page cache not dropped (--no-drop-cache): the source was just written, so it is likely in the page cache "
            "for conversion and raw baseline alike: both measure reads from memory, not the disk.")


def fmt_mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.1f}"


def fmt_mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:.0f}"


def print_table(summary: dict, note: str) -> None:
    head = (f"{'model':<8} {'recipe':<22} {'src MB':>7} {'out MB':>7} {'conv s':>7} {'MB/s':>6} {'raw s':>6} "
            f"{'ratio':>6} {'peak MiB':>8} {'floor':>6} {'growth':>6} {'MLX pk':>6}")
    print(head)
    print("-" * len(head))
    for r in summary["rows"]:
        print(f"{r['model']:<8} {r['recipe']:<22} {fmt_mb(r['source_bytes']):>7} {fmt_mb(r['output_bytes']):>7} "
              f"{r['convert_seconds']:>7.2f} {r['source_mb_per_s']:>6.1f} {r['raw_seconds']:>6.3f} "
              f"{r['ratio_to_raw']:>5.1f}x {fmt_mib(r['peak_rss']):>8} {fmt_mib(r['rss_floor']):>6} "
              f"{fmt_mib(r['rss_growth']):>6} {fmt_mib(r['mlx_peak_memory']):>6}")
    print()
    for s in summary["rss_scaling"]:
        exp = "-" if s["scaling_exponent"] is None else f"{s['scaling_exponent']:.2f}"
        gr = "-" if s["growth_ratio"] is None else f"{s['growth_ratio']:.2f}"
        print(f"RSS growth {s['recipe']}: {fmt_mib(s['growth_small'])} MiB at {s['small']} -> "
              f"{fmt_mib(s['growth_large'])} MiB at {s['large']} (x{gr} for x{s['size_ratio']:.2f} the source; "
              f"exponent {exp}): {s['verdict']}; MLX peak {fmt_mib(s['mlx_peak_small'])} -> "
              f"{fmt_mib(s['mlx_peak_large'])} MiB; {s['tensors_small']} -> {s['tensors_large']} source tensors"
              + ("" if s["growth_per_extra_tensor"] is None
                 else f" ({s['growth_per_extra_tensor'] / 1024:.1f} KiB of growth per extra tensor)"))
        if s["peak_ratio"] is not None:
            met = "meets" if s["peak_ratio"] <= PEAK_RATIO_GOAL else "misses"
            print(f"peak RSS {s['recipe']}: {fmt_mib(s['peak_small'])} -> {fmt_mib(s['peak_large'])} MiB, "
                  f"x{s['peak_ratio']:.3f} for x{s['size_ratio']:.2f} the source ({met} the goal <= {PEAK_RATIO_GOAL})")
    print()
    print("ratio = conversion seconds / raw seconds (read the source + write the output's bytes + fsync), median of "
          "per-repeat pairs; MB/s = source MB / conversion seconds; growth = peak RSS - floor (import + open headers); "
          "MLX pk = mx.get_peak_memory() (tensor data held by MLX).")
    print(note)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help=f"model sizes as LAYERSxEXPERTS, comma-separated (default {DEFAULT_SIZES}; "
                                   f"other dimensions fixed: {BASE_SPEC})")
    p.add_argument("--recipes", help=f"comma-separated recipe names (default {DEFAULT_RECIPES})")
    p.add_argument("--repeats", type=int, help="measurements per size and recipe (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: sizes {QUICK_SIZES}, recipes {QUICK_RECIPES}, "
                                                        "1 repeat")
    p.add_argument("--work", type=Path, help="work directory for sources and outputs (default: a temporary directory, "
                                             "removed afterwards; a given one is kept and its sources reused)")
    p.add_argument("--out", type=Path, default=Path("bench-results/convert.json"), help="JSON result file")
    p.add_argument("--shard-size", default="5GiB", help="output shard size (default 5GiB)")
    p.add_argument("--seed", type=int, default=0, help="source weights seed")
    p.add_argument("--no-drop-cache", action="store_true", help="leave the source in the page cache")
    p.add_argument("--profile", action="store_true", help="also cProfile one conversion of the smallest model with "
                                                          "the first recipe, and time its stages in another run")
    p.add_argument("--raw-runs", type=int, default=3, help="raw baseline runs per repeat (their median is the "
                                                              "repeat's baseline; default 3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)

    sizes = parse_sizes(a.sizes or (QUICK_SIZES if a.quick else DEFAULT_SIZES))
    recipes = [r.strip() for r in (a.recipes or (QUICK_RECIPES if a.quick else DEFAULT_RECIPES)).split(",")]
    repeats = a.repeats or (1 if a.quick else 3)
    drop = not a.no_drop_cache
    from tqbench.recipe import Recipe
    from tqbench.recipe.fit import parse_size
    for r in recipes:
        Recipe.parse(r)  # fail early on a bad name
    shard_size = parse_size(a.shard_size)

    tmp = a.work is None
    work = Path(tempfile.mkdtemp(prefix="tqbench-bench-convert-")) if tmp else a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    doc: dict = dict(schema=SCHEMA, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=[sys.executable, *sys.argv],
                     machine=machine_info(work),
                     config=dict(sizes=[f"{l}x{e}" for l, e in sizes], recipes=recipes, repeats=repeats,
                                 shard_size=shard_size, drop_cache=drop, base_spec=BASE_SPEC, seed=a.seed,
                                 raw_block_bytes=BLOCK))
    ms: list[dict] = []
    try:
        models = []
        for layers, experts in sizes:
            print(f"source {layers}x{experts} ...", end=" ", flush=True)
            m = build_source(work, layers, experts, a.seed)
            models.append(m)
            print(f"{m['source_bytes'] / 1e6:.1f} MB" + (f" written in {m['write_seconds']:.1f}s"
                                                          if m["write_seconds"] else " (reused)"), flush=True)
        out_bytes: dict[tuple[str, str], int] = {}
        for rep in range(repeats):
            for m in models:
                files = source_files(Path(m["path"]))
                x = run_child(SCRIPT, "floor", dict(src=m["path"]), a.timeout)
                x.update(model=m["name"], repeat=rep)
                ms.append(x)
                for r in recipes:
                    key = (m["name"], r)
                    order = ["convert", "raw"] if rep % 2 == 0 or key not in out_bytes else ["raw", "convert"]
                    for mode in order:
                        if mode == "convert":
                            dst = work / f"out-{m['name']}-{r}"
                            shutil.rmtree(dst, ignore_errors=True)
                            pre = prepare_measurement(files, drop)
                            x = run_child(SCRIPT, "convert", dict(src=m["path"], dst=str(dst), recipe=r,
                                                                  shard_size=shard_size), a.timeout)
                            out_bytes[key] = x["output_bytes"]
                            shutil.rmtree(dst, ignore_errors=True)
                        else:
                            runs = []
                            for _ in range(a.raw_runs):
                                pre = prepare_measurement(files, drop)
                                y = run_child(SCRIPT, "raw", dict(files=[str(f) for f in files],
                                                                  write_bytes=out_bytes[key],
                                                                  dst=str(work / "raw-copy.bin")), a.timeout)
                                y.update(pre)
                                runs.append(y)
                            x = dict(sorted(runs, key=lambda y: y["seconds"])[len(runs) // 2])  # the median run
                            x["runs_seconds"] = [y["seconds"] for y in runs]
                            pre = dict(source_resident_before=max(y["source_resident_before"] or 0 for y in runs)
                                       if all(y["source_resident_before"] is not None for y in runs) else None,
                                       cache_dropped=all(y["cache_dropped"] for y in runs))
                        x.update(pre, model=m["name"], recipe_arg=r, repeat=rep)
                        ms.append(x)
                    c = next(y for y in reversed(ms) if y["mode"] == "convert" and y["model"] == m["name"]
                             and y["recipe_arg"] == r)
                    w = next(y for y in reversed(ms) if y["mode"] == "raw" and y["model"] == m["name"]
                             and y["recipe_arg"] == r)
                    print(f"  [{rep + 1}/{repeats}] {m['name']:<8} {r:<22} convert {c['seconds']:6.2f}s "
                          f"({m['source_bytes'] / c['seconds'] / 1e6:5.1f} MB/s, peak {c['peak_rss'] / MiB:.0f} MiB)"
                          f"  raw {w['seconds']:.3f}s  ratio {c['seconds'] / w['seconds']:.1f}x", flush=True)
        summary = summarize(models, recipes, ms)
        note = cache_note(ms, drop)
        doc.update(models=models, measurements=ms, summary=summary, page_cache_note=note)
        for r in summary["rows"]:
            if r["engine_bytes_in"] != r["source_tensor_bytes"]:
                doc.setdefault("notes", []).append(
                    f"{r['model']} {r['recipe']}: the engine reports bytes_in={r['engine_bytes_in']} "
                    f"({r['engine_bytes_in'] / r['source_tensor_bytes']:.2f}x the source's {r['source_tensor_bytes']} "
                    f"tensor bytes); MB/s here uses the source file bytes")
        if a.profile:
            m, r = min(models, key=lambda m: m["source_bytes"]), recipes[0]
            prof = a.out.with_name(a.out.stem + "-profile.prof")
            prof.parent.mkdir(parents=True, exist_ok=True)
            print(f"profiling {m['name']} {r} ...", flush=True)
            dst = work / "out-profile"
            shutil.rmtree(dst, ignore_errors=True)
            x = run_child(SCRIPT, "convert", dict(src=m["path"], dst=str(dst), recipe=r, shard_size=shard_size,
                                                  profile=str(prof)), a.timeout)
            shutil.rmtree(dst, ignore_errors=True)
            stages = {}
            for rr in recipes:
                y = run_child(SCRIPT, "convert", dict(src=m["path"], dst=str(dst), recipe=rr, shard_size=shard_size,
                                                      stages=True), a.timeout)
                shutil.rmtree(dst, ignore_errors=True)
                stages[y["recipe"]] = dict(run_seconds=y["seconds"], stages=y["stages"])
            heap = {}
            for mm in sorted({min(models, key=lambda m: m["source_bytes"])["name"]: None,
                              max(models, key=lambda m: m["source_bytes"])["name"]: None}):
                src_m = next(z for z in models if z["name"] == mm)
                print(f"python heap by phase {mm} {r} ...", flush=True)
                h = run_child(SCRIPT, "heap", dict(src=src_m["path"], dst=str(dst), recipe=r, shard_size=shard_size),
                              a.timeout)
                shutil.rmtree(dst, ignore_errors=True)
                heap[mm] = dict(phases=h["phases"], top_resident_during_units=h["top_resident_during_units"],
                                source_tensors=src_m["source_tensors"])
            doc["profile"] = dict(model=m["name"], recipe=r, prof_file=str(prof),
                                  text_file=str(prof.with_suffix(".txt")),
                                  cprofile_seconds=x["seconds"], top_tottime=x["profile_top_tottime"],
                                  top_cumtime=x["profile_top_cumtime"], stages=stages, python_heap=heap,
                                  note="cProfile does not see MLX's nanobind calls: their time (including lazy "
                                       "evaluation) lands on the calling Python function's tottime. 'stages' times "
                                       "wrapped functions in a separate run, evaluating their MLX results inside the "
                                       "timer; stages nest (module_outputs contains decode and quantize).")
        end = machine_info(work)
        doc["machine"]["git_commit_end"], doc["machine"]["git_dirty_end"] = end.get("git_commit"), end.get("git_dirty")
        if end.get("git_commit") != doc["machine"].get("git_commit"):
            doc.setdefault("notes", []).append(
                f"the repository moved from {doc['machine'].get('git_commit')} to {end.get('git_commit')} during the "
                f"run: measurements may mix engine versions; run again")
        doc["total_seconds"] = time.perf_counter() - t_start
    finally:
        if tmp:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for d in work.glob("out-*"):
                shutil.rmtree(d, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print_table(doc["summary"], doc["page_cache_note"])
    for n in doc.get("notes", []):
        print("note:", n)
    if "profile" in doc:
        pr = doc["profile"]
        for rname, st in pr["stages"].items():
            print(f"\nstages ({pr['model']} {rname}, {st['run_seconds']:.2f}s with stage timers; nested, top 8):")
            for k, v in sorted(st["stages"].items(), key=lambda kv: -kv[1]["seconds"])[:8]:
                print(f"  {v['seconds']:7.2f}s {v['calls']:6d}x  {k}")
        print(f"  cProfile of {pr['recipe']}: {pr['text_file']}")
        for mname, h in pr["python_heap"].items():
            print(f"\npython heap by phase ({mname} {pr['recipe']}; MiB resident at the end / peak within):")
            for ph in h["phases"]:
                print(f"  {ph['current'] / MiB:6.1f} / {ph['peak'] / MiB:6.1f}  {ph['phase']}")
    print(f"\nwrote {a.out} ({doc['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        sys.exit(main())

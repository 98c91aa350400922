"""`tqbench plan`: exact converted sizes of one or more recipes side by side, and whether each fits this machine.

Registered in main.py with `app.command()(plan)`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from tqbench import units
from tqbench.cli import options
from tqbench.cli.render import hub_line, show
from tqbench.distributed.split import split_lines, split_plan
from tqbench.errors import ExitCode, TqbenchError
from tqbench.machine import GB, Machine, cached_disk_speed, disk_speed, machine
from tqbench.recipe.fit import Fit, PrefillBound, assess, parse_size, prefill_bound
from tqbench.recipe.plan import SCHEMA, Plan, group_sources, make_plan
from tqbench.recipe.recipe import Recipe, RecipeError, RecipeFlags
from tqbench.recipe.report import PlanReport, plan_report
from tqbench.source.checkpoint import HubOrigin
from tqbench.source.hub.disk import HubDisk, hub_disk

_out = Console(highlight=False, soft_wrap=False)


class Platform(str, Enum):
    darwin = "darwin"
    linux = "linux"


@options.takes(flags=options.RECIPE_FLAGS)
def plan(
    src: Annotated[Path, typer.Argument(metavar="SRC", help="Source checkpoint directory (safetensors shards + "
                                        "config.json), or a hub repository: owner/name[@revision].")],
    recipe: Annotated[Optional[list[str]], typer.Option(
        "--recipe", "-r", metavar="NAME",
        help="A recipe name, e.g. tq3a-tqTe-down4-g64 (repeat to compare side by side).")] = None,
    flags: RecipeFlags = options.FROM_OPTIONS,
    memory: Annotated[Optional[str], typer.Option(
        metavar="SIZE", help="Memory to plan for, e.g. 512GB or 64GiB (default: this machine's RAM).")] = None,
    gpu_limit: Annotated[Optional[str], typer.Option(
        metavar="SIZE", help="GPU working-set limit now, e.g. 512000MiB (default: estimated from --memory).")] = None,
    platform: Annotated[Optional[Platform], typer.Option(help="Platform planned for (default: this one).")] = None,
    disk_gbps: Annotated[Optional[float], typer.Option(
        callback=options.positive,
        help="Disk read bandwidth in GB/s (default: measured once per disk and cached).")] = None,
    hit_rate: Annotated[Optional[float], typer.Option(
        min=0.0, max=1.0,
        help="Expert-cache hit rate 0..1 for the tok/s ceiling (default: the cached fraction of experts).")] = None,
    reduced_k: Annotated[Optional[int], typer.Option(
        min=1, help="Reduced experts per token (default: half of top-k).")] = None,
    shard_size: options.ShardSize = "5GiB",
    tensors: Annotated[Optional[str], typer.Option(
        metavar="GLOB", help="List planned output tensors of modules matching GLOB, e.g. '*layers.3.*'.")] = None,
    limit: Annotated[int, typer.Option(min=0, help="Rows of the tensor table (JSON lists all).")] = 50,
    machines: Annotated[int, typer.Option(
        min=1, help="Plan for N machines of this size running the model as a pipeline (mlx.launch): each one's "
                    "layers, what it holds and streams, bytes per token and the disk-bound ceiling.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON (stable schema) on stdout.")] = False,
) -> None:
    """Preview the exact converted size of recipes, from shard headers only, and whether each fits.

    Recipes: each --recipe NAME, plus one built from the recipe flags (--bits, -g, --ternary-experts, ...) when any
    is given; with neither, tq3-g64. Exits 1 on a bad recipe or size, 3 when shards are missing.
    """
    err = Console(stderr=True, highlight=False)
    try:
        recipes = recipes_from(recipe, flags)
        shard_bytes = parse_size(shard_size)
        m = machine(parse_size(memory) if memory else None, parse_size(gpu_limit) if gpu_limit else None,
                    platform.value if platform else None, disk_gbps * GB if disk_gbps is not None else None)
        from tqbench.source import open_checkpoint

        if err.is_terminal:
            with err.status(f"reading shard headers of {src}"):
                ckpt = open_checkpoint(src)
        else:
            ckpt = open_checkpoint(src)
        sources = group_sources(ckpt)
        plans = [make_plan(sources, r, shard_bytes) for r in recipes]
        fits = [assess(p.footprint, m, hit_rate, reduced_k) for p in plans]
        if disk_gbps is None:
            m = _measured(m, ckpt.path, err)
            fits = [assess(p.footprint, m, hit_rate, reduced_k) for p in plans]
        hub = hub_disk(ckpt) if ckpt.origin else None
        splits = [split_plan(p, m, machines, hit_rate) for p in plans] if machines > 1 else None
    except TqbenchError as e:
        print(f"tqbench: error: {e}", file=sys.stderr)  # one line, never wrapped
        raise typer.Exit(e.exit_code) from None

    prefill = prefill_bound(ckpt.config.raw) if plans[0].footprint.is_moe else None
    if as_json:
        doc = plan_document(plans, fits, m, tensors=tensors, origin=ckpt.origin, hub=hub, prefill=prefill)
        for entry, s in zip(doc["plans"], splits or []):
            entry["split"] = s.to_dict()
        print(json.dumps(doc, indent=2))
    else:
        show(_out, _header(plans[0], m, ckpt.origin), plan_table(plans, fits, hub))
        if prefill is not None:
            show(_out, Text(prefill_line(prefill)))
        for p, s in zip(plans, splits or []):
            show(_out, *(Text(line) for line in split_lines(p.recipe.name, s)))
        for p in plans:
            for w in p.warnings:
                show(_out, Text(f"{p.recipe.name}: {w}", style="yellow"))
        if tensors:
            for p in plans:
                show(_out, tensor_table(p, tensors, limit))
    if ckpt.missing:
        print(f"tqbench: {src}: incomplete checkpoint: {len(ckpt.missing)} shard(s) missing; sizes undercount",
              file=sys.stderr)
        raise typer.Exit(ExitCode.INCOMPLETE)


def prefill_line(b: PrefillBound) -> str:
    return (f"long prompts, experts streamed: layer by layer, each routed expert read once per {b.window_tokens:,} "
            f"prompt tokens, holding about {units.gb(b.window_bytes)} for a window ({units.gb(b.bytes_per_token)} "
            f"of activations a token, and the chunks' attention masks)")


def recipes_from(names: list[str] | None, flags: RecipeFlags) -> list[Recipe]:
    """The named recipes, then one from the flags when any flag was given (or nothing was named). `--calibrate`
    alone also applies to the named recipes (`-r tq3-g64 --calibrate` is tq3-g64-cal)."""
    recipes = [Recipe.parse(n) for n in names or []]
    if replace(flags, calibrate=False).given or not recipes:
        recipes.append(flags.recipe())
    if flags.calibrate:
        try:
            recipes = [replace(r, calibrate=True) for r in recipes]
        except RecipeError as e:
            raise RecipeError(f"--calibrate: {e.message}") from None
    return recipes


def _measured(m: Machine, src: Path, err: Console) -> Machine:
    """The checkpoint's disk's bandwidth, the figure the TUI and chat show for that disk too
    (tqbench.machine.disk_speed: measured once per disk, cached)."""
    try:
        if err.is_terminal and cached_disk_speed(src) is None:
            with err.status("measuring disk read bandwidth (once per disk)"):
                speed = disk_speed(src)
        else:
            speed = disk_speed(src)
    except OSError as e:
        return Machine(memory_bytes=m.memory_bytes, gpu_limit_bytes=m.gpu_limit_bytes,
                       raisable_limit_bytes=m.raisable_limit_bytes, platform=m.platform, disk_bytes_per_s=None,
                       disk_source=f"measurement failed: {e.strerror or e}")
    return Machine(memory_bytes=m.memory_bytes, gpu_limit_bytes=m.gpu_limit_bytes,
                   raisable_limit_bytes=m.raisable_limit_bytes, platform=m.platform, disk_bytes_per_s=speed.bytes_per_s,
                   disk_source=speed.source)


# --- JSON --------------------------------------------------------------------------------------------------------

def plan_document(plans: list[Plan], fits: list[Fit], m: Machine, tensors: str | None = None,
                  origin: HubOrigin | None = None, hub: HubDisk | None = None,
                  prefill: PrefillBound | None = None) -> dict:
    """The `--json` document (schema tqbench.plan/1); `hub` and `disk_from_hub` only for a source on the hub;
    `prefill` (a MoE model): how its long prompts run when its experts stream."""
    doc = {
        "schema": SCHEMA,
        "source": plans[0].path,
        "model_type": plans[0].model_type,
        "machine": {"memory_bytes": m.memory_bytes, "gpu_limit_bytes": m.gpu_limit_bytes,
                    "raisable_limit_bytes": m.raisable_limit_bytes, "platform": m.platform,
                    "disk_bytes_per_s": m.disk_bytes_per_s, "disk_source": m.disk_source},
        "plans": [],
    }
    if origin is not None:
        doc["hub"] = asdict(origin)
    if prefill is not None:
        doc["prefill"] = prefill.to_dict()
    for p, f in zip(plans, fits):
        entry = {**p.to_dict(), "fit": f.to_dict()}
        if hub is not None:
            entry["disk_from_hub"] = {"output_bytes": p.total_bytes, "source_window_bytes": hub.window,
                                      "total_bytes": p.total_bytes + hub.window, "free_bytes": hub.free,
                                      "free_at": hub.cache_dir}
        if tensors:
            entry["tensors_matching"] = tensors
            entry["tensors"] = [mp.to_dict() for mp in p.select(tensors)]
        doc["plans"].append(entry)
    return doc


# --- tables ------------------------------------------------------------------------------------------------------

def _pair(n: int) -> str:
    return f"{units.gb(n)} / {units.gib(n)}"


def _header(p: Plan, m: Machine, origin: HubOrigin | None = None) -> Group:
    speed = "-" if m.disk_bytes_per_s is None else units.bandwidth(m.disk_bytes_per_s)
    disk = f"{speed} ({m.disk_source})"
    limit = _pair(m.gpu_limit_bytes)
    extra = [hub_line(origin)] if origin is not None else []
    source = [("source  ", "bold"), p.path, ("   model  ", "bold"), p.model_type, ("   params  ", "bold"),
              units.count(p.params), ("   on disk  ", "bold"), _pair(p.source_bytes)]
    return Group(*extra,
        Text.assemble(*source),
        Text.assemble(("machine ", "bold"), f"{m.platform}, memory {_pair(m.memory_bytes)}, GPU limit {limit}, "
                                            f"disk {disk}"),
    )


def plan_table(plans: list[Plan], fits: list[Fit], hub: HubDisk | None = None) -> Table:
    """Recipes side by side, one column each: the rows of tqbench.recipe.report, as the TUI shows them too."""
    return report_table(plan_report(plans, fits, hub))


def report_table(report: PlanReport) -> Table:
    t = Table(title=report.title, title_justify="left")
    t.add_column("", style="bold", no_wrap=True)
    for name in report.recipes:
        t.add_column(name, justify="right", overflow="fold")
    for r in report.rows:
        t.add_row(r.label, *r.cells, end_section=r.section_end)
    if report.notes:
        t.caption = ". ".join(report.notes)
    return t


def tensor_table(p: Plan, pattern: str, limit: int) -> Table:
    """One recipe's planned output tensors for the modules matching a glob."""
    selected = p.select(pattern)
    t = Table(title=f"{p.recipe.name}: modules matching {pattern!r} ({len(selected):,})", title_justify="left")
    for c in ("output tensor", "dtype", "shape", "size", "choice (source)"):
        t.add_column(c, justify="right" if c == "size" else "left", overflow="fold")
    for mp in selected[:limit]:
        s = mp.source
        src = (f"{mp.choice.label} ({'x'.join(map(str, s.shape)) if s.shape else '-'} {s.format}"
               + (f", {s.experts} experts" if s.experts else "") + ")")
        for i, o in enumerate(mp.outputs):
            t.add_row(o.name, o.dtype, "x".join(map(str, o.shape)), units.gb(o.nbytes), src if i == 0 else "",
                      end_section=i == len(mp.outputs) - 1)
    if len(selected) > limit:
        t.caption = f"{len(selected) - limit:,} more modules (raise --limit, or use --json)"
    return t

"""The plan report: recipes side by side as rows of text, the one model both faces show.

`plan_report(plans, fits)` turns plans and their fits into rows (a key, a label, one cell string per recipe, section
breaks and ordering hints). `tqbench plan` prints them as a table (rich on a terminal, plain aligned lines when
piped); the TUI's Recipe screen shows the same rows, reordered so that what decides between recipes fits 80x24
(`Row.primary` first). Neither face formats a number itself.

Formats: sizes as decimal over binary units (`4.30 MB` over `4.10 MiB`: tqbench.units, whose unit follows the size),
bits per weight to 3 decimals, disk-bound tokens per second to about three significant digits (`>10k` above ten
thousand: the disk is then no limit worth a number; `not disk-bound` when nothing is read from disk). Cells hold
several lines joined by newlines; a face that needs one line joins them with " / ".
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench import units
from tqbench.recipe.fit import Fit
from tqbench.source.hub.disk import HubDisk
from tqbench.recipe.plan import Plan

BPW_ROLES = ("attention", "routed_expert", "shared_expert")
SIZES = "decimal over binary units"  # how the size cells read: the first line 10^3-based, the second 2^10-based
NOT_DISK_BOUND = "not disk-bound"
FAST = 10_000  # tok/s above which the ceiling is shown as ">10k"


@dataclass(frozen=True, kw_only=True)
class Row:
    key: str  # stable: `total`, `bpw attention`, `max tok/s top-k`, ... (the label may carry numbers)
    label: str  # as the CLI shows it, e.g. `max tok/s top-16`, `  attention` (indented under its parent)
    cells: tuple[str, ...]  # one per recipe, lines joined by "\n"
    section_end: bool = False  # a section break follows this row
    primary: bool = False  # decides between recipes (sizes, bpw, page, shards, verdict, cache, tok/s): shown first
    parent: str | None = None  # the key of the row this one details (bits per weight by role: `bits/weight`)
    short_label: str | None = None  # the label where a narrow face says the rest elsewhere (`shards`)


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    recipes: tuple[str, ...]  # the recipes' names, one per cell of a row
    rows: tuple[Row, ...]  # in the CLI's order
    shard_size: int
    title: str
    notes: tuple[str, ...]  # what the table's abbreviations mean (the CLI's caption)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def cells(self, recipe: int) -> dict[str, str]:
        """One recipe's column: row key -> cell."""
        return {r.key: r.cells[recipe] for r in self.rows}

    @property
    def primary_first(self) -> tuple[Row, ...]:
        """The rows that decide between recipes, then the details (each group in the CLI's order)."""
        return tuple(r for r in self.rows if r.primary) + tuple(r for r in self.rows if not r.primary)


# --- cells -----------------------------------------------------------------------------------------------------------

def size_cell(n: int | None) -> str:
    """`4.30 MB` over `4.10 MiB`; `-` for none."""
    return "-" if n is None else f"{units.gb(n)}\n{units.gib(n)}"


def bpw_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def rate_cell(x: float | None, fit: Fit) -> str:
    """A disk-bound ceiling in tokens per second, to about three significant digits."""
    if x is None:
        # A hit rate of 1: every expert is in memory. Otherwise no bandwidth is known, or the model does not fit.
        return NOT_DISK_BOUND if fit.hit_rate is not None and fit.hit_rate >= 1.0 else "-"
    if x >= FAST:
        return f">{FAST // 1000}k"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.2g}"


def page_cell(p: Plan) -> str:
    """One expert's page, then by projection."""
    e = p.experts
    if e is None:
        return "-"
    return "\n".join([units.gb(e.bytes_per_expert), *(f"{k} {units.gb(v)}" for k, v in e.page_by_projection.items())])


def role_bpw(p: Plan, role: str) -> float | None:
    return next((r.bits_per_weight for r in p.by_role if r.role == role), None)


# --- the report ------------------------------------------------------------------------------------------------------

def plan_report(plans: list[Plan], fits: list[Fit], hub: HubDisk | None = None) -> PlanReport:
    """The rows of recipes side by side (one plan and its fit per recipe, all for one source and machine). `hub`:
    the source is on the hub, and converting it streams its shards (the disk that needs is shown)."""
    if len(plans) != len(fits) or not plans:
        raise ValueError("one fit per plan, at least one plan")
    rows: list[Row] = []

    def row(key: str, cells: list[str], label: str | None = None, **kw) -> None:
        rows.append(Row(key=key, label=label or key, cells=tuple(cells), **kw))

    moe = any(p.experts for p in plans)
    row("resident", [size_cell(p.resident_bytes) for p in plans], primary=True)
    if moe:
        row("routed experts", [size_cell(p.streamed_bytes) for p in plans], primary=True)
    row("total", [size_cell(p.total_bytes) for p in plans], primary=True, section_end=True)
    row("bits/weight", [bpw_cell(p.bits_per_weight) for p in plans], primary=True)
    for role in BPW_ROLES:
        values = [role_bpw(p, role) for p in plans]
        if any(v is not None for v in values):
            row(f"bpw {role}", [bpw_cell(v) for v in values], f"  {role.replace('_', ' ')}", parent="bits/weight")
    if moe:
        row("expert page", [page_cell(p) for p in plans], primary=True)
    row("kept at source", [units.gb(sum(k.bytes for k in p.kept)) for p in plans])
    row("shards", [str(p.shards) for p in plans], f"shards <= {units.gib(plans[0].shard_size)}", primary=True,
        section_end=True, short_label="shards")
    if hub is not None:
        need = [p.total_bytes + hub.window for p in plans]
        row("disk from hub", [size_cell(n) for n in need], "disk to convert", primary=True)
        row("disk free", [("ok: " if n <= hub.free else "too little: ") + units.gb(hub.free) for n in need],
            "  free now", parent="disk from hub", section_end=True)
    row("verdict", [f.verdict.value for f in fits], primary=True)
    if any(f.command for f in fits):
        row("raise the limit", [f.command or "-" for f in fits], primary=True)
    notes = []
    if moe:
        top, reduced = fits[0].top_k, fits[0].reduced_k
        row("cache budget", [size_cell(f.cache_budget_bytes) for f in fits], primary=True)
        row("experts/token top-k", [units.gb(f.bytes_per_token) for f in fits], f"experts/token top-{top}")
        row("experts/token reduced", [units.gb(f.bytes_per_token_reduced) for f in fits],
            f"experts/token top-{reduced}")
        row("hit rate", ["-" if f.hit_rate is None else f"{f.hit_rate:.1%}" for f in fits])
        row("max tok/s top-k", [rate_cell(f.tok_s_ceiling, f) for f in fits], f"max tok/s top-{top}", primary=True)
        row("max tok/s reduced", [rate_cell(f.tok_s_ceiling_reduced, f) for f in fits], f"max tok/s top-{reduced}",
            primary=True)
        sources = sorted({f.hit_rate_source for f in fits if f.hit_rate is not None})
        if sources:
            notes.append(f"hit rate: {'; '.join(sources)}")
        notes.append("max tok/s: the disk-bound ceiling, bandwidth / (MoE layers x K x expert page x (1 - hit rate)); "
                     f"{NOT_DISK_BOUND}: every expert is in memory; '-': no disk bandwidth known, or it does not fit")
    if hub is not None:
        notes.append(f"disk to convert: straight from the hub, the output plus at most two source shards at once "
                     f"({units.gb(hub.window)}), each removed once converted; free space of {hub.cache_dir}")
    return PlanReport(recipes=tuple(p.recipe.name for p in plans), rows=tuple(rows), shard_size=plans[0].shard_size,
                      title=f"plan (sizes in {SIZES})", notes=tuple(notes))

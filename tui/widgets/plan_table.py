"""Recipes side by side: the current recipe and up to three pinned ones, one column each.

The rows and their formatting are `tqbench plan`'s (tqbench/cli/plan.py: sizes as GB over GiB through tqbench.units,
bits per weight to 3 decimals, tok/s to 2). Only the order differs: what decides a recipe (sizes, bpw, expert page,
shards, verdict, cache budget, tok/s ceilings) comes first so that it fits 80x24; per-role bits, kept bytes, expert
bytes per token and the hit rate follow. The table's column cursor selects a pinned recipe (to unpin or edit it).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from tqbench import units
from tqbench.recipe.fit import Fit, Verdict
from tqbench.recipe.plan import Plan
from tui.widgets.cells import cell, num

VERDICT_STYLE = {
    Verdict.RESIDENT: "bold green",
    Verdict.RESIDENT_RAISED: "bold cyan",
    Verdict.STREAMING: "bold yellow",
    Verdict.NO_FIT: "bold red",
}
VERDICT_WIDTH = 15  # `resident after raising the GPU wired limit` wraps to three lines
NAME_WIDTH = 12  # recipe names wrap at dashes in the column headers, on at most NAME_LINES lines
NAME_LINES = 3
LABEL_WIDTH = 16  # longer labels (`experts/token top-16`) wrap, so that the current recipe and a pin fit 80 columns
CURRENT = "current"


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    cells: tuple[Text, ...]

    @property
    def height(self) -> int:
        return max([self.label.count("\n") + 1, *(c.plain.count("\n") + 1 for c in self.cells)])


def _both(n: int | None) -> str:
    return "-" if n is None else f"{units.gb(n)}\n{units.gib(n)}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _page(p: Plan) -> str:
    e = p.experts
    if e is None:
        return "-"
    return "\n".join([units.gb(e.bytes_per_expert), *(f"{k} {units.gb(v)}" for k, v in e.page_by_projection.items())])


def _command(command: str | None) -> str:
    return "-" if not command else command.replace(" iogpu.", "\niogpu.").replace("=", "=\n")


def verdict_cell(fit: Fit) -> Text:
    return num("\n".join(textwrap.wrap(fit.verdict.value, VERDICT_WIDTH)), VERDICT_STYLE[fit.verdict])


def plan_rows(plans: list[Plan], fits: list[Fit]) -> list[Row]:
    """The table's rows for recipes side by side (labels and cell text as the CLI's plan table)."""
    rows: list[Row] = []

    def row(key: str, values: list[str | Text], label: str | None = None) -> None:
        label = label or key
        if len(label) > LABEL_WIDTH:
            label = "\n".join(textwrap.wrap(label, LABEL_WIDTH))
        rows.append(Row(key, label, tuple(v if isinstance(v, Text) else num(v) for v in values)))

    moe = any(p.experts for p in plans)
    row("resident", [_both(p.resident_bytes) for p in plans])
    if moe:
        row("routed experts", [_both(p.streamed_bytes) for p in plans])
    row("total", [_both(p.total_bytes) for p in plans])
    row("bits/weight", [f"{p.bits_per_weight:.3f}" if p.bits_per_weight else "-" for p in plans])
    if moe:
        row("expert page", [_page(p) for p in plans])
    row("shards", [str(p.shards) for p in plans])  # of at most the shard size: see the label column's header
    row("verdict", [verdict_cell(f) for f in fits])
    if any(f.command for f in fits):
        row("raise the limit", [_command(f.command) for f in fits])
    if moe:
        row("cache budget", [_both(f.cache_budget_bytes) for f in fits])
        row("max tok/s top-k", [_rate(f.tok_s_ceiling) for f in fits], f"max tok/s top-{fits[0].top_k}")
        row("max tok/s reduced", [_rate(f.tok_s_ceiling_reduced) for f in fits], f"max tok/s top-{fits[0].reduced_k}")
    by_role = []
    for role in ("attention", "routed_expert", "shared_expert"):
        vals = [next((r.bits_per_weight for r in p.by_role if r.role == role), None) for p in plans]
        if any(v is not None for v in vals):
            by_role.append((role, vals))
    if by_role:
        row("bpw by role", ["" for _ in plans])  # the CLI indents these under bits/weight
    for role, vals in by_role:
        row(f"bpw {role}", ["-" if v is None else f"{v:.3f}" for v in vals], f"  {role.replace('_', ' ')}")
    row("kept at source", [units.gb(sum(k.bytes for k in p.kept)) for p in plans])
    if moe:
        row("experts/token top-k", [units.gb(f.bytes_per_token) for f in fits], f"experts/token top-{fits[0].top_k}")
        row("experts/token reduced", [units.gb(f.bytes_per_token_reduced) for f in fits],
            f"experts/token top-{fits[0].reduced_k}")
        row("hit rate", ["-" if f.hit_rate is None else f"{f.hit_rate:.1%}" for f in fits])
    return rows


def label_header(shard_size: int) -> str:
    """The label column's header: the units of sizes and the shard size (the CLI says both in its title and label)."""
    return f"sizes in\nGB over GiB\nshards <=\n{units.gib(shard_size)}"


def wrap_name(name: str, width: int = NAME_WIDTH, lines: int = NAME_LINES) -> list[str]:
    """A recipe name broken after dashes into at most `lines` lines, each as close to `width` as the parts allow."""
    parts = [p + "-" for p in name.split("-")]
    parts[-1] = parts[-1][:-1]
    while True:
        out = [""]
        for p in parts:
            if out[-1] and len(out[-1]) + len(p) > width:
                out.append("")
            out[-1] += p
        if len(out) <= lines:
            return out + [""] * (lines - len(out))
        width += 1


class PlanTable(DataTable):
    """Fixed on the left: the row labels and the current recipe. Then the pinned recipes, scrolled a whole column at a
    time when they do not all fit (at 80 columns, one does)."""

    BINDINGS = [Binding("enter", "screen.pin", "Pin", show=False)]  # not DataTable's select_cursor
    FIXED = 2  # the label column and the current recipe stay in view

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="column", fixed_columns=self.FIXED, header_height=1 + NAME_LINES,
                         zebra_stripes=False, cursor_foreground_priority="renderable", **kwargs)
        self.column_names: list[str] = []  # CURRENT, then the pinned recipes' names
        self._shown: tuple | None = None

    def show(self, names: list[str], plans: list[Plan], fits: list[Fit]) -> None:
        """Fill the table: `names[0]` is the current recipe, the rest are pinned. Keeps the column cursor on the
        same recipe (or the nearest column) and, while the table has focus, the scroll position."""
        self._shown = (names, plans, fits)
        selected = self.selected_name
        old_index = self.cursor_column
        scroll = (self.scroll_x, self.scroll_y)
        rows = plan_rows(plans, fits)
        heads = [Text(label_header(plans[0].shard_size), style="dim")]
        for i, name in enumerate(names):
            heads.append(Text.assemble(("current" if i == 0 else f"pin {i}", "bold"), "\n",
                                       "\n".join(wrap_name(name)), justify="right"))
        columns = [[heads[0], *(cell(r.label) for r in rows)]]
        columns += [[heads[i + 1], *(r.cells[i] for r in rows)] for i in range(len(names))]
        widths = [max(len(line) for t in col for line in t.plain.split("\n")) for col in columns]
        # When the pins do not all fit, each is widened to the space right of the fixed columns: they are then
        # shown one at a time, never partly.
        pad = 2 * self.cell_padding
        room = self.size.width - self.styles.scrollbar_size_vertical - sum(w + pad for w in widths[:self.FIXED])
        if sum(w + pad for w in widths[self.FIXED:]) > room:
            widths[self.FIXED:] = [max(w, room - pad) for w in widths[self.FIXED:]]

        self.clear(columns=True)
        self.column_names = [CURRENT, *names[1:]]
        for key, head, width in zip(["label", *self.column_names], heads, widths):
            self.add_column(head, key=key, width=width)
        for r in rows:
            self.add_row(cell(r.label, "bold"), *r.cells, key=r.key, height=r.height)
        if selected in self.column_names:
            column = self.column_names.index(selected) + 1
        else:
            column = min(max(old_index, 1), len(self.column_names))
        self.move_cursor(column=column, animate=False, scroll=False)
        self.scroll_to(scroll[0] if self.has_focus else 0, scroll[1], animate=False, immediate=True)

    def action_cursor_left(self) -> None:
        if self.cursor_column > 1:  # the label column is not a recipe
            super().action_cursor_left()

    def on_resize(self) -> None:
        if self._shown is not None:
            self.show(*self._shown)

    def on_blur(self) -> None:
        """Back to the current recipe's column: selecting a pin is something done inside the table."""
        if self.column_names:
            self.move_cursor(column=1, animate=False, scroll=False)
            self.scroll_to(x=0, animate=False, immediate=True)

    def _scroll_cursor_into_view(self, animate: bool = False) -> None:
        """Scroll by whole pinned columns (the label and current columns are fixed)."""
        columns = self.ordered_columns
        c = self.cursor_column
        if self.cursor_type != "column" or not 0 <= c < len(columns):
            return super()._scroll_cursor_into_view(animate)
        if c < self.FIXED:
            return  # always in view
        widths = [col.get_render_width(self) for col in columns]
        visible = self.scrollable_content_region.width - sum(widths[:self.FIXED])
        starts = [sum(widths[self.FIXED:i]) for i in range(self.FIXED, len(widths))]
        start, end = starts[c - self.FIXED], starts[c - self.FIXED] + widths[c]
        x = self.scroll_x
        if start < x or end - start > visible:
            x = start
        elif end > x + visible:
            x = next(s for s in starts if end - s <= visible)
        self.scroll_to(x=x, animate=animate, force=True, immediate=True)

    @property
    def selected_name(self) -> str | None:
        """The column key under the cursor: CURRENT, a pinned recipe's name, or None (the label column)."""
        i = self.cursor_column - 1
        return self.column_names[i] if 0 <= i < len(self.column_names) else None

    def text(self, row: str, column: str) -> str:
        """The plain text of one cell (`column`: CURRENT or a pinned recipe's name)."""
        return self.get_cell(row, column).plain

    def header_text(self, column: str) -> str:
        return self.columns[column].label.plain  # type: ignore[index]

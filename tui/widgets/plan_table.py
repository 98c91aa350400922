"""Recipes side by side: the current recipe and up to three pinned ones, one column each.

The rows are the engine's plan report (tqbench.recipe.report, the rows `tqbench plan` prints): the same keys, labels
and cell text. Only the order and line breaks are this table's: what decides a recipe (sizes, bpw, expert page,
shards, verdict, cache budget, tok/s ceilings: `Row.primary`) comes first so that it fits 80x24, then its quality
against the source (QUALITY_ROWS, from the evaluations tqbench.eval.store remembers; `-` for a recipe never evaluated
on this source), then the details (bits per weight by role under a heading, kept bytes, expert bytes per token, the
hit rate); long labels, verdicts and the sysctl command wrap to the column width. The table's column cursor selects
a pinned recipe (to unpin or edit it).

Layouts from the widest, the first that fits the recipes side by side: labels and names on one line; labels on one
line and names wrapped at WIDE_NAME_WIDTH (one line for `tq3a-tqTe-down4-g64`: 120 columns hold two pins so); labels
wrapped at LABEL_WIDTH and names at NAME_WIDTH; compact mode.

Compact mode, when the recipes do not all fit side by side (at 80x24 with two or three pins): sizes show their decimal
line only (the label column's header says so), the expert page its total only, and every label, cell and recipe name
wraps at COMPACT_WIDTH (after spaces, or after `-`, `/`, `.`, `_`, `=`); columns are separated by one space instead of
two. A K3 size (`585.12 GB`) is 9 characters, so the current recipe and three pins fit the 51 columns right of the
editor at 80x24. What still does not fit (long recipe names, a wider terminal's worth of numbers) scrolls a whole pinned
column at a time.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from tqbench import units
from tqbench.eval.store import RecipeQuality
from tqbench.recipe.fit import Fit, Verdict
from tqbench.recipe.plan import Plan
from tqbench.source.hub.disk import HubDisk
from tqbench.recipe.report import PlanReport, plan_report
from tui.widgets.cells import cell, num

VERDICT_STYLE = {
    Verdict.RESIDENT: "bold green",
    Verdict.RESIDENT_RAISED: "bold cyan",
    Verdict.STREAMING: "bold yellow",
    Verdict.NO_FIT: "bold red",
}
VERDICT_WIDTH = 15  # `resident after raising the GPU wired limit` wraps to three lines
NAME_WIDTH = 12  # recipe names wrap at dashes in the column headers, on at most NAME_LINES lines
WIDE_NAME_WIDTH = 20  # where there is room
NAME_LINES = 3
LABEL_WIDTH = 16  # longer labels (`experts/token top-16`) wrap, so that the current recipe and a pin fit 80 columns
CURRENT = "current"
BPW_HEADING = "bpw by role"  # the heading of the per-role bits per weight, which the CLI indents under bits/weight
COMPACT_WIDTH = 9  # compact mode: labels, cells and names wrap at this width (`585.12 GB`, `streaming`, `max tok/s`)
FIRST_LINE_ROWS = ("resident", "routed experts", "total", "cache budget", "expert page")  # compact: the first line
QUALITY_ROWS = {"perplexity": "perplexity", "kl": "KL vs source", "top-1 agreement": "top-1 agreement",
                "tool calls": "tool calls"}  # key: label; tool calls: the share made as the source makes them


@dataclass(frozen=True, kw_only=True)
class Row:
    key: str
    label: str
    cells: tuple[Text, ...]

    @property
    def height(self) -> int:
        return max([self.label.count("\n") + 1, *(c.plain.count("\n") + 1 for c in self.cells)])


def _command(command: str) -> str:
    return command.replace(" iogpu.", "\niogpu.").replace("=", "=\n")


def verdict_cell(fit: Fit) -> Text:
    return num("\n".join(textwrap.wrap(fit.verdict.value, VERDICT_WIDTH)), VERDICT_STYLE[fit.verdict])


def quality_cells(q: RecipeQuality | None) -> dict[str, str]:
    """One recipe's quality cells by row key: perplexity with its change against the source's, KL(source || recipe)
    per token in nats, top-1 agreement, and the held-out tool calls it makes as the source does (`tqbench eval
    --tools`); `-` when the recipe was never evaluated (so)."""
    if q is None:
        return dict.fromkeys(QUALITY_ROWS, "-")
    t = q.tool_calls
    return {"perplexity": f"{q.perplexity:.2f} ({q.perplexity_change:+.1%})", "kl": f"{q.kl:.3f}",
            "top-1 agreement": f"{q.top1_agreement:.1%}",
            "tool calls": f"{t.agree_rate:.0%} of {t.cases}" if t is not None else "-"}


def quality_rows(qualities: list[RecipeQuality | None]) -> list[Row]:
    cells = [quality_cells(q) for q in qualities]
    return [Row(key=key, label=label, cells=tuple(num(c[key]) for c in cells)) for key, label in QUALITY_ROWS.items()]


def screen_rows(report: PlanReport, fits: list[Fit], qualities: list[RecipeQuality | None],
                label_width: int | None = LABEL_WIDTH) -> list[Row]:
    """The report's rows in this table's order, the quality rows after its primary rows, with their cells as styled
    text; labels wrapped at `label_width` (None: on one line)."""
    rows: list[Row] = []
    keys = {r.key for r in report.rows}
    quality = quality_rows(qualities)
    for r in report.primary_first:
        if not r.primary and quality:
            rows, quality = rows + quality, []
        if r.parent in keys and not any(x.key == BPW_HEADING for x in rows):
            rows.append(Row(key=BPW_HEADING, label=BPW_HEADING, cells=tuple(Text("") for _ in report.recipes)))
        label = r.short_label or r.label
        if label_width is not None and len(label) > label_width:
            label = "\n".join(textwrap.wrap(label, label_width))
        if r.key == "verdict":
            cells = tuple(verdict_cell(f) for f in fits)
        elif r.key == "raise the limit":
            cells = tuple(num(_command(c) if c != "-" else c) for c in r.cells)
        else:
            cells = tuple(num(c) for c in r.cells)
        rows.append(Row(key=r.key, label=label, cells=cells))
    return rows + quality


def label_header(shard_size: int, compact: bool = False) -> str:
    """The label column's header: how sizes read and the shard size (the CLI says both in its title and label)."""
    sizes = "sizes\ndecimal" if compact else "sizes decimal\nover binary"
    return f"{sizes}\nshards <=\n{units.gib(shard_size)}"


_PART = re.compile(r"[^-/._=]*[-/._=]|[^-/._=]+")


def wrap_cell(text: str, width: int = COMPACT_WIDTH) -> str:
    """Every line of `text` broken into lines of at most `width` characters: at spaces, else after `-`, `/`, `.`,
    `_` or `=` inside a longer word (`not disk-` / `bound`, `iogpu.` / `wired_` / `limit_mb=`); a part longer still
    is cut."""
    out: list[str] = []
    for line in text.split("\n"):
        lines = [""]
        for i, word in enumerate(line.split()):
            for j, part in enumerate(_PART.findall(word)):
                joiner = " " if i and not j else ""
                if lines[-1] and len(lines[-1]) + len(joiner) + len(part) > width:
                    lines.append("")
                    joiner = ""
                lines[-1] += joiner + part
        for piece in lines:
            out += [piece[k:k + width] for k in range(0, len(piece), width)] or [""]
    return "\n".join(out)


def compact_rows(rows: list[Row]) -> list[Row]:
    """The rows of compact mode: sizes and the expert page on their first line, labels and cells wrapped."""
    out = []
    for r in rows:
        cells = []
        for c in r.cells:
            plain = c.plain.split("\n")[0] if r.key in FIRST_LINE_ROWS else c.plain.replace("\n", " ")
            cells.append(Text(wrap_cell(plain), style=c.style, justify="right", no_wrap=True, end=""))
        out.append(Row(key=r.key, label=wrap_cell(r.label.replace("\n", " ").strip()), cells=tuple(cells)))
    return out


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
    """Fixed on the left: the row labels and the current recipe. Then the pinned recipes: side by side in full, or in
    compact mode when they do not all fit (at 80 columns, from two pins), else scrolled a whole column at a time.
    Left/right select a recipe's column (the footer says `←→ Recipe`); up/down scroll."""

    BINDINGS = [
        Binding("enter", "screen.pin", "Pin", show=False),  # not DataTable's select_cursor
        Binding("left", "cursor_left", "Recipe", key_display="←→"),
        Binding("right", "cursor_right", "Recipe", show=False),
        Binding("up", "cursor_up", "Scroll", show=False),  # no room in the footer at 80 columns
        Binding("down", "cursor_down", "Scroll", show=False),
        Binding("x", "screen.unpin", "Unpin"),  # the screen's actions, shown while a column can be selected
        Binding("e", "screen.edit_pin", "Edit pin"),
    ]
    FIXED = 2  # the label column and the current recipe stay in view

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="column", fixed_columns=self.FIXED, header_height=1 + NAME_LINES,
                         zebra_stripes=False, cursor_foreground_priority="renderable", **kwargs)
        self.column_names: list[str] = []  # CURRENT, then the pinned recipes' names
        self._shown: tuple | None = None
        self.compact = False  # compact mode (see the module docstring)

    def show(self, names: list[str], plans: list[Plan], fits: list[Fit],
             qualities: list[RecipeQuality | None], hub: HubDisk | None = None) -> None:
        """Fill the table: `names[0]` is the current recipe, the rest are pinned; `qualities` are theirs (None: never
        evaluated). Keeps the column cursor on the same recipe (or the nearest column) and, while the table has
        focus, the scroll position."""
        self._shown = (names, plans, fits, qualities, hub)
        selected = self.selected_name
        old_index = self.cursor_column
        scroll = (self.scroll_x, self.scroll_y)
        report = plan_report(plans, fits, hub)
        space = self.size.width - self.styles.scrollbar_size_vertical
        # The widest layout that fits (the module docstring).
        longest = max(len(name) for name in names)
        for label_width, name_width, compact in ((None, longest, False), (None, WIDE_NAME_WIDTH, False),
                                                 (LABEL_WIDTH, NAME_WIDTH, False), (LABEL_WIDTH, COMPACT_WIDTH, True)):
            rows = screen_rows(report, fits, qualities, label_width)
            rows = compact_rows(rows) if compact else rows
            heads = [Text(label_header(plans[0].shard_size, compact), style="dim")]
            for i, name in enumerate(names):
                wrapped = wrap_name(name, name_width)
                heads.append(Text.assemble(("current" if i == 0 else f"pin {i}", "bold"), "\n",
                                           "\n".join(wrapped), justify="right"))
            columns = [[heads[0], *(cell(r.label) for r in rows)]]
            columns += [[heads[i + 1], *(r.cells[i] for r in rows)] for i in range(len(names))]
            widths = [max(len(line) for t in col for line in t.plain.split("\n")) for col in columns]
            # Compact: no cell padding, one space instead (right of the labels, left of the right-aligned values).
            pad = 0 if compact else 2
            if compact:
                widths = [w + 1 for w in widths]
            if sum(w + pad for w in widths) <= space:
                break
        self.compact = compact
        # When the pins do not all fit even so, each is widened to the space right of the fixed columns: they are
        # then shown one at a time, never partly.
        room = space - sum(w + pad for w in widths[:self.FIXED])
        if sum(w + pad for w in widths[self.FIXED:]) > room:
            widths[self.FIXED:] = [max(w, room - pad) for w in widths[self.FIXED:]]

        self.clear(columns=True)
        self.cell_padding = pad // 2
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

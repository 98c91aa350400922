"""The tensor table: an Input filter (substring or shell glob), an "N of M" count, the first matching rows.

The columns: the name, what the name says (role, layer, expert), then how the tensor is stored (shape, dtype, size,
format, shard). A K3 name is up to ~80 characters, so where the columns do not all fit the name column is narrowed
(its names shortened on the left, `...experts.447.down_proj.weight`) to keep as many of the others wholly in view as
it can, the role always; the rest scroll into view, and the line under the table names the highlighted tensor in full.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Callable

from textual import on, work
from textual.app import ComposeResult
from textual.content import Content
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Input, Label, Static
from textual.worker import get_current_worker

from tqbench import units
from tui.messages import FilterApplied
from tui.widgets.inputs import OrderedInput
from tui.widgets.cells import cell, header, num

ROW_LIMIT = 1000  # rows put in the table; a K3 checkpoint has ~500k tensors, the count still covers them all
GLOB_CHARS = "*?["
COLUMNS = (("name", False), ("role", False), ("layer", True), ("expert", True), ("shape", False), ("dtype", False),
           ("size", True), ("format", False), ("shard", False))
MIN_NAME_WIDTH = 28  # a shortened name still shows its module and parameter (`...experts.447.down_proj.weight`)


def matcher(pattern: str) -> Callable[[str], bool]:
    """A predicate on tensor names: a shell glob matching anywhere in the name when the pattern has `*`, `?` or
    `[` (so `experts.3.w2*` finds every layer's), else a case-insensitive substring."""
    p = pattern.strip()
    if not p:
        return lambda name: True
    if any(c in p for c in GLOB_CHARS):
        match = re.compile(fnmatch.translate(f"*{p}*")).match
        return lambda name: match(name) is not None
    low = p.lower()
    return lambda name: low in name.lower()


def tensor_cells(t) -> tuple:
    """A row's cells but the name (the table shortens it to the column's width)."""
    n = t.name
    role = n.role.value + (f" ({n.attention})" if n.attention else "")
    return (cell(role), num("-" if n.layer is None else n.layer), num("-" if n.expert is None else n.expert),
            cell("x".join(map(str, t.entry.shape)) or "scalar"), cell(t.entry.dtype), num(units.gb(t.nbytes)),
            cell(t.format), cell(t.entry.shard))


def tensor_detail(t) -> str:
    """The tensor's full name, then what it is and how it is stored."""
    n = t.name
    where = ", ".join(x for x in (f"layer {n.layer}" if n.layer is not None else "",
                                  f"expert {n.expert}" if n.expert is not None else "",
                                  n.projection if n.projection != n.role.value else "") if x)
    parts = [f"{'x'.join(map(str, t.entry.shape)) or 'scalar'} {t.entry.dtype}", units.size(t.nbytes),
             f"{units.count(t.params)} params", n.role.value + (f" ({where})" if where else ""), t.format,
             t.entry.shard]
    return t.entry.name + "\n" + " · ".join(parts)


def shorten_name(name: str, width: int) -> str:
    """`name` in at most `width` characters: its end, which tells tensors apart, after an ellipsis."""
    return name if len(name) <= width else "…" + name[len(name) - width + 1:]


def name_width(room: int, longest: int, others: list[int], padding: int) -> int:
    """The name column's width in a table `room` columns wide: every name whole when every column fits, else as wide
    as keeps the most of the `others` (each one's width, padding included, in order) wholly in view with at least
    MIN_NAME_WIDTH for the name; the next column then starts at the right edge."""
    for shown in range(len(others), -1, -1):
        left = room - sum(others[:shown]) - 2 * padding
        if left >= min(longest, MIN_NAME_WIDTH):
            return min(longest, left)
    return min(longest, MIN_NAME_WIDTH)


class TensorPanel(Vertical):
    """Filterable tensor table. `set_tensors()` gives it the checkpoint's tensors (name order)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._tensors: list = []
        self._shown: dict[str, object] = {}
        self._rows: list[tuple[object, tuple]] = []  # the rows of the last filter: (tensor, tensor_cells)
        self._name_width = 0  # the name column's width the rows were put in with
        self._filter_id = 0
        self.count_text = ""

    def compose(self) -> ComposeResult:
        with Horizontal(id="filter-row"):
            yield OrderedInput(placeholder="filter: text or glob *layers.3.*", id="filter")
            yield Label("", id="count")
        yield DataTable(id="tensor-table", cursor_type="row")
        yield Static("", id="tensor-detail")

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self, widths: list[int | None] | None = None) -> None:
        for (label, numeric), width in zip(COLUMNS, widths or [None] * len(COLUMNS)):
            self.table.add_column(header(label, numeric), key=label, width=width)

    @property
    def table(self) -> DataTable:
        return self.query_one("#tensor-table", DataTable)

    @property
    def filter_input(self) -> Input:
        return self.query_one("#filter", Input)

    def set_tensors(self, tensors: list) -> None:
        self._tensors = tensors
        self.apply_filter(self.filter_input.value)

    def clear_filter(self) -> None:
        if self.filter_input.value:
            self.filter_input.value = ""  # Input.Changed re-applies the filter
        else:
            self.apply_filter("")

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.apply_filter(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self) -> None:
        self.table.focus()

    def apply_filter(self, pattern: str) -> None:
        self._filter_id += 1
        self._run_filter(self._filter_id, pattern, self._tensors)

    # An explicit description: by default @work repr()s every argument, here ~500k tensors.
    @work(thread=True, exclusive=True, group="filter", exit_on_error=False, description="filter tensors")
    def _run_filter(self, filter_id: int, pattern: str, tensors: list) -> None:
        keep = matcher(pattern)
        matches = [t for t in tensors if keep(t.entry.name)]
        if get_current_worker().is_cancelled:
            return
        rows = [(t, tensor_cells(t)) for t in matches[:ROW_LIMIT]]
        self.post_message(FilterApplied(filter_id=filter_id, pattern=pattern, rows=rows, matches=len(matches),
                                        total=len(tensors)))

    def on_filter_applied(self, message: FilterApplied) -> None:
        message.stop()
        if message.filter_id != self._filter_id:
            return  # a newer filter is on its way
        self._rows = message.rows
        self._fill()
        text = f"{message.matches:,} of {message.total:,}"
        if message.matches > len(message.rows):
            text += f" ({len(message.rows):,} shown)"
        self.count_text = text
        self.query_one("#count", Label).update(text)
        self._show_detail(next(iter(self._shown), None))

    def _column_widths(self) -> list[int]:
        """Each column's width, padding aside: the name's fitted to the room (name_width), the others' their longest
        cell or heading. Given to the table, not measured by it: it measures rows when idle, and only ever widens."""
        table = self.table
        others = [max([len(label), *(cells[i].cell_len for _, cells in self._rows)])
                  for i, (label, _) in enumerate(COLUMNS[1:])]
        longest = max([len("name"), *(len(t.entry.name) for t, _ in self._rows)])
        scrolls = len(self._rows) + 2 > table.size.height  # the header and a horizontal scrollbar besides the rows
        room = table.size.width - (table.styles.scrollbar_size_vertical if scrolls else 0)
        if room <= 0:
            return [longest, *others]  # not laid out yet (another tab is shown): fitted when it is
        padding = table.cell_padding
        return [name_width(room, longest, [w + 2 * padding for w in others], padding), *others]

    def _fill(self, keep_cursor: bool = False) -> None:
        """Put the rows in the table, their names shortened to the width that fits (the cursor on the same row when
        `keep_cursor`, else on the first)."""
        table = self.table
        row = table.cursor_row if keep_cursor else 0
        widths = self._column_widths()
        self._name_width = widths[0]
        table.clear(columns=True)
        self._add_columns(widths)
        self._shown = {}
        for t, cells in self._rows:
            table.add_row(cell(shorten_name(t.entry.name, widths[0])), *cells, key=t.entry.name)
            self._shown[t.entry.name] = t
        if 0 < row < table.row_count:
            table.move_cursor(row=row, animate=False)

    def on_resize(self) -> None:
        self.call_after_refresh(self._refit)  # once the table has its new size

    def _refit(self) -> None:
        if self._rows and self._column_widths()[0] != self._name_width:
            self._fill(keep_cursor=True)

    @on(DataTable.RowHighlighted, "#tensor-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value if event.row_key else None)

    def _show_detail(self, name: str | None) -> None:
        t = self._shown.get(name) if name else None
        self.query_one("#tensor-detail", Static).update(Content(tensor_detail(t)) if t else "")

    @property
    def row_count(self) -> int:
        return self.table.row_count

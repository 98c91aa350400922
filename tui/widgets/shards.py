"""The shard list: every shard the index names, with missing ones flagged in red."""

from __future__ import annotations

from textual.widgets import DataTable

from tqbench import units
from tui.widgets.cells import cell, header, num

MISSING = "MISSING"
MISSING_STYLE = "bold red"
BADGE_STYLE = "bold white on red"  # keeps its background under the row cursor
COLUMNS = (("shard", False), ("tensors", True), ("size", True), ("binary", True), ("status", False))


class ShardTable(DataTable):
    """One row per shard file: tensors, size on disk, status. Missing shards come first, in red."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", cursor_background_priority="renderable", **kwargs)

    def on_mount(self) -> None:
        for label, numeric in COLUMNS:
            self.add_column(header(label, numeric), key=label)

    def show(self, ckpt) -> None:
        self.clear()
        s = MISSING_STYLE
        for m in ckpt.missing:
            self.add_row(cell(m.file, s), num(f"{len(m.tensors):,}", s), num("-", s), num("-", s),
                         cell(MISSING, BADGE_STYLE), key=m.file)
        for h in ckpt.shards:
            self.add_row(cell(h.file), num(f"{h.tensors:,}"), num(units.gb(h.file_size)),
                         num(units.gib(h.file_size)), cell("ok", "green"), key=h.file)

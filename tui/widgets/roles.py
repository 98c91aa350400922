"""The role / layer summary table; `toggle()` switches between the two views."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widgets import DataTable

from tqbench import units
from tui.widgets.cells import cell, header, num

ROLE_COLUMNS = (("role", False), ("tensors", True), ("params", True), ("size", True), ("binary", True),
                ("formats", False))
LAYER_COLUMNS = (("layer", True), ("attn", False), ("mlp", False), ("tensors", True), ("params", True),
                 ("size", True), ("experts", True), ("expert size", True))


def role_rows(summary) -> list[tuple]:
    return [(cell(g.key), num(f"{g.tensors:,}"), num(units.count(g.params)), num(units.gb(g.bytes)),
             num(units.gib(g.bytes)), cell(", ".join(g.formats))) for g in summary.by_role]


def layer_rows(summary) -> list[tuple]:
    return [(num(r.layer), cell(r.attention or "-"), cell(r.mlp or "-"), num(f"{r.tensors:,}"),
             num(units.count(r.params)), num(units.gb(r.bytes)), num(r.experts or "-"),
             num(units.gb(r.expert_bytes) if r.experts else "-")) for r in summary.by_layer]


class RoleTable(DataTable):
    """Totals by tensor role, or (after `toggle()`) by layer."""

    by_layer: reactive[bool] = reactive(False, init=False)

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self._summary = None

    def on_mount(self) -> None:
        self._fill()

    def show(self, summary) -> None:
        self._summary = summary
        self._fill()

    def toggle(self) -> None:
        self.by_layer = not self.by_layer

    def watch_by_layer(self) -> None:
        self._fill()

    def _fill(self) -> None:
        self.clear(columns=True)
        for label, numeric in LAYER_COLUMNS if self.by_layer else ROLE_COLUMNS:
            self.add_column(header(label, numeric), key=label)
        if self._summary is not None:
            self.add_rows(layer_rows(self._summary) if self.by_layer else role_rows(self._summary))

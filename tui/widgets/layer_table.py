"""The Convert screen's per-layer table: units done of the layout's, bytes read and written in this run, relative error
mean and max over every run's units (a resumed run's table includes the errors earlier runs recorded). Rows are updated in place (only those that changed); the cursor follows the layer being converted until the
user moves it."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from tqbench import units
from tui.tally import LayerStats
from tui.widgets.cells import header, num

COLUMNS = (("layer", True), ("units", True), ("read", True), ("written", True), ("err mean", True),
           ("err max", True))
WIDTHS = (5, 11, 10, 10, 8, 8)  # fixed, so that columns never jump while rows fill (`12,345/12,345`, `123.45 MB`)
OTHER = "-"  # the row of tensors outside the layers (embeddings, final norm, head)


def layer_key(layer: int | None) -> str:
    return OTHER if layer is None else str(layer)


def error_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def layer_cells(s: LayerStats) -> tuple[Text, ...]:
    """One row's cells: what is shown for a layer (bytes of this run, errors of every run; "-" before any)."""
    done = s.done >= s.units
    style = "green" if done else ""
    return (num(layer_key(s.layer)), num(f"{s.done:,}/{s.units:,}", style),
            num(units.gb(s.bytes_in) if s.bytes_in else "-"), num(units.gb(s.bytes_out) if s.bytes_out else "-"),
            num(error_text(s.error_mean)), num(error_text(s.error_max)))


class LayerTable(DataTable):
    """One row per layer of the layout (tensors outside the layers first, as `-`)."""

    BINDINGS = [Binding("enter", "screen.start", "Start", show=False)]  # not DataTable's select_cursor

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, cursor_foreground_priority="renderable", **kwargs)
        self._shown: dict[str, tuple[str, ...]] = {}
        self.follow = True  # the cursor follows the layer being converted

    def on_mount(self) -> None:
        for (label, numeric), width in zip(COLUMNS, WIDTHS):
            self.add_column(header(label, numeric), key=label, width=width)

    def reset(self, stats: Sequence[LayerStats]) -> None:
        """Rows for a new layout (or a new run over it); the cursor follows again."""
        self.clear()
        self._shown = {}
        self.follow = True
        for s in stats:
            cells = layer_cells(s)
            self.add_row(*cells, key=layer_key(s.layer))
            self._shown[layer_key(s.layer)] = tuple(c.plain for c in cells)

    def show(self, stats: Sequence[LayerStats], current: int | None = None) -> None:
        """Update the rows that changed; move the cursor to the `current` layer (while following)."""
        for s in stats:
            key = layer_key(s.layer)
            cells = layer_cells(s)
            plain = tuple(c.plain for c in cells)
            if key not in self._shown:
                self.add_row(*cells, key=key)
            elif plain != self._shown[key]:
                for (label, _), c in zip(COLUMNS, cells):
                    self.update_cell(key, label, c)
            self._shown[key] = plain
        if self.follow and self.row_count:
            key = layer_key(current)
            if key in self._shown:
                self.move_cursor(row=self.get_row_index(key), animate=False)

    def row_text(self, layer: int | None) -> dict[str, str]:
        """The plain text of a layer's row as the table holds it, by column."""
        return {label: cell.plain for (label, _), cell in zip(COLUMNS, self.get_row(layer_key(layer)))}

    @property
    def rows_text(self) -> list[dict[str, str]]:
        """Every row's plain text, top to bottom."""
        return [{label: cell.plain for (label, _), cell in zip(COLUMNS, self.get_row_at(i))}
                for i in range(self.row_count)]

    # A key that moves the cursor stops the following (until the next run).
    def _user_moved(self) -> None:
        self.follow = False

    def action_cursor_up(self) -> None:
        self._user_moved()
        super().action_cursor_up()

    def action_cursor_down(self) -> None:
        self._user_moved()
        super().action_cursor_down()

    def action_page_up(self) -> None:
        self._user_moved()
        super().action_page_up()

    def action_page_down(self) -> None:
        self._user_moved()
        super().action_page_down()

    def action_scroll_top(self) -> None:
        self._user_moved()
        super().action_scroll_top()

    def action_scroll_bottom(self) -> None:
        self._user_moved()
        super().action_scroll_bottom()

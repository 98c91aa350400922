"""A layer x expert heat map of a profile's counts: one row per MoE layer, one cell per expert, or per bin of
`bin` neighbouring experts (their summed counts) when the width does not allow one each. Each cell is a glyph of
RAMP (blank for no routings, `@` for the hottest cell of the map), coloured too, so heat reads without colour.

The layer labels and the expert axis stay in place while the cells scroll; arrows move a cursor cell, +/- zoom (fewer
or more experts per cell), and the map fits the width again when it is resized unzoomed."""

from __future__ import annotations

import math

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

RAMP = " .:-=+*#%@"
COLOURS = ("#5f5f87", "#5f87af", "#5fafaf", "#5faf5f", "#afaf5f", "#d7af5f", "#d7875f", "#ff5f5f", "#ff5fd7")


def bin_counts(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """counts [layers, experts] -> (sums, maxima) [layers, ceil(experts / size)]: each bin's summed counts and its
    hottest expert's count."""
    layers, experts = counts.shape
    cols = math.ceil(experts / size)
    padded = np.zeros((layers, cols * size))
    padded[:, :experts] = counts
    blocks = padded.reshape(layers, cols, size)
    return blocks.sum(axis=2), blocks.max(axis=2)


def levels(cells: np.ndarray) -> np.ndarray:
    """0 for an empty cell, else 1..9 by its share of the map's hottest cell (ceil, so any routing shows)."""
    top = float(cells.max()) if cells.size else 0.0
    if top <= 0:
        return np.zeros(cells.shape, dtype=int)
    return np.where(cells > 0, np.clip(np.ceil(cells / top * 9), 1, 9), 0).astype(int)


def glyphs(cells: np.ndarray) -> list[str]:
    """Each row of `cells` as RAMP glyphs."""
    return ["".join(RAMP[v] for v in row) for row in levels(cells)]


class HeatMap(ScrollView, can_focus=True):
    BINDINGS = [
        Binding("plus,equals_sign", "zoom(-1)", "Zoom in", key_display="+", show=False),
        Binding("minus", "zoom(1)", "Zoom out", key_display="-", show=False),
        Binding("left", "move(-1, 0)", "Cell", key_display="←→↑↓", show=False),
        Binding("right", "move(1, 0)", "Cell", show=False),
        Binding("up", "move(0, -1)", "Cell", show=False),
        Binding("down", "move(0, 1)", "Cell", show=False),
        Binding("home", "move(-100000, 0)", "First expert", show=False),
        Binding("end", "move(100000, 0)", "Last expert", show=False),
    ]
    DEFAULT_CSS = """
    HeatMap { height: auto; max-height: 50%; scrollbar-size: 1 1; }
    """

    class Moved(Message):
        """The cursor cell or the binning changed."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.layer_ids: list[int] = []
        self.counts = np.zeros((0, 0))
        self.zoom: int | None = None  # experts per cell chosen with +/-; None: fit the width
        self.bin = 1
        self.cells = self.maxima = np.zeros((0, 0))
        self.cursor = (0, 0)  # (layer row, column)
        self._levels = np.zeros((0, 0), dtype=int)

    # ---- data -------------------------------------------------------------------------------------------------------

    def show(self, layers: list[int], counts: np.ndarray) -> None:
        """counts [len(layers), experts], as Profile.counts() gives them per layer."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self.counts.shape:
            self.cursor = (0, 0)  # another model: the cursor cell and the scrolling start over
            self.scroll_to(0, 0, animate=False, immediate=True)
        self.layer_ids, self.counts = list(layers), counts
        self._rebin()

    @property
    def experts(self) -> int:
        return self.counts.shape[1] if self.counts.ndim == 2 else 0

    @property
    def label_width(self) -> int:
        return len(str(max(self.layer_ids, default=0))) + 1

    def fit_bin(self) -> int:
        """The fewest experts per cell that fit every cell in the width."""
        room = max(1, self.scrollable_content_region.width - self.label_width)
        return max(1, math.ceil(self.experts / room)) if self.experts else 1

    def _rebin(self) -> None:
        self.bin = min(self.zoom or self.fit_bin(), max(1, self.experts))
        self.cells, self.maxima = bin_counts(self.counts, self.bin) if self.experts else (self.counts, self.counts)
        self._levels = levels(self.cells)
        row, col = self.cursor
        self.cursor = (min(row, max(0, len(self.layer_ids) - 1)), min(col, max(0, self.cells.shape[1] - 1)))
        self.virtual_size = Size(self.label_width + self.cells.shape[1], 1 + len(self.layer_ids))
        self._follow()
        self.refresh()
        self.post_message(self.Moved())

    def on_resize(self) -> None:
        if self.zoom is None and self.experts:
            self._rebin()

    def cell_span(self, col: int) -> tuple[int, int]:
        """The experts of column `col`: first, last."""
        return col * self.bin, min(self.experts, (col + 1) * self.bin) - 1

    # ---- actions ----------------------------------------------------------------------------------------------------

    def action_zoom(self, step: int) -> None:
        """+ halves the experts per cell (down to 1), - doubles them (up to a whole layer per cell)."""
        if not self.experts:
            return
        b = self.bin
        self.zoom = max(1, b // 2) if step < 0 else min(self.experts, b * 2)
        col = self.cursor[1] * b // self.zoom  # keep the cursor on the same experts
        self.cursor = (self.cursor[0], col)
        self._rebin()

    def action_move(self, dx: int, dy: int) -> None:
        if not self.layer_ids:
            return
        row = min(max(0, self.cursor[0] + dy), len(self.layer_ids) - 1)
        col = min(max(0, self.cursor[1] + dx), self.cells.shape[1] - 1)
        self.cursor = (row, col)
        self._follow()
        self.refresh()
        self.post_message(self.Moved())

    def _follow(self) -> None:
        """Scroll so the cursor cell is visible (labels and axis stay put, so the visible cells are fewer)."""
        region = self.scrollable_content_region
        cols, rows = max(1, region.width - self.label_width), max(1, region.height - 1)
        x, y = self.scroll_offset
        row, col = self.cursor
        x = min(x, col) if col < x + cols else col - cols + 1
        y = min(y, row) if row < y + rows else row - rows + 1
        self.scroll_to(x, y, animate=False, immediate=True)

    # ---- drawing ----------------------------------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        x0, y0 = self.scroll_offset
        lw = self.label_width
        cols = range(x0, min(self.cells.shape[1], x0 + max(0, width - lw)))
        base = self.rich_style
        dim = base + Style(dim=True)
        if y == 0:  # the expert axis: the first expert of every tenth column, each label whole or not at all
            axis = ""
            for c in cols:
                label = str(c * self.bin)
                if c % 10 == 0 and (not axis or len(axis) < c - x0) and c - x0 + len(label) <= len(cols):
                    axis = axis.ljust(c - x0) + label
            axis = axis.ljust(len(cols))
            return Strip([Segment(" " * lw, base), Segment(axis, dim)]).adjust_cell_length(width, base)
        row = y0 + y - 1
        if row >= len(self.layer_ids):
            return Strip.blank(width, base)
        segments = [Segment(f"{self.layer_ids[row]:>{lw - 1}} ", dim)]
        for c in cols:
            level = int(self._levels[row, c])
            style = base + Style(color=COLOURS[level - 1] if level else None, bold=level >= 7)
            if (row, c) == self.cursor and self.has_focus:
                style += Style(reverse=True)
            segments.append(Segment(RAMP[level], style))
        return Strip(segments).adjust_cell_length(width, base)

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

"""The live expert view's map: one row per MoE layer, one cell per routed expert (or per bin of experts when the
width is short), drawn with Textual's Line API from a tqbench.chat.live.PageInMap.

A cell tells how its expert was served on its last routing by glyph (readable without colour) and colour: P pinned,
= cache hit, + prefetched (read ahead in time), h copied from the host-RAM tier, # read from disk (a miss),
blank never routed. Its colour fades over FADE tokens after the routing; this token's routings are bold. A bin shows its most recent routing (the worst served
among those of the same token). After the cells: the layer's misses over the last tokens and its stall time so far.

Keys (the map focused): up/down choose a layer, enter opens it (all its experts, wrapped over several lines), + and -
zoom (experts per cell), left/right scroll when the bins do not fit.
"""

from __future__ import annotations

import time

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tqbench.chat.live import FADE, GLYPHS, KINDS, SPARK, PageInMap, bins, fold, heat, sparkline

STALL_W = 7  # "12.3 s", "999 ms"
DRAW_INTERVAL = 0.1  # seconds between redraws while batches come (every ~50 ms; the last is drawn with force)
MIN_CELLS = 8  # fewer cell columns than this: the sparkline and stall columns are left out
ZOOM = Binding.Group("Zoom")


def stall_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


class ExpertMapView(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    ExpertMapView { height: 1fr; overflow-x: hidden; scrollbar-size-vertical: 1; }
    ExpertMapView > .expert-map--pinned { color: $primary; }
    ExpertMapView > .expert-map--cache { color: $success; }
    ExpertMapView > .expert-map--prefetched { color: $accent; }
    ExpertMapView > .expert-map--host { color: $warning; }
    ExpertMapView > .expert-map--miss { color: $error; }
    ExpertMapView > .expert-map--muted { color: $text-muted; }
    ExpertMapView > .expert-map--cursor { background: $accent 40%; text-style: bold; }
    """
    COMPONENT_CLASSES = {f"expert-map--{k}" for k in (*KINDS, "muted", "cursor")}
    BINDINGS = [
        Binding("up", "cursor(-1)", "Layer", show=False),
        Binding("down", "cursor(1)", "Layer", show=False),
        Binding("enter", "open", "Open"),
        Binding("plus,equals_sign", "zoom(-1)", "Zoom", key_display="+", group=ZOOM),  # one footer entry: "+ - Zoom"
        Binding("minus", "zoom(1)", "Zoom", key_display="-", group=ZOOM),
        Binding("left", "scroll_bins(-1)", "Scroll", show=False),
        Binding("right", "scroll_bins(1)", "Scroll", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model: PageInMap | None = None
        self.per: int | None = None  # experts per cell (None: fit the width)
        self.first = 0  # first bin shown
        self.cursor = 0  # index of the chosen layer
        self.opened: set[int] = set()  # layers shown with all their experts
        self.paused = False
        self._rows: list[tuple] = []  # ("layer", n) | ("wrap", n, first expert), under the fixed header line
        self._styles: dict = {}
        self._drawn = 0.0  # when the last redraw was asked for
        self._key: tuple | None = None  # what the cached lines were drawn for
        self._frame: dict = {}
        self._lines: dict[int, Strip] = {}

    # ---- state ----

    def set_model(self, model: PageInMap | None) -> None:
        self.model, self.per, self.first, self.cursor, self.opened = model, None, 0, 0, set()
        self._relayout()

    def update_view(self, force: bool = False) -> None:
        """The model took a batch: redraw the lines that show something (the header and the rows, not the blank ones
        under them), at most every DRAW_INTERVAL unless `force` (nothing while paused)."""
        if self.model is None or self.paused or not force and time.monotonic() - self._drawn < DRAW_INTERVAL:
            return
        self._drawn = time.monotonic()
        self.refresh(Region(0, 0, self.size.width, min(self.size.height, len(self._rows) + 1)))

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._relayout()

    # ---- geometry ----

    @property
    def layer_list(self) -> list[int]:
        return list(self.model.layers) if self.model else []

    def geometry(self) -> tuple[int, int, int, bool]:
        """(label width, cell columns, experts per cell, tail shown)."""
        width = self.scrollable_content_region.width or self.size.width
        m = self.model
        label = max(len(f"L{max(m.layers, default=0)}"), len(str(max(0, m.widest - 1)))) + 1 if m else 3
        tail = SPARK + STALL_W + 2
        cols = width - label - tail
        shown = cols >= MIN_CELLS
        if not shown:
            cols = width - label
        cols = max(1, cols)
        return label, cols, self.per or fold(m.widest if m else 1, cols), shown

    def wrap_width(self) -> int:
        """Experts per line of an opened layer."""
        return max(1, (self.scrollable_content_region.width or self.size.width) - self.geometry()[0])

    def _relayout(self) -> None:
        rows: list[tuple] = []
        if self.model is not None:
            wrap = self.wrap_width()
            for n in self.model.layers:
                rows.append(("layer", n))
                if n in self.opened:
                    rows += [("wrap", n, a) for a in range(0, self.model.layers[n].experts, wrap)]
        self._rows = rows
        self.virtual_size = Size(self.size.width, len(rows) + 1)  # + the header, which stays in place
        self.refresh()

    def on_resize(self) -> None:
        self._relayout()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles, self._key = {}, None

    # ---- keys ----

    def action_cursor(self, step: int) -> None:
        layers = self.layer_list
        if not layers:
            return
        self.cursor = max(0, min(len(layers) - 1, self.cursor + step))
        y = self._rows.index(("layer", layers[self.cursor]))
        self.scroll_to_region(Region(0, y, 1, 2), animate=False)  # shown at y + 1 - scroll_y: under the header
        self.refresh()

    def action_open(self) -> None:
        layers = self.layer_list
        if layers:
            self.opened ^= {layers[self.cursor]}
            self._relayout()

    def action_zoom(self, step: int) -> None:
        """step -1: fewer experts per cell (down to one), +1: more (up to the whole layer in a cell)."""
        if self.model is None:
            return
        _, _, per, _ = self.geometry()
        per = max(1, per // 2) if step < 0 else min(self.model.widest, per * 2)
        self.per, self.first = per, 0
        self.refresh()

    def action_scroll_bins(self, step: int) -> None:
        if self.model is None:
            return
        _, cols, per, _ = self.geometry()
        total = len(bins(self.model.widest, per))
        self.first = max(0, min(max(0, total - cols), self.first + step * max(1, cols // 2)))
        self.refresh()

    # ---- drawing ----

    def _style(self, key: tuple) -> Style:
        """Styles by (kind, age) for cells, or a component name."""
        style = self._styles.get(key)
        if style is None:
            base = self._styles.get(("base",)) or self.rich_style  # rich_style walks the DOM: once per style change
            if key[0] == "base":
                style = base
            elif key[0] in KINDS:
                kind, age = key
                bg = self.background_colors[1]
                color = self.get_component_styles(f"expert-map--{kind}").color
                fg = bg.blend(color, 0.35 + 0.65 * heat(age))
                style = base + Style(color=fg.rich_color, bold=age == 0)
            else:
                style = base + self.get_component_rich_style(f"expert-map--{key[0]}", partial=True)
            self._styles[key] = style
        return style

    def _cells(self, layer: int, groups: list[range]) -> list[Segment]:
        """The cells as segments, neighbours of the same style in one."""
        out: list[Segment] = []
        run: list[str] = []
        style = None
        cell, bin_, style_of, base = self.model.cell, self.model.bin, self._style, self._style(("base",))
        for g in groups:
            kind, age = cell(layer, g.start) if len(g) == 1 else bin_(layer, g)
            s = style_of((kind, age if age < FADE else FADE)) if kind else base
            if s is not style and run:
                out.append(Segment("".join(run), style))
                run = []
            style = s
            run.append(GLYPHS[kind])
        if run:
            out.append(Segment("".join(run), style))
        return out

    def render_line(self, y: int) -> Strip:
        """Line y, from the cache while nothing it shows has changed (the screen redraws more often than the map
        takes a batch)."""
        scroll = int(self.scroll_offset.y)
        key = (self.model and self.model.version, self.scrollable_content_region.width or self.size.width, scroll,
               self.per, self.first, self.cursor, self.has_focus, self.paused, len(self._rows), tuple(self.opened))
        if key != self._key:  # what every line is drawn with, worked out once per change
            self._key, self._lines = key, {}
            self._frame = self._make_frame(key[1])
        strip = self._lines.get(y)
        if strip is None:
            strip = self._lines[y] = self._render_line(y, scroll)
        return strip

    def _make_frame(self, width: int) -> dict:
        f = dict(width=width, base=self._style(("base",)), muted=self._style(("muted",)))
        m = self.model
        if m is not None:
            label, cols, per, tail = self.geometry()
            total = len(bins(m.widest, per))
            f.update(label=label, cols=cols, per=per, tail=tail, total=total, first=min(self.first, max(0, total - cols)),
                     top=max((max(s.misses, default=0) for s in m.layers.values()), default=1),
                     wrap=self.wrap_width(), chosen=self.layer_list[self.cursor] if self.has_focus else None)
        return f

    def _render_line(self, y: int, scroll: int) -> Strip:
        f, m = self._frame, self.model
        i = y - 1 + scroll
        row = ("head",) if y == 0 else self._rows[i] if i < len(self._rows) else None
        if row is None or m is None:
            return Strip.blank(f["width"], f["base"])
        label, cols, per, first, muted = f["label"], f["cols"], f["per"], f["first"], f["muted"]
        if row[0] == "head":
            text = ("PAUSED · " if self.paused else "") + f"{m.widest} experts, {per}/cell"
            if f["total"] > cols:  # which experts the cells show
                text += f" · shown {first * per}-{min(m.widest, (first + cols) * per) - 1} ◀▶"
            segs = [Segment(text, muted)]
        elif row[0] == "layer":
            n = row[1]
            st = m.layers[n]
            groups = bins(st.experts, per)[first:first + cols]
            mark = "▾" if n in self.opened else " "
            segs = [Segment(f"L{n}".ljust(label - 1) + mark, self._style(("cursor",)) if f["chosen"] == n else muted)]
            segs += self._cells(n, groups)
            segs.append(Segment(" " * (min(cols, f["total"]) - len(groups))))  # the tail after the widest layer's
            if f["tail"]:
                segs += [Segment(" "), Segment(sparkline(st.misses, f["top"]), self._style(("miss", FADE // 2))),
                         Segment(stall_text(st.stall_s).rjust(STALL_W), muted)]
        else:  # ("wrap", layer, first expert): one cell per expert
            n, a = row[1], row[2]
            segs = [Segment(str(a).rjust(label - 1) + " ", muted)]
            segs += self._cells(n, [range(e, e + 1) for e in range(a, min(m.layers[n].experts, a + f["wrap"]))])
        return Strip(segs).adjust_cell_length(f["width"], f["base"])


def natural_width(model: PageInMap) -> int:
    """Columns the map needs to show every expert in its own cell, with the layer labels and the tail."""
    label = max(len(f"L{max(model.layers, default=0)}"), len(str(max(0, model.widest - 1)))) + 1
    return label + model.widest + 1 + SPARK + STALL_W + 1

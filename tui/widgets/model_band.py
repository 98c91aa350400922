"""The Chat screen's header band: which model is loaded (path, why it was chosen) and its figures (type, TurboQuant
modules, weight memory, load time), or what loading is doing. The figures are packed to the band's width, breaking
only between them (never inside `5.38 MB`), under the path and aligned with it."""

from __future__ import annotations

from pathlib import Path

from textual.content import Content
from textual.widget import Widget

from tqbench.chat.report import model_figures
from tui.state import display_path

KEY = 8  # the label column ("model   ")
SEP = " · "


def pack(items: list[str], width: int, indent: int) -> list[list[str]]:
    """Items on lines of at most `width` cells (each line starts after `indent`), breaking only between items."""
    lines: list[list[str]] = [[]]
    used = indent
    for item in items:
        need = len(item) + (len(SEP) if lines[-1] else 0)
        if lines[-1] and width > 0 and used + need > width:
            lines.append([])
            used, need = indent, len(item)
        lines[-1].append(item)
        used += need
    return lines


class ModelBand(Widget):
    """`show_text` while loading or after a failure; `show_model` once a model is loaded."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._text = Content("")
        self._model: tuple[str, str, list[str]] | None = None  # (path shown, why, figures)

    def show_text(self, content: Content) -> None:
        self._text, self._model = content, None
        self.refresh(layout=True)

    def show_model(self, chosen, loaded) -> None:
        """chosen: tqbench.events.ModelChosen; loaded: tqbench.events.ModelLoaded."""
        self._model = (display_path(Path(loaded.path)), chosen.why, model_figures(loaded))
        self.refresh(layout=True)

    def render(self) -> Content:
        if self._model is None:
            return self._text
        path, why, items = self._model
        out = Content.assemble((f"{'model':<{KEY}}", "bold"), (path, "bold $text-accent"),
                               (f"  ({why})", "$text-muted"))
        dot = Content.styled(SEP, "$text-muted")
        for line in pack(items, self.content_size.width, KEY):
            out += Content("\n" + " " * KEY) + dot.join(Content(item) for item in line)
        return out

    @property
    def text(self) -> str:
        return self.render().plain

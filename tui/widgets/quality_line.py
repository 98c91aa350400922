"""The line under the Recipe screen's plan table: what the quality rows were measured on (the texts, tokens and
window of the remembered evaluations, tqbench.eval.store), and below it a quick eval's progress while one runs."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from tqbench.eval.records import EvalProgress, EvalStarted
from tqbench.eval.store import RecipeQuality
from tqbench.events import CalibrationProgress, Calibrated, ConvertFinished, ConvertStarted, UnitConverted


def measured_on(q: RecipeQuality) -> str:
    return f"{q.tokens:,} tokens of {q.texts}, window {q.window}"


def caption(columns: list[tuple[str, RecipeQuality | None]]) -> str:
    """What the quality rows of the columns (label, quality) were measured on; `-` cells say nothing."""
    groups: dict[str, list[str]] = {}
    for label, q in columns:
        if q is not None:
            groups.setdefault(measured_on(q), []).append(label)
    if not groups:
        return "quality: none measured on this source (v: quick eval)"
    if len(groups) == 1:
        return f"quality: {next(iter(groups))}"
    return "quality: " + "; ".join(f"{on} ({', '.join(labels)})" for on, labels in groups.items())


def progress_text(recipe: str, event: object | None) -> str:
    """Where a quick eval of `recipe` is, after `event` (None: nothing heard yet)."""
    what = f"quick eval of {recipe} on the demo"
    if isinstance(event, CalibrationProgress):
        return f"{what}: converting, calibrated {event.fraction:.0%}"
    if isinstance(event, Calibrated):
        return f"{what}: calibrated in {event.seconds:.0f} s; converting..."
    if isinstance(event, ConvertStarted):
        return f"{what}: converting..."
    if isinstance(event, UnitConverted):
        eta = f", {event.eta:.0f} s left" if event.eta is not None else ""
        return f"{what}: converting {event.done_in / max(event.total_in, 1):.0%}{eta}"
    if isinstance(event, ConvertFinished):
        return f"{what}: converted; loading both models..."
    if isinstance(event, EvalStarted):
        return f"{what}: scoring {event.tokens:,} tokens..."
    if isinstance(event, EvalProgress):
        eta = f", {event.eta_s:.0f} s left" if event.eta_s else ""
        return f"{what}: scored {event.done:,} of {event.total:,} tokens{eta}"
    return f"{what}: starting..."


class QualityLine(Static):
    """The quality rows' caption, and a quick eval's progress under it while one runs; hidden when neither."""

    DEFAULT_CSS = """
    QualityLine { height: auto; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.display = False
        self.caption: str | None = None
        self.progress: str | None = None  # a quick eval's progress while one runs

    def show_caption(self, columns: list[tuple[str, RecipeQuality | None]] | None) -> None:
        """The caption of the table's columns (label, quality); None: no table is shown."""
        self.caption = caption(columns) if columns is not None else None
        self._draw()

    def show_progress(self, text: str | None) -> None:
        self.progress = text
        self._draw()

    def _draw(self) -> None:
        parts = [] if self.caption is None else [Content(self.caption)]
        if self.progress is not None:
            parts.append(Content.styled(self.progress, "$text-accent"))
        self.update(Content("\n").join(parts))
        self.display = bool(parts)

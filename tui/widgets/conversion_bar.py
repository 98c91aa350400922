"""The Chat screen's progress row while the built-in demo is converted first (no model converted yet): a bar over the
source bytes and how much of them is done. Hidden otherwise."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from tqbench import units
from tqbench.events import UnitConverted


class ConversionBar(Horizontal):
    def compose(self) -> ComposeResult:
        yield ProgressBar(total=None, show_eta=False, id="chat-bar")
        yield Label("", id="chat-bar-text")

    def begin(self) -> None:
        """The conversion starts: an empty bar, until the first unit says how much there is."""
        self.query_one("#chat-bar", ProgressBar).update(total=None, progress=0)
        self.query_one("#chat-bar-text", Label).update("")
        self.display = True

    def show_unit(self, unit: UnitConverted) -> None:
        self.display = True
        self.query_one("#chat-bar", ProgressBar).update(total=unit.total_in, progress=unit.done_in)
        self.query_one("#chat-bar-text", Label).update(f"{units.gb(unit.done_in)} of {units.gb(unit.total_in)}")

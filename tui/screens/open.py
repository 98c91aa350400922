"""A small modal asking for a path: a checkpoint directory to open (the default), or whatever `title` asks for."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from tui.widgets.inputs import OrderedInput


class OpenScreen(ModalScreen[Path | None]):
    """Dismisses with the Path typed (user `~` expanded), or None on escape / an empty line."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, initial: str = "",
                 title: str = "Open a checkpoint directory or hub repository (Enter to open, Esc to cancel)",
                 placeholder: str = "/path/to/checkpoint or owner/name[@revision]") -> None:
        super().__init__()
        self._initial, self._title, self._placeholder = initial, title, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(id="open-dialog"):
            yield Label(self._title)
            # Ordered: ctrl+u then a pasted path keeps the path (Textual would run ctrl+u after the pasted keys).
            yield OrderedInput(value=self._initial, placeholder=self._placeholder, id="open-path")

    @on(Input.Submitted, "#open-path")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self.dismiss(Path(text).expanduser() if text else None)

    def action_cancel(self) -> None:
        self.dismiss(None)

"""A small modal asking yes or no before something that cannot be undone (replacing a conversion's output)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class ConfirmScreen(ModalScreen[bool]):
    """Dismisses with True on `y`, False on `n` or escape (anything else is ignored)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "No", show=False),
    ]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self._question = question
        self._detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog"):
            yield Label(Content.styled(self._question, "bold"))
            if self._detail:
                yield Static(Content(self._detail), id="confirm-detail")
            yield Label(Content.styled("y: yes    n / Esc: no", "$text-muted"), id="confirm-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

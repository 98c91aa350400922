"""`TqbenchApp`: the full-screen workbench. Each workbench area is an app mode; Source is the first."""

from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.binding import Binding

from tui.screens.source import SourceScreen


class TqbenchApp(App[None]):
    """Opens on the Source screen with `path`, or (None) the checkpoint opened last, or the built-in demo."""

    TITLE = "tqbench"
    CSS_PATH = "app.tcss"
    MODES = {"source": SourceScreen}  # later: "recipe", "convert", "chat", "streaming"
    DEFAULT_MODE = "source"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, path: Path | str | None = None) -> None:
        super().__init__()
        self.start_path = Path(path).expanduser() if path is not None else None
        self.checkpoint = None  # the tqbench.source.Checkpoint opened last, for every screen

"""`TqbenchApp`: the full-screen workbench. Each workbench area is an app mode: Source first, then Recipe, Convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from tqbench.recipe import Recipe
from tui.screens.convert import ConvertScreen
from tui.screens.recipe import RecipeScreen
from tui.screens.source import SourceScreen
from tui.widgets.recipe_editor import INITIAL_RECIPE


class TqbenchApp(App[None]):
    """Opens on the Source screen with `path`, or (None) the checkpoint opened last, or the built-in demo."""

    TITLE = "tqbench"
    CSS_PATH = "app.tcss"
    MODES = {"source": SourceScreen, "recipe": RecipeScreen, "convert": ConvertScreen}  # later: "chat", "streaming"
    DEFAULT_MODE = "source"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("s", "switch_mode('source')", "Source"),
        Binding("p", "switch_mode('recipe')", "Recipe"),
        Binding("c", "switch_mode('convert')", "Convert"),
    ]

    # The tqbench.source.Checkpoint opened last, for every screen (the Source screen sets it; the Recipe screen
    # watches it). Never compared: a new load always notifies, and comparing 500k tensors would be slow.
    checkpoint: reactive[Any] = reactive(None, always_update=True, init=False)
    # The Recipe screen's current recipe (a tqbench.recipe.Recipe), for the Convert screen.
    recipe: reactive[Any] = reactive(Recipe.parse(INITIAL_RECIPE), init=False)

    def __init__(self, path: Path | str | None = None) -> None:
        super().__init__()
        self.start_path = Path(path).expanduser() if path is not None else None
        self.conversion: ConvertScreen | None = None  # the Convert screen while it runs a conversion
        self._quitting = False

    async def action_quit(self) -> None:
        """A running conversion is stopped first (it keeps only whole shards, so it resumes later); q again quits
        without waiting for the screen."""
        if self.conversion is not None and not self._quitting:
            self._quitting = True
            self.notify("stopping the conversion first (the output stays resumable)...")
            self.conversion.stop_and_quit()
            return
        self.exit()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "switch_mode":
            return parameters[0] != self.current_mode  # the key of the screen already shown is hidden
        return True

"""`TqbenchApp`: the full-screen workbench. Each workbench area is an app mode: Source first, then Recipe, Convert,
Chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from tqbench.engine import engine
from tqbench.recipe import Recipe
from tui.screens.chat import ChatScreen
from tui.screens.convert import ConvertScreen
from tui.screens.recipe import RecipeScreen
from tui.screens.source import SourceScreen
from tui.widgets.recipe_editor import INITIAL_RECIPE


class TqbenchApp(App[None]):
    """Opens on the Source screen with `path`, or (None) the checkpoint opened last, or the built-in demo."""

    TITLE = "tqbench"
    CSS_PATH = "app.tcss"
    MODES = {"source": SourceScreen, "recipe": RecipeScreen, "convert": ConvertScreen,
             "chat": ChatScreen}  # later: "streaming"
    DEFAULT_MODE = "source"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("s", "switch_mode('source')", "Source"),
        Binding("p", "switch_mode('recipe')", "Recipe"),
        Binding("c", "switch_mode('convert')", "Convert"),
        Binding("t", "switch_mode('chat')", "Chat"),
    ]

    # The tqbench.source.Checkpoint opened last, for every screen (the Source screen sets it; the Recipe screen
    # watches it). Never compared: a new load always notifies, and comparing 500k tensors would be slow.
    checkpoint: reactive[Any] = reactive(None, always_update=True, init=False)
    # The Recipe screen's current recipe (a tqbench.recipe.Recipe), for the Convert screen.
    recipe: reactive[Any] = reactive(Recipe.parse(INITIAL_RECIPE), init=False)

    def __init__(self, path: Path | str | None = None) -> None:
        super().__init__()
        self.start_path = Path(path).expanduser() if path is not None else None
        self._quitting = False

    async def action_quit(self) -> None:
        """The engine's running job is stopped first (a conversion keeps only whole shards, so it resumes later);
        q again quits without waiting."""
        if engine().busy and not self._quitting:
            self._quitting = True
            self.notify("stopping the running job first (a conversion stays resumable)...")
            self._stop_engine_then_exit()
            return
        self.exit()

    @work(thread=True, group="quit", exit_on_error=False, description="stop the engine")
    def _stop_engine_then_exit(self) -> None:
        engine().stop_all()
        self.call_from_thread(self.exit)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("quit", "switch_mode") and getattr(self.focused, "hides_app_keys", False):
            return False  # a field where these keys type (the chat's message field; ctrl+q quits from it)
        if action == "switch_mode":
            return parameters[0] != self.current_mode  # the key of the screen already shown is hidden
        return True

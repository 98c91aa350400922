"""`TqbenchApp`: the full-screen workbench. Each workbench area is an app mode: Source first, then Recipe, Convert,
Chat, Profile, Serve; ? (or F1) lists every key, and the command palette (ctrl+p) reaches every screen too."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import reactive
from textual.screen import Screen

from tqbench.engine import engine
from tqbench.recipe import Recipe
from tui.screens.chat import ChatScreen
from tui.screens.convert import ConvertScreen
from tui.screens.help import HelpScreen
from tui.screens.profile import ProfileScreen
from tui.screens.recipe import RecipeScreen
from tui.screens.serve import ServeScreen
from tui.screens.source import SourceScreen
from tui.widgets.recipe_editor import INITIAL_RECIPE


class TqbenchApp(App[None]):
    """Opens on the Source screen with `path`, or (None) the checkpoint opened last, or the built-in demo."""

    TITLE = "tqbench"
    CSS_PATH = "app.tcss"
    MODES = {"source": SourceScreen, "recipe": RecipeScreen, "convert": ConvertScreen, "chat": ChatScreen,
             "profile": ProfileScreen, "serve": ServeScreen}
    DEFAULT_MODE = "source"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        # Help before the screens' keys: a footer too narrow for every key (80 columns) leaves out the last ones whole
        # (tui.widgets.footer), and the help screen lists them all
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("f1", "help", "Help", show=False),  # also in fields, where ? types
        Binding("s", "switch_mode('source')", "Source"),
        Binding("p", "switch_mode('recipe')", "Recipe"),
        Binding("c", "switch_mode('convert')", "Convert"),
        Binding("t", "switch_mode('chat')", "Chat"),
        Binding("h", "switch_mode('profile')", "Profile"),  # f: the Convert screen's Force
        Binding("w", "switch_mode('serve')", "Serve"),  # the first key left out of an 80-column footer
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
        self._quitting = True
        self.exit()

    async def action_switch_mode(self, mode: str) -> None:
        if not self._quitting:  # a key pressed while the app closes opens no screen into it
            await super().action_switch_mode(mode)

    @work(thread=True, group="quit", exit_on_error=False, description="stop the engine")
    def _stop_engine_then_exit(self) -> None:
        engine().stop_all()
        self.call_from_thread(self.exit)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette: every screen, by the name its key has, and the help screen; then Textual's commands."""
        for _, b in self._bindings:
            if b.action.startswith("switch_mode("):
                mode = b.action.split("'")[1]
                yield SystemCommand(b.description, f"Go to the {b.description} screen ({b.key})",
                                    partial(self.switch_mode, mode))
        yield SystemCommand("Help", "Every key of the app and of each screen (? or F1)", self.action_help)
        yield from super().get_system_commands(screen)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("quit", "switch_mode") and getattr(self.focused, "hides_app_keys", False):
            return False  # a field where these keys type (the chat's message field; ctrl+q quits from it)
        if action == "switch_mode":
            return parameters[0] != self.current_mode  # the key of the screen already shown is hidden
        return True

"""The Chat screen's model load: a thread worker opens the screen's ChatRequest in its ChatSession
(tui.screens.chat_relay.relay_load: choosing the model, converting the demo first if needed, loading it). Messages
carry the load's `load_id`: those of an older load are stale. Also the lines the screen shows while choosing and once
the model is ready."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from textual.content import Content
from textual.screen import Screen
from textual.worker import get_current_worker

from tqbench.chat import report
from tqbench.chat.request import ChatRequest
from tqbench.engine import engine
from tui.screens.chat_relay import relay_load

if TYPE_CHECKING:
    from tqbench.chat.session import ChatSession  # importing it loads MLX

GROUP = "load"  # the workers' group

RESIDENT_HINT = "experts resident: o streams them from disk (with a cache budget) to watch them page in"
FAILED_HINT = "Convert the model again on the Convert screen (c), or another one, then come back here (t) to load it."


def choosing_line() -> Content:
    """The band's text while the model is being chosen."""
    waiting = " (waiting for the engine's running job to end first)" if engine().busy else ""
    return Content.styled(f"choosing a model...{waiting}", "$text-muted")


def ready_line(loaded) -> Content:
    """The status once `loaded` (tqbench.events.ModelLoaded) is ready: its sampling, then how its experts are
    held."""
    template = "; no chat template: turns are plain text" if not loaded.chat_template else ""
    streaming = report.streaming_text(loaded)
    streaming = RESIDENT_HINT if streaming is None else f"{streaming}; o: settings"
    return Content.styled(f"ready: {report.sampling_line(loaded.sampling)}{template}\n{streaming}", "$text-muted")


class ModelLoad:
    """One load at a time for the screen: a new one supersedes the one before (its messages are dropped)."""

    def __init__(self, screen: Screen, session: Callable[[], ChatSession]) -> None:
        self._screen = screen
        self._session = session  # the screen's ChatSession (made on the worker's thread the first time)
        self.load_id = 0
        self.loading = False
        self.chosen = None  # tqbench.events.ModelChosen of the model loaded
        self.loaded = None  # tqbench.events.ModelLoaded

    def start(self, request: ChatRequest) -> None:
        """Choose the model (the last converted, else the demo) and open it with `request`."""
        self.load_id += 1
        self.loading = True
        self.loaded = self.chosen = None
        self._screen.run_worker(partial(self._load, self.load_id, request), thread=True, exclusive=True, group=GROUP,
                                exit_on_error=False, description="load the chat model")

    def current(self, load_id: int) -> bool:
        return load_id == self.load_id

    def ready(self, chosen, loaded) -> None:
        self.loading = False
        self.chosen, self.loaded = chosen, loaded

    def failed(self) -> None:
        self.loading = False

    def newer_model(self) -> bool:
        """A conversion finished after the model loaded was chosen (it is the one to load now)."""
        from tqbench.state import last_model

        last = last_model()
        return last is not None and self.loaded is not None and last.resolve() != Path(self.loaded.path).resolve()

    def _load(self, load_id: int, request: ChatRequest) -> None:
        worker = get_current_worker()
        relay_load(self._screen.post_message, self._session(), request, load_id, lambda: worker.is_cancelled)

"""The Chat screen's streaming settings (key o, between turns): the expert cache budget, experts routed per token,
prefetch workers, fan-out, look-ahead and cache policy, as `tqbench chat` takes them. They are fixed when a model is
opened, so applying them re-opens the model: a new conversation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from tqbench.errors import TqbenchError

POLICIES = ("lrfu-next", "lrfu", "lru")  # tqbench.stream.cache.POLICIES, the default first
ON_OFF = [("off", False), ("on", True)]


@dataclass(frozen=True)
class ChatOptions:
    budget: str = "fit"  # fit: stream only when the model does not fit (tqbench chat's default); auto; off; a size
    max_active_experts: int = 0  # 0: the model's own top-k
    workers: int = 4
    fanout: bool = False
    lookahead: bool = False
    policy: str = "lrfu-next"

    def check(self) -> ChatOptions:
        """Raise TqbenchError for a value tqbench chat would refuse."""
        from tqbench.recipe.fit import parse_size

        if self.budget not in ("fit", "auto", "off"):
            parse_size(self.budget)
        if self.max_active_experts < 0:
            raise TqbenchError("max active experts: 0 (the model's own) or more")
        if not 1 <= self.workers <= 256:
            raise TqbenchError("prefetch workers: 1 to 256")
        if self.policy not in POLICIES:
            raise TqbenchError(f"cache policy: {' or '.join(POLICIES)}")
        return self


def stream_config(path: str, opts: ChatOptions):
    """The tqbench.stream.StreamConfig `opts` ask for on the model at `path`, or None to keep it resident. Reads the
    model's expert layout (shard headers): call it off the UI thread."""
    from tqbench.recipe.fit import parse_size
    from tqbench.stream import StreamConfig
    from tqbench.stream.budget import auto_budget, needs_streaming
    from tqbench.stream.store import ExpertStore, StoreError

    if opts.budget == "off":
        return None
    try:
        store = ExpertStore.open(Path(path))
        store.close()
    except (StoreError, OSError):
        if opts.budget == "fit":
            return None
        raise TqbenchError("no routed experts to stream: set the cache budget to fit or off", path) from None
    if opts.budget == "fit" and not needs_streaming(path, store=store):
        return None
    nbytes = auto_budget(path, store=store) if opts.budget in ("fit", "auto") else parse_size(opts.budget)
    return StreamConfig(nbytes, opts.workers, opts.policy, opts.fanout, lookahead=opts.lookahead)


class SettingsScreen(ModalScreen[ChatOptions | None]):
    """Edits ChatOptions; dismissed with the new options (Apply, or enter in a field) or None (Cancel, esc)."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    #settings { width: 64; max-width: 100%; height: auto; border: round $accent; padding: 0 1; background: $surface; }
    #settings .row { height: 1; }
    #settings .row Label { width: 22; }
    #settings .row Input, #settings .row Select { width: 1fr; }
    #settings-note { color: $text-muted; margin: 1 0; }
    #settings-error { color: $text-error; display: none; }
    #settings-buttons { height: 1; align: right middle; }
    #settings-buttons Button { margin: 0 0 0 2; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, opts: ChatOptions) -> None:
        super().__init__()
        self.opts = opts

    def compose(self) -> ComposeResult:
        o = self.opts
        with Vertical(id="settings") as box:
            box.border_title = "streaming settings"
            box.border_subtitle = "enter applies · esc cancels"  # the Chat screen's footer below is not this dialog's
            with Horizontal(classes="row"):
                yield Label("expert cache budget")
                yield Input(o.budget, placeholder="fit, auto, off or a size (8MB)", id="opt-budget", compact=True)
            with Horizontal(classes="row"):
                yield Label("max active experts")
                yield Input(str(o.max_active_experts), type="integer", id="opt-active", compact=True)
            with Horizontal(classes="row"):
                yield Label("prefetch workers")
                yield Input(str(o.workers), type="integer", id="opt-workers", compact=True)
            with Horizontal(classes="row"):
                yield Label("cache policy")
                yield Select([(p, p) for p in POLICIES], value=o.policy, allow_blank=False, id="opt-policy",
                             compact=True)
            with Horizontal(classes="row"):
                yield Label("fan-out")
                yield Select(ON_OFF, value=o.fanout, allow_blank=False, id="opt-fanout", compact=True)
            with Horizontal(classes="row"):
                yield Label("look-ahead")
                yield Select(ON_OFF, value=o.lookahead, allow_blank=False, id="opt-lookahead", compact=True)
            yield Static("Applying re-opens the model with these settings: a new conversation.\n"
                         "budget: fit (stream only a model that does not fit in memory), auto, off or a size. "
                         "max active experts: 0 keeps the model's top-k. fan-out splits each read across the "
                         "workers; look-ahead reads the next layer's likely experts early.", id="settings-note")
            yield Static("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="settings-apply", compact=True)
                yield Button("Cancel", id="settings-cancel", compact=True)

    def options(self) -> ChatOptions:
        def number(field: str) -> int:
            text = self.query_one(field, Input).value.strip()
            try:
                return int(text)
            except ValueError:
                raise TqbenchError(f"not a whole number: {text!r}") from None

        budget = self.query_one("#opt-budget", Input).value.strip() or "fit"
        return ChatOptions(budget.lower() if budget.lower() in ("fit", "auto", "off") else budget,
                           number("#opt-active"), number("#opt-workers"),
                           self.query_one("#opt-fanout", Select).value is True,
                           self.query_one("#opt-lookahead", Select).value is True,
                           str(self.query_one("#opt-policy", Select).value)).check()

    @on(Button.Pressed, "#settings-apply")
    @on(Input.Submitted)
    def apply(self) -> None:
        try:
            opts = self.options()
        except TqbenchError as e:
            error = self.query_one("#settings-error", Static)
            error.update(str(e))
            error.display = True
            return
        self.dismiss(opts)

    @on(Button.Pressed, "#settings-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)

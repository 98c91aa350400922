"""The Chat screen's streaming settings (key o, between turns): the expert cache budget, the host-RAM tier, experts
routed per token, prefetch workers, fan-out, look-ahead, cache policy and cache routing's margin, as `tqbench chat`
takes them. They are fixed when a model is opened, so applying them re-opens the model: a new conversation."""

from __future__ import annotations

from dataclasses import replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from tqbench.chat.request import BUDGET_WORDS, HOST_WORDS, POLICIES, ChatRequest
from tqbench.errors import TqbenchError

ON_OFF = [("off", False), ("on", True)]


class SettingsScreen(ModalScreen[ChatRequest | None]):
    """Edits a ChatRequest's streaming settings; dismissed with the new request (Apply, or enter in a field), checked
    by the engine (tqbench.chat.request), or None (Cancel, esc)."""

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

    def __init__(self, request: ChatRequest) -> None:
        super().__init__()
        self.request = request

    def compose(self) -> ComposeResult:
        o, active = self.request.stream, self.request.max_active_experts
        with Vertical(id="settings") as box:
            box.border_title = "streaming settings"
            box.border_subtitle = "enter applies · esc cancels"  # the Chat screen's footer below is not this dialog's
            with Horizontal(classes="row"):
                yield Label("expert cache budget")
                yield Input(o.budget, placeholder="fit, auto, off or a size (8GB, 512MB)", id="opt-budget",
                            compact=True)
            with Horizontal(classes="row"):
                yield Label("host RAM tier")
                yield Input(o.host_budget, placeholder="auto, off or a size (24GB)", id="opt-host", compact=True)
            with Horizontal(classes="row"):
                yield Label("max active experts")
                yield Input(str(active), type="integer", id="opt-active", compact=True)
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
            with Horizontal(classes="row"):
                yield Label("cache routing margin")
                yield Input(f"{o.cache_routing:g}", type="number", id="opt-routing", compact=True)
            yield Static("Applying re-opens the model with these settings: a new conversation.\n"
                         "budget: fit (stream only a model that does not fit in memory), auto, off or a size (a bare "
                         "number is GB). host RAM tier: experts evicted from GPU memory kept in RAM (auto: on "
                         "CUDA only; unified memory has one tier). "
                         "max active experts: 0 keeps the model's top-k. fan-out splits each read across the "
                         "workers; look-ahead reads the next layer's likely experts early. cache routing: "
                         "decode may pick a cached expert scored up to the margin lower (0: off; changes the output).",
                         id="settings-note")
            yield Static("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="settings-apply", compact=True)
                yield Button("Cancel", id="settings-cancel", compact=True)

    def options(self) -> ChatRequest:
        """The request with this dialog's settings; TqbenchError (one line) for a value the engine refuses."""
        def number(field: str) -> int:
            text = self.query_one(field, Input).value.strip()
            try:
                return int(text)
            except ValueError:
                raise TqbenchError(f"not a whole number: {text!r}") from None

        margin = self.query_one("#opt-routing", Input).value.strip() or "0"
        try:
            routing = float(margin)
        except ValueError:
            raise TqbenchError(f"not a number: {margin!r}") from None
        budget = self.query_one("#opt-budget", Input).value.strip() or "fit"
        host = self.query_one("#opt-host", Input).value.strip() or "auto"
        stream = replace(self.request.stream, budget=budget.lower() if budget.lower() in BUDGET_WORDS else budget,
                         host_budget=host.lower() if host.lower() in HOST_WORDS else host,
                         workers=number("#opt-workers"), policy=str(self.query_one("#opt-policy", Select).value),
                         fanout=self.query_one("#opt-fanout", Select).value is True,
                         lookahead=self.query_one("#opt-lookahead", Select).value is True, cache_routing=routing)
        return replace(self.request, stream=stream, max_active_experts=number("#opt-active")).check()

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

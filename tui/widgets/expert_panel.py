"""The Chat screen's live expert view (streaming only): the MoE layers x routed experts map
(tui.widgets.expert_map) over a summary of the engine's figures (tqbench.chat.report.expert_summary): hit rate by
tier, tok/s, expert bytes per token, disk reads per second, the cache's fill. Beside the transcript, or under it on a
narrow screen; hidden while the experts are resident.

Fed with the reply worker's batches of tqbench.stream.PageIn events (`apply`), then the engine's StreamReport after
the reply (`finish`). `toggle_pause` freezes the view: batches are held until it resumes."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tqbench.chat import report
from tqbench.chat.events import StreamReport
from tqbench.chat.live import PageInMap, ReplyRates
from tqbench.chat.records import StreamSetup
from tui.spans import content
from tui.widgets.expert_map import ExpertMapView, natural_width

SUMMARY_INTERVAL = 0.25  # seconds between updates of the figures during a reply
NARROW = 70  # screens narrower than this show the view under the transcript, not beside it


class ExpertPanel(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.experts: PageInMap | None = None  # the view's state (None: resident experts, nothing to show)
        self.setup: StreamSetup | None = None
        self.report: StreamReport | None = None  # the engine's figures after the last reply
        self.rates: ReplyRates | None = None  # the last reply's rates
        self._held: list = []  # page-ins that came while the view was paused
        self._summary_at = 0.0

    def compose(self) -> ComposeResult:
        yield ExpertMapView(id="expert-map")
        yield Static("", id="expert-summary")

    def on_mount(self) -> None:
        self.map_view = self.query_one(ExpertMapView)  # kept: a batch's handler should not search the DOM
        self.summary = self.query_one("#expert-summary", Static)

    @property
    def paused(self) -> bool:
        return self.map_view.paused

    def show(self, setup: StreamSetup | None) -> None:
        """A new model: its streamed layers, or None (resident experts: the panel hides)."""
        self.setup = setup
        self.experts = PageInMap(dict(setup.layers)) if setup is not None and setup.layers else None
        self.report, self.rates, self._held = None, None, []
        self.map_view.set_model(self.experts)
        self.display = self.experts is not None
        self.show_summary()

    def apply(self, events, rates: ReplyRates) -> None:
        """A batch of a reply's page-ins and its rates so far."""
        if self.experts is None:
            return
        self.rates, self.report = rates, None
        if self.map_view.paused:  # frozen: the batches wait until the view resumes
            self._held.extend(events)
            return
        self.experts.apply(events)
        self.map_view.update_view()
        if time.monotonic() - self._summary_at >= SUMMARY_INTERVAL:
            self.show_summary()

    def finish(self, stats: StreamReport | None, decode_tps: float | None) -> None:
        """The reply is over: draw the last batch; the engine's figures replace the view's own counts."""
        if self.experts is None:
            return
        self.map_view.update_view(force=True)  # the last batch may have come inside DRAW_INTERVAL
        if stats is not None:
            self.report = stats
            if decode_tps is not None and self.rates is not None:  # the engine's decode rate, not the estimate
                self.rates = ReplyRates(tok_s=decode_tps, bytes_per_token=self.rates.bytes_per_token,
                                        read_bps=self.rates.read_bps)
            self.show_summary()

    def toggle_pause(self) -> bool:
        """Pause or resume; returns whether the view is paused now."""
        self.map_view.set_paused(not self.map_view.paused)
        if not self.map_view.paused:
            if self.experts is not None:
                self.experts.apply(self._held)
            self._held = []
            self.map_view.update_view()
            self.show_summary()
        return self.map_view.paused

    def show_summary(self) -> None:
        if self.map_view.paused:
            return
        self._summary_at = time.monotonic()
        if self.experts is not None and self.setup is not None:
            lines = report.expert_summary(self.experts, self.setup.budget_bytes, self.rates, report=self.report,
                                          disk_bps=self.setup.disk_bytes_per_s,
                                          host_budget=self.setup.host_budget_bytes)
            self.summary.update(content(lines), layout=False)  # at most 5 lines, its height: no layout pass

    def place(self, body, width: int, height: int) -> None:
        """Beside the transcript in `body`, or under it on a narrow screen."""
        if self.experts is None:
            return
        narrow = width < NARROW
        body.set_class(narrow, "narrow")
        body.styles.layout = "vertical" if narrow else "horizontal"
        if narrow:
            self.styles.width = "1fr"
            self.styles.height = min(len(self.experts.layers) + 6, max(8, height // 2))
        else:
            self.styles.height = "1fr"
            self.styles.width = max(36, min(natural_width(self.experts) + 2, width // 2))

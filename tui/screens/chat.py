"""The Chat screen: talk to a converted model kept resident in an engine session.

Which model: the one converted last (the Convert screen records each finished output with
tqbench.state.remember_model), else the built-in demo converted with tq4 (converted first if needed, with its
progress shown): tqbench.runtime.models.choose_model. Coming back to the screen after another conversion finished
loads that one (a new conversation); a load that failed (one line on the screen) is tried again.

All MLX work runs on the process's engine thread (tqbench.engine): the screen submits `choose_model`, `open_model`,
`reply`, `last_reply` and `reset` as jobs of its `Session`, and thread workers relay their plain events as messages.
A reply streams into the transcript: its worker posts the whole text so far at most every STREAM_INTERVAL (queued
copies merge), so a fast model never floods the UI. Esc stops a reply (the engine closes it after the token in
progress); the partial reply stays, marked as stopped, and is part of the conversation (the engine keeps it), so the
next turn continues from it. Sending while a reply runs is refused with a notice (nothing is queued). ctrl+r forgets
the conversation.

The live expert view (streaming only): beside the transcript (under it on a narrow screen), the MoE layers x routed
experts map (tui.widgets.expert_map) with each layer's recent misses and stall time, and a summary: hit rate by tier,
tok/s, expert bytes per token, disk reads per second, the cache's fill. The reply worker posts the page-ins
(tqbench.stream.PageIn) in batches with the text (ChatExperts, never one message per event); after the reply the
summary takes the engine's StreamStats. v pauses the view; o opens the streaming settings (cache budget, max active
experts, prefetch workers, fan-out, look-ahead, cache policy), which re-open the model: a new conversation; e exports
the learned hot-expert profile (as `tqbench profile export`) to a file in the cache directory, whose path is shown.

While the message field has focus, printable keys type: the app's one-letter keys (q, s, p, c) are hidden from the
footer and ctrl+q quits; esc leaves the field (then the transcript scrolls and the app's keys work; i or enter types
again).
"""

from __future__ import annotations

import time
from pathlib import Path

import humanize

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ProgressBar, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench import units
from tqbench.engine import Job, Session, engine, submit
from tqbench.errors import TqbenchError
from tui.experts import GLYPHS, ExpertMap, ReplyClock, ReplyRates
from tui.messages import (ChatConvertProgress, ChatExperts, ChatLoadFailed, ChatLoadStep, ChatModelReady,
                          ChatProfileExported, ChatReplyBegan, ChatReplyEnded, ChatReplyFailed, ChatReplyProgress,
                          ChatResetDone)
from tui.screens.chat_settings import ChatOptions, SettingsScreen, stream_config
from tui.state import display_path
from tui.widgets.expert_map import ExpertMapView, natural_width
from tui.widgets.inputs import OrderedInput
from tui.widgets.model_band import ModelBand
from tui.widgets.transcript import ReplyTurn, Transcript, UserTurn

STREAM_INTERVAL = 0.05  # seconds between updates of a streaming reply
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of the demo's conversion
STATUS_KEY = 8  # width of the status lines' labels
NARROW = 70  # screens narrower than this show the expert view under the transcript, not beside it
SUMMARY_INTERVAL = 0.25  # seconds between updates of the expert view's figures during a reply
START_HINT = "Type a message below and press enter. esc stops a reply; ctrl+r starts a new conversation."


def one_line(error: BaseException) -> str:
    """A TqbenchError's own line; anything else as `Type: message` (never a traceback)."""
    text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split()) or type(error).__name__


def sampling_text(sampling) -> str:
    """`greedy, up to 64 tokens per reply` (as `tqbench chat` says it)."""
    s = sampling
    how = "greedy" if s.temp == 0 else f"temp {s.temp:g}" + (f", top-p {s.top_p:g}" if s.top_p else "") + (
        f", top-k {s.top_k}" if s.top_k else "")
    return f"{how}, up to {s.max_tokens} tokens per reply"


def reply_summary(done) -> Content:
    """The status line after a reply (tqbench.runtime.chat.ReplyDone), as two lines: the reply's tokens, decode rate
    and peak memory; the prompt's tokens processed (prefill rate) and those reused from the cache."""
    ending = {"length": " (max tokens)", "cancelled": " (stopped)"}.get(done.finish_reason, "")
    sep = Content.styled(" · ", "$text-muted")
    return Content.assemble(
        (f"{'reply':<{STATUS_KEY}}", "$text-muted"), (f"{done.generated_tokens} tokens{ending}", "bold"),
        " at ", (f"{done.decode_tps:.1f} tok/s", "bold"), sep,
        "peak memory ", (units.gb(done.peak_memory_bytes), "bold"), "\n",
        (f"{'prompt':<{STATUS_KEY}}", "$text-muted"), (f"{done.prompt_tokens} processed", "bold"),
        " at ", (f"{done.prefill_tps:.1f} tok/s", "bold"), sep,
        (f"{done.cached_tokens} reused", "bold"), " from the cache")


def streaming_text(loaded) -> str:
    """How the model runs its experts, for the status line once loaded."""
    st = loaded.stream
    if st is None:
        return "experts resident: o streams them from disk (with a cache budget) to watch them page in"
    extra = "".join(x for x, on in ((", fan-out", st["fanout"]), (", look-ahead", st["lookahead"])) if on)
    active = f", {loaded.experts_active} of {loaded.experts_native} experts" if loaded.experts_active else ""
    workers = f"{st['workers']} worker" + ("s" if st["workers"] != 1 else "")
    return (f"streaming experts: cache {units.gb(st['budget_bytes'])}, {workers}, {st['policy']}"
            f"{extra}{active}; o: settings")


def expert_summary(model: ExpertMap, budget: int, rates: ReplyRates | None, stats: dict | None,
                   disk_bps: float | None = None) -> Content:
    """The expert view's figures: hit rate split by tier, decode rate, expert bytes per token, disk reads per second
    against this disk's measured bandwidth (`disk_bps`), the cache's fill against its budget. `stats`
    (tqbench.runtime.session.stream_stats, after a reply) overrides the counts the view made from the page-ins (they
    agree; the engine's are authoritative)."""
    if stats is not None:
        seen = {k: stats[f"hits_{k}"] for k in ("pinned", "cache", "prefetched")} | {"miss": stats["misses"]}
        rate, cache = stats["hit_rate"], stats["cache_bytes"]
    else:
        seen, rate, cache = model.seen, model.hit_rate(), model.cache_bytes
    total = sum(seen.values())
    if not total:
        return Content.styled(f"no expert routed yet; cache {units.gb(budget)}\nP pinned  = cache  + ahead  # disk",
                              "$text-muted")
    sep = Content.styled(" · ", "$text-muted")
    split = Content(" ").join(Content.assemble((GLYPHS[k], "bold"), f"{seen[k] / total:.0%}")
                              for k in ("pinned", "cache", "prefetched", "miss"))
    lines = [Content.assemble("hits ", (f"{rate:.1%}", "bold"), "  ", split)]
    if rates is not None:
        per_token = humanize.naturalsize(rates.bytes_per_token, format="%.1f")
        lines.append(Content.assemble((f"{rates.tok_s:.1f} tok/s", "bold"), sep, (per_token, "bold"),
                                      " read per token"))
        of = f" of {disk_bps / 1e6:,.0f}" if disk_bps else ""  # the disk's measured bandwidth
        lines.append(Content.assemble("disk ", (f"{rates.read_bps / 1e6:.1f}", "bold"), f"{of} MB/s"))
        lines.append(Content.assemble("cache ", (f"{cache / budget:.0%}" if budget else "-", "bold"),
                                      f" of {units.gb(budget)}"))
    else:
        lines.append(Content.assemble("cache ", (units.gb(cache), "bold"), f" of {units.gb(budget)}"))
    lines.append(Content.styled("P pinned  = cache  + ahead  # disk", "$text-muted"))
    return Content("\n").join(lines)


class ChatInput(OrderedInput):
    """The message field: enter sends. While it has focus the app's one-letter keys are hidden (they type)."""

    hides_app_keys = True
    BINDINGS = [Binding("enter", "submit", "Send")]

    def __init__(self, **kwargs) -> None:
        super().__init__(compact=True, select_on_focus=False, **kwargs)


class ChatScreen(Screen):
    """The model's header band, the transcript with the live expert view beside it (streaming only), a status line
    and the message field."""

    DEFAULT_CSS = """
    #chat-body { height: 1fr; }
    #chat-body > Transcript { width: 1fr; }
    #expert-panel { display: none; width: 38; height: 1fr; border-left: vkey $foreground 20%; padding: 0 0 0 1; }
    #chat-body.narrow #expert-panel { width: 1fr; border-left: none; border-top: hkey $foreground 20%; padding: 0; }
    #expert-summary { height: 5; }
    """
    AUTO_FOCUS = "#chat-input"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),  # while a reply runs
        Binding("escape", "leave_input", "Transcript"),  # otherwise, from the message field
        Binding("i", "type", "Type"),  # from the transcript
        Binding("enter", "type", "Type", show=False),
        Binding("ctrl+r", "reset", "Reset"),
        Binding("v", "pause_view", "Pause"),
        Binding("o", "settings", "Settings"),
        Binding("e", "export_profile", "Export", show=False),  # in the help screen and the palette: room in the footer
        Binding("ctrl+q", "quit_app", "Quit"),  # shown while the field hides the app's q
    ]

    def __init__(self) -> None:
        super().__init__()
        self.session = Session()
        self.chosen = None  # tqbench.runtime.models.ModelChosen of the model loaded (or loading)
        self.loaded = None  # tqbench.runtime.session.ModelLoaded
        self.last_done = None  # tqbench.runtime.chat.ReplyDone of the last reply
        self.error: str | None = None
        self._load_id = 0
        self._loading = False
        self._turn_id = 0
        self._job: Job | None = None
        self._stopping = False
        self._resetting = False
        self._user: UserTurn | None = None
        self._reply: ReplyTurn | None = None
        self.options = ChatOptions()  # streaming settings the next load uses
        self.experts: ExpertMap | None = None  # the expert view's state (streaming only)
        self.stream: dict | None = None  # stream_stats after the last reply
        self.rates: ReplyRates | None = None  # the last reply's rates
        self._held: list = []  # page-ins that came while the view was paused
        self._summary_at = 0.0  # when the summary was last updated

    def compose(self) -> ComposeResult:
        yield Header()
        yield ModelBand(id="chat-model")
        with Horizontal(id="chat-bar-row"):
            yield ProgressBar(total=None, show_eta=False, id="chat-bar")
            yield Label("", id="chat-bar-text")
        yield Static("", id="chat-error", markup=False)
        with Horizontal(id="chat-body"):
            yield Transcript(id="transcript")
            with Vertical(id="expert-panel"):
                yield ExpertMapView(id="expert-map")
                yield Static("", id="expert-summary")
        yield Static("", id="chat-status")
        yield ChatInput(placeholder="Type a message; enter sends", id="chat-input")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Chat"
        self.map_view = self.query_one(ExpertMapView)  # kept: a batch's handler should not search the DOM
        self.summary = self.query_one("#expert-summary", Static)

    def on_screen_resume(self) -> None:
        """Shown (first time or again): load the model converted last, unless it is the one loaded."""
        if self._loading or self.replying or self._resetting:
            return
        if self.loaded is None:  # not yet, or it failed (the user may have converted something meanwhile)
            self.load()
        elif self._newer_model():
            self.notify("A newer conversion finished: loading it (a new conversation).")
            self.load()

    def _newer_model(self) -> bool:
        from tqbench.state import last_model

        last = last_model()
        return last is not None and self.loaded is not None and last.resolve() != Path(self.loaded.path).resolve()

    @property
    def replying(self) -> bool:
        return self._job is not None

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    # ---- loading the model ----------------------------------------------------------------------------------------

    def load(self) -> None:
        """Choose the model (the last converted, else the demo) and load it in the session, in a worker."""
        self._load_id += 1
        self._loading = True
        self.loaded = self.chosen = self.last_done = None
        self._set_error(None)
        self.transcript.clear()
        self.transcript.hint("")
        waiting = " (waiting for the engine's running job to end first)" if engine().busy else ""
        self._band(Content.styled(f"choosing a model...{waiting}", "$text-muted"))
        self._status(Content(""))
        self._set_experts(None)
        self._load(self._load_id, self.options)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False, description="load the chat model")
    def _load(self, load_id: int, opts: ChatOptions) -> None:
        from tqbench.events import ConvertStarted, UnitConverted
        from tqbench.runtime.models import ModelChosen

        worker = get_current_worker()

        def cancelled() -> bool:
            return worker.is_cancelled

        def choose():  # on the engine thread (a conversion of the demo imports and runs MLX there)
            from tqbench.runtime.models import choose_model

            return choose_model()

        chosen: ModelChosen | None = None
        posted, latest = 0.0, None
        try:
            with submit(choose) as job:
                for ev in job.items(cancelled):
                    if isinstance(ev, UnitConverted):
                        latest = ev
                        if time.monotonic() - posted >= PROGRESS_INTERVAL:
                            self.post_message(ChatConvertProgress(load_id, ev))
                            posted, latest = time.monotonic(), None
                    elif isinstance(ev, ConvertStarted):
                        self.post_message(ChatLoadStep(load_id, (
                            f"no model converted yet: converting the demo with {ev.recipe} "
                            f"({ev.units:,} units, {units.gb(ev.bytes_in)})..."), converting=True))
                    elif isinstance(ev, ModelChosen):
                        chosen = ev
            if latest is not None:
                self.post_message(ChatConvertProgress(load_id, latest))
            if chosen is None or worker.is_cancelled:
                return
            self.post_message(ChatLoadStep(load_id, f"loading {display_path(Path(chosen.path))}..."))
            path = chosen.path

            def opener(session: Session):  # on the engine thread: ModelLoaded, then the experts per MoE layer
                from tqbench.runtime.session import KEY, open_model

                yield from open_model(session, path, trust_remote_code=False, streaming=stream_config(path, opts),
                                      max_active_experts=opts.max_active_experts)
                streamer = session.state[KEY].loaded.streamer
                yield {n: lay.experts for n, lay in streamer.store.layers.items()} if streamer else None

            loaded = layout = None
            with self.session.submit(opener) as job:
                for ev in job.items(cancelled):
                    if isinstance(ev, dict) or ev is None:
                        layout = ev
                    else:
                        loaded = ev
        except Exception as e:  # TqbenchError (bad input) or a bug: one line either way
            self.post_message(ChatLoadFailed(load_id, one_line(e)))
            return
        if loaded is not None and not worker.is_cancelled:
            self.post_message(ChatModelReady(load_id, chosen, loaded, layout))

    def on_chat_load_step(self, message: ChatLoadStep) -> None:
        if message.load_id != self._load_id:
            return
        self._band(Content.styled(message.text, "$text-muted"))
        row = self.query_one("#chat-bar-row")
        if message.converting:
            self.query_one("#chat-bar", ProgressBar).update(total=None, progress=0)
            self.query_one("#chat-bar-text", Label).update("")
        row.display = message.converting

    def on_chat_convert_progress(self, message: ChatConvertProgress) -> None:
        if message.load_id != self._load_id:
            return
        u = message.unit
        self.query_one("#chat-bar-row").display = True
        self.query_one("#chat-bar", ProgressBar).update(total=u.total_in, progress=u.done_in)
        self.query_one("#chat-bar-text", Label).update(f"{units.gb(u.done_in)} of {units.gb(u.total_in)}")

    def on_chat_model_ready(self, message: ChatModelReady) -> None:
        if message.load_id != self._load_id:
            return
        self._loading = False
        self.chosen, self.loaded = message.chosen, message.loaded
        self.query_one("#chat-bar-row").display = False
        m = message.loaded
        self.query_one(ModelBand).show_model(message.chosen, m)
        template = "; no chat template: turns are plain text" if not m.chat_template else ""
        self.transcript.hint(START_HINT)
        self._set_experts(ExpertMap(message.experts) if message.experts else None)
        self._status(Content.styled(f"ready: {sampling_text(m.sampling)}{template}\n{streaming_text(m)}",
                                    "$text-muted"))
        self.refresh_bindings()

    def on_chat_load_failed(self, message: ChatLoadFailed) -> None:
        if message.load_id != self._load_id:
            return
        self._loading = False
        self.query_one("#chat-bar-row").display = False
        self._band(Content.styled("no model loaded", "$text-muted"))
        self._set_error(f"could not load the model: {message.message}")
        self.transcript.hint("Convert a model on the Convert screen (c), then come back here (t) to load it.")
        self._status(Content(""))
        self.refresh_bindings()

    # ---- sending, streaming, stopping -----------------------------------------------------------------------------

    @on(Input.Submitted, "#chat-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            return
        if self.replying:
            self.notify("A reply is running: esc stops it, then send again.", severity="warning")
            return
        if self._resetting:
            self.notify("Resetting the conversation: send again in a moment.", severity="warning")
            return
        if self.loaded is None:
            self.notify("No model is loaded yet." if self._loading else "No model is loaded (see the error above).",
                        severity="warning")
            return
        self.chat_input.value = ""
        self.send(text)

    def send(self, text: str) -> None:
        """Start a turn: the user's text in the transcript, the reply streaming under it."""
        self._turn_id += 1
        self._stopping = False
        self._set_error(None)  # a failed reply's line
        sampling = self.loaded.sampling
        self._user = self.transcript.add_user(text)
        self._reply = self.transcript.add_reply(self.loaded.model_type)

        def make(session: Session):  # on the engine thread
            from tqbench.runtime.session import reply

            return reply(session, text, sampling)

        self._job = self.session.submit(make)
        self._status(Content.styled("waiting for the engine...", "$text-muted"))
        self._relay(self._turn_id, self._job, self.experts is not None)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="reply", exit_on_error=False, description="reply")
    def _relay(self, turn_id: int, job: Job, streaming: bool) -> None:
        from tqbench.runtime.chat import ReplyDone, ReplyStarted, TokenOut
        from tqbench.runtime.session import last_reply, stream_stats
        from tqbench.stream import PageIn

        worker = get_current_worker()
        runs: list[tuple[list[str], bool]] = []  # the reply so far: runs of (pieces, thinking)
        tokens = 0
        started = False
        done = None
        posted = 0.0
        clock = ReplyClock()
        batch: list[PageIn] = []  # page-ins since the last ChatExperts

        def flush() -> None:
            nonlocal batch
            if batch:
                self.post_message(ChatExperts(turn_id, tuple(batch), clock.rates()))
                batch = []

        def parts() -> tuple[tuple[str, bool], ...]:
            return tuple(("".join(pieces), thinking) for pieces, thinking in runs)

        try:
            for ev in job.items(lambda: worker.is_cancelled):
                if isinstance(ev, PageIn):
                    clock.page_in(ev)
                    batch.append(ev)
                elif isinstance(ev, TokenOut):
                    tokens += 1
                    clock.token()
                    if ev.text:
                        if runs and runs[-1][1] == ev.thinking:
                            runs[-1][0].append(ev.text)
                        else:
                            runs.append(([ev.text], ev.thinking))
                    if time.monotonic() - posted >= STREAM_INTERVAL:
                        flush()
                        self.post_message(ChatReplyProgress(turn_id, parts(), tokens))
                        posted = time.monotonic()
                elif isinstance(ev, ReplyStarted):
                    started = True
                    self.post_message(ChatReplyBegan(turn_id, ev))
                elif isinstance(ev, ReplyDone):
                    done = ev
            job.stop()
            job.wait()  # the reply is closed on the engine thread: the conversation holds what was generated
            flush()
            if done is None and started and tokens:
                done = self.session.call(last_reply)  # stopped with esc: the partial reply's figures
            stats = self.session.call(stream_stats) if streaming else None
        except Exception as e:  # TqbenchError or a bug: one line either way
            job.stop()
            flush()
            self.post_message(ChatReplyFailed(turn_id, one_line(e)))
            return
        self.post_message(ChatReplyEnded(turn_id, parts(), done, stats))

    def on_chat_reply_began(self, message: ChatReplyBegan) -> None:
        if message.turn_id != self._turn_id or self._stopping:
            return
        ev = message.event
        self._status(Content.assemble(
            f"processing the prompt: {ev.prompt_tokens} tokens, {ev.cached_tokens} reused from the cache",
            ("  esc: stop", "$text-muted")))

    def on_chat_experts(self, message: ChatExperts) -> None:
        if message.turn_id != self._turn_id or self.experts is None:
            return
        self.rates, self.stream = message.rates, None
        if self.map_view.paused:  # frozen: the batches wait until v resumes
            self._held.extend(message.events)
            return
        self.experts.apply(message.events)
        self.map_view.update_view()
        if time.monotonic() - self._summary_at >= SUMMARY_INTERVAL:
            self._show_summary()

    def on_chat_reply_progress(self, message: ChatReplyProgress) -> None:
        if message.turn_id != self._turn_id or self._reply is None:
            return
        self._reply.stream(message.parts)
        self.transcript.follow()
        if not self._stopping:
            self._status(Content.assemble(f"replying: {message.tokens} tokens", ("  esc: stop", "$text-muted")))

    def on_chat_reply_ended(self, message: ChatReplyEnded) -> None:
        if message.turn_id != self._turn_id:
            return
        done = message.done
        if done is None:  # stopped before the model began: the conversation does not hold the turn
            text = self._user.text if self._user is not None else ""
            for turn in (self._reply, self._user):
                if turn is not None:
                    self.transcript.remove_turn(turn)
            if text and not self.chat_input.value:
                self.chat_input.value = text
                self.chat_input.cursor_position = len(text)
            self._status(Content.styled("stopped before the model began: the message is back in the field",
                                        "bold $text-warning"))
        else:
            self.last_done = done
            self._reply.end(message.parts, done.finish_reason)
            self.transcript.follow()
            self._status(reply_summary(done))
        if self.experts is not None:
            self.map_view.update_view(force=True)  # the last batch may have come inside DRAW_INTERVAL
        if self.experts is not None and message.stream is not None:
            self.stream = message.stream
            if done is not None and self.rates is not None:  # the engine's decode rate, not the view's estimate
                self.rates = ReplyRates(done.decode_tps, self.rates.bytes_per_token, self.rates.read_bps)
            self._show_summary()
        self._ended()

    def on_chat_reply_failed(self, message: ChatReplyFailed) -> None:
        if message.turn_id != self._turn_id:
            return
        if self._reply is not None:
            self._reply.end(self._reply.parts, "failed")
        self._set_error(f"the reply failed: {message.message}")
        self._status(Content(""))
        if self.experts is not None:
            self.map_view.update_view(force=True)
        self._ended()

    def _ended(self) -> None:
        self._job = None
        self._stopping = False
        self._user = self._reply = None
        self.refresh_bindings()

    def action_stop(self) -> None:
        if self.replying and not self._stopping:
            self._stopping = True
            self._job.stop()  # the engine closes the reply after the token in progress
            self._status(Content.styled("stopping...", "bold $text-warning"))
            self.refresh_bindings()

    def action_reset(self) -> None:
        if self.replying:
            self.notify("A reply is running: esc stops it first.", severity="warning")
            return
        if self.loaded is None or self._resetting:
            return
        self._resetting = True
        self._status(Content.styled("resetting the conversation...", "$text-muted"))
        self._reset()

    @work(thread=True, exclusive=True, group="reset", exit_on_error=False, description="reset the conversation")
    def _reset(self) -> None:
        from tqbench.runtime.session import reset

        try:
            self.session.call(reset)
        except Exception as e:
            self.post_message(ChatResetDone(one_line(e)))
            return
        self.post_message(ChatResetDone())

    def on_chat_reset_done(self, message: ChatResetDone) -> None:
        self._resetting = False
        if message.error is not None:
            self._set_error(f"reset failed: {message.error}")
            return
        self.last_done = None
        self.transcript.clear()
        self.transcript.hint("A new conversation. " + START_HINT)
        self._status(Content.styled("conversation reset: the cache is empty", "$text-muted"))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that ended with an exception it did not turn into a message still ends as one line."""
        if event.state is not WorkerState.ERROR:
            return
        text = one_line(event.worker.error)
        if event.worker.group == "load":
            self.post_message(ChatLoadFailed(self._load_id, text))
        elif event.worker.group == "reply" and self.replying:
            self.post_message(ChatReplyFailed(self._turn_id, text))
        elif event.worker.group == "reset":
            self.post_message(ChatResetDone(text))

    # ---- keys -----------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        typing = isinstance(self.focused, ChatInput)
        if action == "stop":
            return self.replying and not self._stopping
        if action == "leave_input":
            return typing and not self.replying
        if action == "type":
            return not typing
        if action == "reset":
            return True if self.loaded is not None else None  # while a reply runs: a notice says esc first
        if action == "quit_app":
            return typing
        if action == "pause_view":
            return self.experts is not None
        if action in ("settings", "export_profile"):
            return True if self.loaded is not None or not self._loading else None
        return True

    def action_leave_input(self) -> None:
        self.transcript.focus()

    def action_type(self) -> None:
        self.chat_input.focus()

    async def action_quit_app(self) -> None:
        await self.app.action_quit()

    # ---- the expert view, settings, the profile --------------------------------------------------------------------

    def _set_experts(self, model: ExpertMap | None) -> None:
        self.experts, self.stream, self.rates, self._held = model, None, None, []
        self.query_one(ExpertMapView).set_model(model)
        self._show_summary()
        self._layout()

    def _show_summary(self) -> None:
        if self.map_view.paused:
            return
        self._summary_at = time.monotonic()
        if self.experts is not None and self.loaded is not None and self.loaded.stream is not None:
            budget, disk = self.loaded.stream["budget_bytes"], self.loaded.stream.get("disk_bytes_per_s")
            self.summary.update(  # at most 5 lines, its height: no layout pass needed
                expert_summary(self.experts, budget, self.rates, self.stream, disk), layout=False)

    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        """The expert view beside the transcript, or under it on a narrow screen; hidden without streaming."""
        panel, body = self.query_one("#expert-panel"), self.query_one("#chat-body")
        panel.display = self.experts is not None
        if self.experts is None:
            return
        width = self.size.width
        narrow = width < NARROW
        body.set_class(narrow, "narrow")
        body.styles.layout = "vertical" if narrow else "horizontal"
        if narrow:
            panel.styles.width = "1fr"
            panel.styles.height = min(len(self.experts.layers) + 6, max(8, self.size.height // 2))
        else:
            panel.styles.height = "1fr"
            panel.styles.width = max(36, min(natural_width(self.experts) + 2, width // 2))

    def action_pause_view(self) -> None:
        view = self.query_one(ExpertMapView)
        view.set_paused(not view.paused)
        if not view.paused:
            if self.experts is not None:
                self.experts.apply(self._held)
            self._held = []
            view.update_view()
            self._show_summary()
        self.notify("expert view paused (v resumes)" if view.paused else "expert view resumed")

    def action_settings(self) -> None:
        if self.replying or self._loading or self._resetting:
            self.notify("Streaming settings change between turns: wait for the reply (esc stops it).",
                        severity="warning")
            return

        def chosen(opts: ChatOptions | None) -> None:
            if opts is None or opts == self.options and self.loaded is not None:
                return
            self.options = opts
            self.notify("Re-opening the model with the new streaming settings: a new conversation.")
            self.load()
            self.call_after_refresh(self.chat_input.focus)  # a new conversation: the next key types its first message

        self.app.push_screen(SettingsScreen(self.options), chosen)

    def action_export_profile(self) -> None:
        if self.replying or self.loaded is None:
            self.notify("Export the profile between turns, with a model loaded.", severity="warning")
            return
        from tqbench.paths import cache_dir

        self._export(str(cache_dir() / "profile-exports" / f"{Path(self.loaded.path).name}.json"))

    @work(thread=True, exclusive=True, group="export", exit_on_error=False, description="export the profile")
    def _export(self, file: str) -> None:
        from tqbench.runtime.session import export_profile

        try:
            info = self.session.call(lambda s: export_profile(s, file))
        except Exception as e:
            self.post_message(ChatProfileExported(None, error=one_line(e)))
            return
        self.post_message(ChatProfileExported(info["file"], info["routings"]))

    def on_chat_profile_exported(self, message: ChatProfileExported) -> None:
        if message.error is not None:
            self.notify(f"profile not exported: {message.error}", severity="error")
            return
        where = display_path(Path(message.file))
        self._status(Content.assemble("profile exported to ", (where, "bold"),
                                      (f"\n{message.routings:,.0f} routings; tqbench chat --profile FILE uses it",
                                       "$text-muted")))
        self.notify(f"profile exported to {where}")

    # ---- lines ----------------------------------------------------------------------------------------------------

    def _band(self, content: Content) -> None:
        self.query_one(ModelBand).show_text(content)

    def _status(self, content: Content) -> None:
        self.query_one("#chat-status", Static).update(content)

    def _set_error(self, text: str | None) -> None:
        self.error = text
        line = self.query_one("#chat-error", Static)
        line.update(text or "")
        line.display = text is not None

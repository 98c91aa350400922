"""The Chat screen: talk to a converted model kept resident in an engine session.

Which model: the one converted last (the Convert screen records each finished output with
tqbench.state.remember_model), else the built-in demo converted with tq4 (converted first if needed, with its
progress shown): tqbench.runtime.models.choose_model. Coming back to the screen after another conversion finished
loads that one (a new conversation); a load that failed (one line on the screen) is tried again.

The engine owns the chat (tqbench.chat): the screen keeps a ChatRequest (the streaming settings edit it) and a
ChatSession whose jobs run on the engine thread; thread workers relay their typed events as messages
(tui.screens.chat_relay), and every line the screen shows about the model, a reply or the experts comes from
tqbench.chat.report. A reply streams into the transcript: its worker posts the whole text so far at most every
STREAM_INTERVAL (queued copies merge), so a fast model never floods the UI. Esc stops a reply (the engine closes it
after the token in progress); the partial reply stays, marked as stopped, and is part of the conversation (the engine keeps it), so the
next turn continues from it. Sending while a reply runs is refused with a notice (nothing is queued). ctrl+r forgets
the conversation.

The live expert view (streaming only, tui.widgets.expert_panel): beside the transcript (under it on a narrow screen),
the MoE layers x routed experts map with each layer's recent misses and stall time, and the engine's figures. The
reply worker posts the page-ins (tqbench.stream.PageIn) in batches with the text (ChatExperts, never one message per
event); after the reply the summary takes the engine's StreamReport. v pauses the view; o opens the streaming
settings (cache budget, max active experts, prefetch workers, fan-out, look-ahead, cache policy), which re-open the
model: a new conversation; e exports the learned hot-expert profile (as `tqbench profile export`) to a file in the
cache directory, whose path is shown.

While the message field has focus, printable keys type: the app's one-letter keys (q, s, p, c) are hidden from the
footer and ctrl+q quits; esc leaves the field (then the transcript scrolls and the app's keys work; i or enter types
again).
"""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ProgressBar, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench import units
from tqbench.chat import report
from tqbench.chat.request import ChatRequest
from tqbench.engine import Job, engine
from tui.messages import (ChatConvertProgress, ChatExperts, ChatLoadFailed, ChatLoadStep, ChatModelReady,
                          ChatProfileExported, ChatReplyBegan, ChatReplyEnded, ChatReplyFailed, ChatReplyProgress,
                          ChatResetDone)
from tui.screens.chat_relay import one_line, relay_load, relay_reply
from tui.screens.chat_settings import SettingsScreen
from tui.spans import content
from tui.state import display_path
from tui.widgets.expert_panel import ExpertPanel
from tui.widgets.inputs import OrderedInput
from tui.widgets.model_band import ModelBand
from tui.widgets.transcript import ReplyTurn, Transcript, UserTurn

START_HINT = "Type a message below and press enter. esc stops a reply; ctrl+r starts a new conversation."
RESIDENT_HINT = "experts resident: o streams them from disk (with a cache budget) to watch them page in"


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
        self._chat = None  # tqbench.chat.session.ChatSession, made on first use (importing it loads MLX)
        self.request = ChatRequest()  # what the next load opens (the streaming settings edit it)
        self.chosen = None  # tqbench.runtime.models.ModelChosen of the model loaded (or loading)
        self.loaded = None  # tqbench.chat.records.ModelLoaded
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

    def compose(self) -> ComposeResult:
        yield Header()
        yield ModelBand(id="chat-model")
        with Horizontal(id="chat-bar-row"):
            yield ProgressBar(total=None, show_eta=False, id="chat-bar")
            yield Label("", id="chat-bar-text")
        yield Static("", id="chat-error", markup=False)
        with Horizontal(id="chat-body"):
            yield Transcript(id="transcript")
            yield ExpertPanel(id="expert-panel")
        yield Static("", id="chat-status")
        yield ChatInput(placeholder="Type a message; enter sends", id="chat-input")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Chat"
        self.experts = self.query_one(ExpertPanel)

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
    def chat(self):
        """The screen's ChatSession: its model, conversation and profile learner live on the engine thread."""
        if self._chat is None:
            from tqbench.chat.session import ChatSession

            self._chat = ChatSession()
        return self._chat

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
        self.experts.show(None)
        self._layout()
        self._load(self._load_id, self.request)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False, description="load the chat model")
    def _load(self, load_id: int, request: ChatRequest) -> None:
        worker = get_current_worker()
        relay_load(self.post_message, self.chat, request, load_id, lambda: worker.is_cancelled)

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
        self.experts.show(m.stream)
        self._layout()
        streaming = report.streaming_text(m)
        streaming = RESIDENT_HINT if streaming is None else f"{streaming}; o: settings"
        self._status(Content.styled(f"ready: {report.sampling_line(m.sampling)}{template}\n{streaming}",
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
        self._user = self.transcript.add_user(text)
        self._reply = self.transcript.add_reply(self.loaded.model_type)
        self._job = self.chat.reply(text)
        self._status(Content.styled("waiting for the engine...", "$text-muted"))
        self._relay(self._turn_id, self._job, self.loaded.stream is not None)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="reply", exit_on_error=False, description="reply")
    def _relay(self, turn_id: int, job: Job, streaming: bool) -> None:
        worker = get_current_worker()
        relay_reply(self.post_message, self.chat, job, turn_id, streaming, lambda: worker.is_cancelled)

    def on_chat_reply_began(self, message: ChatReplyBegan) -> None:
        if message.turn_id != self._turn_id or self._stopping:
            return
        ev = message.event
        self._status(Content.assemble(
            f"processing the prompt: {ev.prompt_tokens} tokens, {ev.cached_tokens} reused from the cache",
            ("  esc: stop", "$text-muted")))

    def on_chat_experts(self, message: ChatExperts) -> None:
        if message.turn_id == self._turn_id:
            self.experts.apply(message.events, message.rates)

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
            self._status(content(report.reply_lines(done)))
        self.experts.finish(message.stream, done.decode_tps if done is not None else None)
        self._ended()

    def on_chat_reply_failed(self, message: ChatReplyFailed) -> None:
        if message.turn_id != self._turn_id:
            return
        if self._reply is not None:
            self._reply.end(self._reply.parts, "failed")
        self._set_error(f"the reply failed: {message.message}")
        self._status(Content(""))
        self.experts.finish(None, None)
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
        try:
            self.chat.reset()
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
            return self.experts.experts is not None
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

    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        self.experts.place(self.query_one("#chat-body"), self.size.width, self.size.height)

    def action_pause_view(self) -> None:
        paused = self.experts.toggle_pause()
        self.notify("expert view paused (v resumes)" if paused else "expert view resumed")

    def action_settings(self) -> None:
        if self.replying or self._loading or self._resetting:
            self.notify("Streaming settings change between turns: wait for the reply (esc stops it).",
                        severity="warning")
            return

        def chosen(request: ChatRequest | None) -> None:
            if request is None or request == self.request and self.loaded is not None:
                return
            self.request = request
            self.notify("Re-opening the model with the new streaming settings: a new conversation.")
            self.load()
            self.call_after_refresh(self.chat_input.focus)  # a new conversation: the next key types its first message

        self.app.push_screen(SettingsScreen(self.request), chosen)

    def action_export_profile(self) -> None:
        if self.replying or self.loaded is None:
            self.notify("Export the profile between turns, with a model loaded.", severity="warning")
            return
        from tqbench.paths import cache_dir

        self._export(str(cache_dir() / "profile-exports" / f"{Path(self.loaded.path).name}.json"))

    @work(thread=True, exclusive=True, group="export", exit_on_error=False, description="export the profile")
    def _export(self, file: str) -> None:
        try:
            info = self.chat.export_profile(file)
        except Exception as e:
            self.post_message(ChatProfileExported(None, error=one_line(e)))
            return
        self.post_message(ChatProfileExported(info.file, info.routings))

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

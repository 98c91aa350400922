"""The Chat screen: talk to a converted model kept resident in an engine session.

Which model: the one converted last (the Convert screen records each finished output with
tqbench.state.remember_model), else the built-in demo converted with tq4 (converted first if needed, with its
progress shown): tqbench.chat.choose.choose_model. Coming back to the screen after another conversion finished
loads that one (a new conversation); a load that failed (one line on the screen) is tried again.

The engine owns the chat (tqbench.chat): the screen keeps a ChatRequest (the streaming settings edit it) and a
ChatSession whose jobs run on the engine thread; thread workers relay their typed events as messages
(tui.screens.chat_relay), and every line the screen shows about the model, a reply or the experts comes from
tqbench.chat.report. The screen composes the widgets (the model band, the demo's conversion bar, the transcript, the
expert view), drives the controllers next to it and routes their messages: the model load (chat_load), the turns and
the reset (chat_turns), the profile export (chat_export); it keeps the keys and the layout. A reply streams into the
transcript: its worker posts the whole text so far at most every STREAM_INTERVAL (queued copies merge), so a fast
model never floods the UI. Esc stops a reply (the engine closes it after the token in progress); the partial reply
stays, marked as stopped, and is part of the conversation (the engine keeps it), so the next turn continues from it.
Sending while a reply runs is refused with a notice (nothing is queued). ctrl+r forgets the conversation.

The live expert view (streaming only, tui.widgets.expert_panel): beside the transcript (under it on a narrow screen),
the MoE layers x routed experts map with each layer's recent misses and stall time, and the engine's figures. The
reply worker posts the page-ins (tqbench.stream.PageIn) in batches with the text (ChatExperts, never one message per
event); after the reply the summary takes the engine's StreamReport. v pauses the view; o opens the streaming
settings (cache budget, max active experts, prefetch workers, fan-out, look-ahead, cache policy, cache routing),
which re-open the model: a new conversation; e exports the learned hot-expert profile (as `tqbench profile export`) to a file in the
cache directory, whose path is shown.

While the message field has focus, printable keys type: the app's one-letter keys (q, s, p, c) are hidden from the
footer and ctrl+q quits; esc leaves the field (then the transcript scrolls and the app's keys work; i or enter types
again).
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Header, Input, Static
from textual.worker import Worker, WorkerState

from tqbench.chat import report
from tqbench.chat.request import ChatRequest
from tui.messages import (ChatConvertProgress, ChatExperts, ChatLoadFailed, ChatLoadStep, ChatModelReady,
                          ChatProfileExported, ChatReplyBegan, ChatReplyEnded, ChatReplyFailed, ChatReplyNote,
                          ChatReplyProgress, ChatResetDone)
from tui.screens import chat_load, chat_turns
from tui.screens.chat_export import export_profile, exported_line
from tui.screens.chat_load import FAILED_HINT, ModelLoad, choosing_line, ready_line
from tui.screens.chat_relay import one_line
from tui.screens.chat_settings import SettingsScreen
from tui.screens.chat_turns import (RESET_LINE, RESETTING_LINE, START_HINT, STOPPED_EARLY_LINE, STOPPING_LINE,
                                    WAITING_LINE, ChatTurns, began_line, replying_line)
from tui.spans import content
from tui.widgets.conversion_bar import ConversionBar
from tui.widgets.expert_panel import ExpertPanel
from tui.widgets.footer import FittingFooter
from tui.widgets.inputs import OrderedInput
from tui.widgets.model_band import ModelBand
from tui.widgets.transcript import Transcript


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
        self.model = ModelLoad(self, lambda: self.chat)
        self.turns = ChatTurns(self, lambda: self.chat)
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield ModelBand(id="chat-model")
        yield ConversionBar(id="chat-bar-row")
        yield Static("", id="chat-error", markup=False)
        with Horizontal(id="chat-body"):
            yield Transcript(id="transcript")
            yield ExpertPanel(id="expert-panel")
        yield Static("", id="chat-status")
        yield ChatInput(placeholder="Type a message; enter sends", id="chat-input")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "Chat"
        self.experts = self.query_one(ExpertPanel)

    def on_screen_resume(self) -> None:
        """Shown (first time or again): load the model converted last, unless it is the one loaded."""
        if self.model.loading or self.replying or self.turns.resetting:
            return
        if self.loaded is None:  # not yet, or it failed (the user may have converted something meanwhile)
            self.load()
        elif self.model.newer_model():
            self.notify("A newer conversion finished: loading it (a new conversation).")
            self.load()

    @property
    def chat(self):
        """The screen's ChatSession: its model, conversation and profile learner live on the engine thread."""
        if self._chat is None:
            from tqbench.chat.session import ChatSession

            self._chat = ChatSession()
        return self._chat

    @property
    def loaded(self):
        """tqbench.events.ModelLoaded of the model loaded (None while loading or after a failure)."""
        return self.model.loaded

    @property
    def last_done(self):
        """tqbench.events.ReplyDone of the last reply."""
        return self.turns.last_done

    @property
    def replying(self) -> bool:
        return self.turns.replying

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    # ---- loading the model ----------------------------------------------------------------------------------------

    def load(self) -> None:
        """Choose the model (the last converted, else the demo) and load it in the session, in a worker."""
        self.turns.last_done = None
        self._set_error(None)
        self.transcript.clear()
        self.transcript.hint("")
        self._band(choosing_line())
        self._status(Content(""))
        self.experts.show(None)
        self._layout()
        self.model.start(self.request)
        self.refresh_bindings()

    def on_chat_load_step(self, message: ChatLoadStep) -> None:
        if not self.model.current(message.load_id):
            return
        self._band(Content.styled(message.text, "$text-muted"))
        if message.converting:
            self.query_one(ConversionBar).begin()
        else:
            self.query_one(ConversionBar).display = False

    def on_chat_convert_progress(self, message: ChatConvertProgress) -> None:
        if self.model.current(message.load_id):
            self.query_one(ConversionBar).show_unit(message.unit)

    def on_chat_model_ready(self, message: ChatModelReady) -> None:
        if not self.model.current(message.load_id):
            return
        self.model.ready(message.chosen, message.loaded)
        self.query_one(ConversionBar).display = False
        self.query_one(ModelBand).show_model(message.chosen, message.loaded)
        self.transcript.hint(START_HINT)
        self.experts.show(message.loaded.stream)
        self._layout()
        self._status(ready_line(message.loaded))
        self.refresh_bindings()

    def on_chat_load_failed(self, message: ChatLoadFailed) -> None:
        if not self.model.current(message.load_id):
            return
        self.model.failed()
        self.query_one(ConversionBar).display = False
        self._band(Content.styled("no model loaded", "$text-muted"))
        self._set_error(f"could not load the model: {message.message}")
        self.transcript.hint(FAILED_HINT)
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
        if self.turns.resetting:
            self.notify("Resetting the conversation: send again in a moment.", severity="warning")
            return
        if self.loaded is None:
            self.notify("No model is loaded yet." if self.model.loading
                        else "No model is loaded (see the error above).", severity="warning")
            return
        self.chat_input.value = ""
        self.send(text)

    def send(self, text: str) -> None:
        """Start a turn: the user's text in the transcript, the reply streaming under it."""
        self._set_error(None)  # a failed reply's line
        self.turns.send(self.transcript, text, self.loaded.model_type, self.loaded.stream is not None)
        self._status(WAITING_LINE)
        self.refresh_bindings()

    def on_chat_reply_began(self, message: ChatReplyBegan) -> None:
        if self.turns.current(message.turn_id) and not self.turns.stopping:
            self._status(began_line(message.event.prompt_tokens, message.event.cached_tokens))

    def on_chat_reply_note(self, message: ChatReplyNote) -> None:
        if self.turns.current(message.turn_id) and not self.turns.stopping:
            self._status(Content.styled(message.text, "$text-muted"))

    def on_chat_experts(self, message: ChatExperts) -> None:
        if self.turns.current(message.turn_id):
            self.experts.apply(message.events, message.rates)

    def on_chat_reply_progress(self, message: ChatReplyProgress) -> None:
        if not self.turns.current(message.turn_id) or not self.turns.progressed(message.parts):
            return
        self.transcript.follow()
        if not self.turns.stopping:
            self._status(replying_line(message.tokens))

    def on_chat_reply_ended(self, message: ChatReplyEnded) -> None:
        if not self.turns.current(message.turn_id):
            return
        done = message.done
        if done is None:  # stopped before the model began: the conversation does not hold the turn
            text = self.turns.withdraw(self.transcript)
            if text and not self.chat_input.value:
                self.chat_input.value = text
                self.chat_input.cursor_position = len(text)
            self._status(STOPPED_EARLY_LINE)
        else:
            self.turns.finish(message.parts, done)
            self.transcript.follow()
            self._status(content(report.reply_lines(done)))
        self.experts.finish(message.stream, done.decode_rate if done is not None else None)
        self._ended()

    def on_chat_reply_failed(self, message: ChatReplyFailed) -> None:
        if not self.turns.current(message.turn_id):
            return
        self.turns.fail()
        self._set_error(f"the reply failed: {message.message}")
        self._status(Content(""))
        self.experts.finish(None, None)
        self._ended()

    def _ended(self) -> None:
        self.turns.ended()
        self.refresh_bindings()

    def action_stop(self) -> None:
        if self.turns.stop():
            self._status(STOPPING_LINE)
            self.refresh_bindings()

    def action_reset(self) -> None:
        if self.replying:
            self.notify("A reply is running: esc stops it first.", severity="warning")
            return
        if self.loaded is None or self.turns.resetting:
            return
        self._status(RESETTING_LINE)
        self.turns.reset()

    def on_chat_reset_done(self, message: ChatResetDone) -> None:
        self.turns.reset_done(message.error)
        if message.error is not None:
            self._set_error(f"reset failed: {message.error}")
            return
        self.transcript.clear()
        self.transcript.hint("A new conversation. " + START_HINT)
        self._status(RESET_LINE)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that ended with an exception it did not turn into a message still ends as one line."""
        if event.state is not WorkerState.ERROR:
            return
        text = one_line(event.worker.error)
        if event.worker.group == chat_load.GROUP:
            self.post_message(ChatLoadFailed(load_id=self.model.load_id, message=text))
        elif event.worker.group == chat_turns.GROUP and self.replying:
            self.post_message(ChatReplyFailed(turn_id=self.turns.turn_id, message=text))
        elif event.worker.group == chat_turns.RESET_GROUP:
            self.post_message(ChatResetDone(error=text))

    # ---- keys -----------------------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        typing = isinstance(self.focused, ChatInput)
        if action == "stop":
            return self.replying and not self.turns.stopping
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
            return True if self.loaded is not None or not self.model.loading else None
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
        if self.replying or self.model.loading or self.turns.resetting:
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
        export_profile(self, lambda: self.chat, self.loaded.path)

    def on_chat_profile_exported(self, message: ChatProfileExported) -> None:
        if message.error is not None:
            self.notify(f"profile not exported: {message.error}", severity="error")
            return
        where = message.file  # absolute: the engine's default export file
        self._status(exported_line(where, message.routings))
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

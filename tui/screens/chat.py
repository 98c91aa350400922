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

While the message field has focus, printable keys type: the app's one-letter keys (q, s, p, c) are hidden from the
footer and ctrl+q quits; esc leaves the field (then the transcript scrolls and the app's keys work; i or enter types
again).
"""

from __future__ import annotations

import time
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
from tqbench.engine import Job, Session, engine, submit
from tqbench.errors import TqbenchError
from tui.messages import (ChatConvertProgress, ChatLoadFailed, ChatLoadStep, ChatModelReady, ChatReplyBegan,
                          ChatReplyEnded, ChatReplyFailed, ChatReplyProgress, ChatResetDone)
from tui.state import display_path
from tui.widgets.inputs import OrderedInput
from tui.widgets.model_band import ModelBand
from tui.widgets.transcript import ReplyTurn, Transcript, UserTurn

STREAM_INTERVAL = 0.05  # seconds between updates of a streaming reply
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of the demo's conversion
STATUS_KEY = 8  # width of the status lines' labels
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


class ChatInput(OrderedInput):
    """The message field: enter sends. While it has focus the app's one-letter keys are hidden (they type)."""

    hides_app_keys = True
    BINDINGS = [Binding("enter", "submit", "Send")]

    def __init__(self, **kwargs) -> None:
        super().__init__(compact=True, select_on_focus=False, **kwargs)


class ChatScreen(Screen):
    """The model's header band, the transcript, a status line and the message field."""

    AUTO_FOCUS = "#chat-input"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),  # while a reply runs
        Binding("escape", "leave_input", "Transcript"),  # otherwise, from the message field
        Binding("i", "type", "Type"),  # from the transcript
        Binding("enter", "type", "Type", show=False),
        Binding("ctrl+r", "reset", "Reset"),
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

    def compose(self) -> ComposeResult:
        yield Header()
        yield ModelBand(id="chat-model")
        with Horizontal(id="chat-bar-row"):
            yield ProgressBar(total=None, show_eta=False, id="chat-bar")
            yield Label("", id="chat-bar-text")
        yield Static("", id="chat-error", markup=False)
        yield Transcript(id="transcript")
        yield Static("", id="chat-status")
        yield ChatInput(placeholder="Type a message; enter sends", id="chat-input")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Chat"

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
        self._load(self._load_id)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False, description="load the chat model")
    def _load(self, load_id: int) -> None:
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

            def opener(session: Session):  # on the engine thread
                from tqbench.runtime.session import open_model

                return open_model(session, path, trust_remote_code=False)

            loaded = None
            with self.session.submit(opener) as job:
                for ev in job.items(cancelled):
                    loaded = ev
        except Exception as e:  # TqbenchError (bad input) or a bug: one line either way
            self.post_message(ChatLoadFailed(load_id, one_line(e)))
            return
        if loaded is not None and not worker.is_cancelled:
            self.post_message(ChatModelReady(load_id, chosen, loaded))

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
        self._status(Content.styled(f"ready: {sampling_text(m.sampling)}{template}", "$text-muted"))
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
        self._relay(self._turn_id, self._job)
        self.refresh_bindings()

    @work(thread=True, exclusive=True, group="reply", exit_on_error=False, description="reply")
    def _relay(self, turn_id: int, job: Job) -> None:
        from tqbench.runtime.chat import ReplyDone, ReplyStarted, TokenOut
        from tqbench.runtime.session import last_reply

        worker = get_current_worker()
        runs: list[tuple[list[str], bool]] = []  # the reply so far: runs of (pieces, thinking)
        tokens = 0
        started = False
        done = None
        posted = 0.0

        def parts() -> tuple[tuple[str, bool], ...]:
            return tuple(("".join(pieces), thinking) for pieces, thinking in runs)

        try:
            for ev in job.items(lambda: worker.is_cancelled):
                if isinstance(ev, TokenOut):
                    tokens += 1
                    if ev.text:
                        if runs and runs[-1][1] == ev.thinking:
                            runs[-1][0].append(ev.text)
                        else:
                            runs.append(([ev.text], ev.thinking))
                    if time.monotonic() - posted >= STREAM_INTERVAL:
                        self.post_message(ChatReplyProgress(turn_id, parts(), tokens))
                        posted = time.monotonic()
                elif isinstance(ev, ReplyStarted):
                    started = True
                    self.post_message(ChatReplyBegan(turn_id, ev))
                elif isinstance(ev, ReplyDone):
                    done = ev
            job.stop()
            job.wait()  # the reply is closed on the engine thread: the conversation holds what was generated
            if done is None and started and tokens:
                done = self.session.call(last_reply)  # stopped with esc: the partial reply's figures
        except Exception as e:  # TqbenchError or a bug: one line either way
            job.stop()
            self.post_message(ChatReplyFailed(turn_id, one_line(e)))
            return
        self.post_message(ChatReplyEnded(turn_id, parts(), done))

    def on_chat_reply_began(self, message: ChatReplyBegan) -> None:
        if message.turn_id != self._turn_id or self._stopping:
            return
        ev = message.event
        self._status(Content.assemble(
            f"processing the prompt: {ev.prompt_tokens} tokens, {ev.cached_tokens} reused from the cache",
            ("  esc: stop", "$text-muted")))

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
        self._ended()

    def on_chat_reply_failed(self, message: ChatReplyFailed) -> None:
        if message.turn_id != self._turn_id:
            return
        if self._reply is not None:
            self._reply.end(self._reply.parts, "failed")
        self._set_error(f"the reply failed: {message.message}")
        self._status(Content(""))
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
        return True

    def action_leave_input(self) -> None:
        self.transcript.focus()

    def action_type(self) -> None:
        self.chat_input.focus()

    async def action_quit_app(self) -> None:
        await self.app.action_quit()

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

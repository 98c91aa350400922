"""The Chat screen's turns: one reply at a time, a job of the screen's ChatSession on the engine thread, and a thread
worker relaying its events (tui.screens.chat_relay.relay_reply); stopping it (esc: the engine closes the reply after
the token in progress) and forgetting the conversation (ctrl+r). Messages carry the turn's `turn_id`: those of an
older turn are stale.

A turn keeps its two transcript entries until it ends: what the user sent and the reply streaming under it, which
ends marked with how it stopped. A turn stopped before the model began it leaves the transcript: the conversation
does not hold it. Also the status lines of a turn."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from textual.content import Content
from textual.screen import Screen
from textual.worker import get_current_worker

from tqbench.engine import Job
from tui.messages import ChatResetDone
from tui.screens.chat_relay import one_line, relay_reply
from tui.widgets.transcript import Parts, ReplyTurn, Transcript, UserTurn

if TYPE_CHECKING:
    from tqbench.chat.session import ChatSession  # importing it loads MLX

GROUP = "reply"  # the relay workers' group
RESET_GROUP = "reset"

START_HINT = "Type a message below and press enter. esc stops a reply; ctrl+r starts a new conversation."
WAITING_LINE = Content.styled("waiting for the engine...", "$text-muted")
STOPPING_LINE = Content.styled("stopping...", "bold $text-warning")
STOPPED_EARLY_LINE = Content.styled("stopped before the model began: the message is back in the field",
                                    "bold $text-warning")
RESETTING_LINE = Content.styled("resetting the conversation...", "$text-muted")
RESET_LINE = Content.styled("conversation reset: the cache is empty", "$text-muted")


def began_line(prompt_tokens: int, cached_tokens: int) -> Content:
    return Content.assemble(f"processing the prompt: {prompt_tokens} tokens, {cached_tokens} reused from the cache",
                            ("  esc: stop", "$text-muted"))


def replying_line(tokens: int) -> Content:
    return Content.assemble(f"replying: {tokens} tokens", ("  esc: stop", "$text-muted"))


class ChatTurns:
    """The screen's turns and the conversation's reset."""

    def __init__(self, screen: Screen, session: Callable[[], ChatSession]) -> None:
        self._screen = screen
        self._session = session  # the screen's ChatSession
        self.turn_id = 0
        self.last_done = None  # tqbench.events.ReplyDone of the last reply
        self.stopping = False  # the user stopped the reply going on
        self.resetting = False
        self._job: Job | None = None
        self._user: UserTurn | None = None
        self._reply: ReplyTurn | None = None

    @property
    def replying(self) -> bool:
        return self._job is not None

    def current(self, turn_id: int) -> bool:
        """A message of the turn going on (or of the last one, until another starts)."""
        return turn_id == self.turn_id

    def send(self, transcript: Transcript, text: str, who: str, streaming: bool) -> None:
        """Start a turn: the user's text in the transcript, the reply of `who` (the model type) streaming under it;
        `streaming`: the experts stream from disk (the relay then takes the engine's figures after the reply)."""
        self.turn_id += 1
        self.stopping = False
        self._user = transcript.add_user(text)
        self._reply = transcript.add_reply(who)
        self._job = self._session().reply(text)
        self._screen.run_worker(partial(self._relay, self.turn_id, self._job, streaming), thread=True, exclusive=True,
                                group=GROUP, exit_on_error=False, description="reply")

    def progressed(self, parts: Parts) -> bool:
        """The reply so far; False once the turn ended (nothing to update)."""
        if self._reply is None:
            return False
        self._reply.stream(parts)
        return True

    def finish(self, parts: Parts, done) -> None:
        """The reply ended (`done`: tqbench.events.ReplyDone), marked with how."""
        self.last_done = done
        self._reply.end(parts, done.finish_reason)

    def withdraw(self, transcript: Transcript) -> str:
        """Stopped before the model began: the turn leaves the transcript. Returns what the user sent."""
        text = self._user.text if self._user is not None else ""
        for turn in (self._reply, self._user):
            if turn is not None:
                transcript.remove_turn(turn)
        return text

    def fail(self) -> None:
        """The reply raised: what it had stays, marked as failed."""
        if self._reply is not None:
            self._reply.end(self._reply.parts, "failed")

    def ended(self) -> None:
        """The screen took the turn's last message (ended or failed)."""
        self._job = None
        self.stopping = False
        self._user = self._reply = None

    def stop(self) -> bool:
        """Ask the engine to close the reply after the token in progress; whether this stopped it (not already)."""
        if not self.replying or self.stopping:
            return False
        self.stopping = True
        self._job.stop()
        return True

    def reset(self) -> None:
        """Forget the conversation, in a worker; ChatResetDone follows."""
        self.resetting = True
        self._screen.run_worker(self._reset, thread=True, exclusive=True, group=RESET_GROUP, exit_on_error=False,
                                description="reset the conversation")

    def reset_done(self, error: str | None) -> None:
        self.resetting = False
        if error is None:
            self.last_done = None

    def _relay(self, turn_id: int, job: Job, streaming: bool) -> None:
        worker = get_current_worker()
        relay_reply(self._screen.post_message, self._session(), job, turn_id=turn_id, streaming=streaming,
                    cancelled=lambda: worker.is_cancelled)

    def _reset(self) -> None:
        try:
            self._session().reset()
        except Exception as e:
            self._screen.post_message(ChatResetDone(error=one_line(e)))
            return
        self._screen.post_message(ChatResetDone())

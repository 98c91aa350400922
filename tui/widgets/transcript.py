"""The Chat screen's transcript: user turns and assistant replies, one Static each, in a scrolling column.

A reply is built from runs of (text, thinking): thinking text (inside <think>...</think>) is dim and italic. While it
streams, the reply ends with a cursor; when it ends, with what stopped it (Esc, the token limit) if not the model.
"""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

Parts = tuple[tuple[str, bool], ...]

CURSOR = "▍"
ENDINGS = {  # ReplyDone.finish_reason -> the mark after the reply ("stop": none)
    "cancelled": ("[stopped]", "bold $text-warning"),
    "length": ("[max tokens]", "$text-muted"),
    "failed": ("[failed]", "bold $text-error"),
}


def reply_content(parts: Parts, ending: str | None = None, streaming: bool = False) -> Content:
    """The reply's text, thinking dim and italic, then the cursor (streaming) or the mark of how it ended."""
    pieces: list[Content] = []
    for text, thinking in parts:
        if text:
            pieces.append(Content.styled(text, "dim italic") if thinking else Content(text))
    body = Content("").join(pieces)
    if streaming:
        return body + Content.styled(CURSOR, "$text-accent")
    mark = ENDINGS.get(ending or "")
    if mark is not None:
        sep = "" if not body.plain or body.plain.endswith(("\n", " ")) else " "
        body = body + Content(sep) + Content.styled(*mark)
    if not body.plain:
        body = Content.styled("(empty reply)", "$text-muted")
    return body


def speaker(who: str) -> Content:
    """The label a turn starts with, so turns read apart without colour too."""
    return Content.styled(f"{who} › ", "$text-muted")


class UserTurn(Static):
    """What the user sent."""

    def __init__(self, text: str) -> None:
        super().__init__(speaker("you") + Content(text), classes="user-turn", markup=False)
        self.text = text
        self.border_title = "you"


class ReplyTurn(Static):
    """The model's reply, updated as it streams."""

    def __init__(self, who: str) -> None:
        super().__init__(speaker(who) + reply_content((), streaming=True), classes="reply-turn", markup=False)
        self.border_title = who
        self.parts: Parts = ()
        self.ending: str | None = None  # ReplyDone.finish_reason once it ended

    def stream(self, parts: Parts) -> None:
        self.parts = parts
        self.update(speaker(self.border_title) + reply_content(parts, streaming=True))

    def end(self, parts: Parts, ending: str) -> None:
        self.parts, self.ending = parts, ending
        self.update(speaker(self.border_title) + reply_content(parts, ending))
        self.remove_class("streaming")

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.parts)


class Transcript(VerticalScroll):
    """The conversation so far. Follows the end while it is scrolled to the end."""

    can_focus = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._hint = Static("", classes="transcript-hint")
        self._turns: list[Static] = []  # in order (removed ones leave at once, before their widgets are gone)

    def on_mount(self) -> None:
        self.mount(self._hint)

    def hint(self, text: str) -> None:
        """A muted line shown while the transcript is empty (what to do first)."""
        self._hint.update(Content.styled(text, "$text-muted"))
        self._hint.display = bool(text) and not self._turns

    def add_user(self, text: str) -> UserTurn:
        turn = UserTurn(text)
        self._append(turn)
        return turn

    def add_reply(self, who: str) -> ReplyTurn:
        turn = ReplyTurn(who)
        turn.add_class("streaming")
        self._append(turn)
        return turn

    def _append(self, widget: Static) -> None:
        follow = self.is_vertical_scroll_end or self.max_scroll_y == 0
        self._hint.display = False
        self._turns.append(widget)
        self.mount(widget)
        if follow:
            self.call_after_refresh(self.scroll_end, animate=False)

    def follow(self) -> None:
        """Keep the end in view after a reply grew (unless the user scrolled up to read)."""
        if self.is_vertical_scroll_end or self.max_scroll_y == 0 or self.scroll_target_y >= self.max_scroll_y - 3:
            self.call_after_refresh(self.scroll_end, animate=False)

    def remove_turn(self, turn: Static) -> None:
        if turn in self._turns:
            self._turns.remove(turn)
        turn.remove()

    def clear(self) -> None:
        for turn in self._turns:
            turn.remove()
        self._turns = []

    @property
    def turns(self) -> list[Static]:
        return list(self._turns)

    @property
    def text(self) -> str:
        """Every turn as plain text, `you: ...` / `<who>: ...`, for tests and copying."""
        out = []
        for turn in self.turns:
            if isinstance(turn, ReplyTurn):
                body = reply_content(turn.parts, turn.ending, streaming=turn.ending is None).plain
            else:
                body = turn.text
            out.append(f"{turn.border_title}: {body}")
        return "\n".join(out)

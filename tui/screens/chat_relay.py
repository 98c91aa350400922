"""What the Chat screen's thread workers do: iterate an engine job of the screen's ChatSession and post its events
as messages, throttled so a fast model never floods the UI. Plain functions of (post, job, ids, cancelled), run
off the UI thread; they never touch a widget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from textual.message import Message

from tqbench import units
from tqbench.chat import report
from tqbench.chat.events import (ConvertStarted, KernelsCompiling, MlxWarmedUp, MlxWarmup, ModelChosen, ModelLoaded,
                                 PageIn, PrefillProgress, ReplyDone, ReplyStarted, TokenOut, UnitConverted)
from tqbench.chat.live import ReplyClock
from tqbench.errors import TqbenchError
from tui.messages import (ChatConvertProgress, ChatExperts, ChatLoadFailed, ChatLoadStep, ChatModelReady,
                          ChatReplyBegan, ChatReplyEnded, ChatReplyFailed, ChatReplyNote, ChatReplyProgress)
from tui.state import display_path

STREAM_INTERVAL = 0.05  # seconds between updates of a streaming reply
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of the demo's conversion

Post = Callable[[Message], object]


def one_line(error: BaseException) -> str:
    """A TqbenchError's own line; anything else as `Type: message` (never a traceback)."""
    text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split()) or type(error).__name__


def relay_load(post: Post, chat, request, load_id: int, cancelled: Callable[[], bool]) -> None:
    """Open `request` in `chat` (tqbench.chat.session.ChatSession): the demo's conversion progress if it is converted
    first, each step, the building of the GPU's kernels (CUDA), then ChatModelReady or ChatLoadFailed (one line)."""
    chosen = loaded = latest = None
    posted = 0.0
    try:
        with chat.open(request) as job:
            for ev in job.items(cancelled):
                match ev:
                    case UnitConverted():
                        latest = ev
                        if time.monotonic() - posted >= PROGRESS_INTERVAL:
                            post(ChatConvertProgress(load_id=load_id, unit=ev))
                            posted, latest = time.monotonic(), None
                    case ConvertStarted():
                        post(ChatLoadStep(load_id=load_id,
                                          text=(f"no model converted yet: converting the demo with {ev.recipe} "
                                                f"({ev.units:,} units, {units.gb(ev.bytes_in)})..."),
                                          converting=True))
                    case ModelChosen():
                        if latest is not None:
                            post(ChatConvertProgress(load_id=load_id, unit=latest))
                        chosen = ev
                        post(ChatLoadStep(load_id=load_id, text=f"loading {display_path(Path(ev.path))}..."))
                    case KernelsCompiling():
                        if time.monotonic() - posted >= PROGRESS_INTERVAL or ev.done == ev.total:
                            post(ChatLoadStep(load_id=load_id, text=report.kernels_line(ev)))
                            posted = time.monotonic()
                    case ModelLoaded():
                        loaded = ev
                    case _:  # StreamPlan (shown once loaded) and the conversion's other events (its bar shows them)
                        pass
    except Exception as e:  # TqbenchError (bad input) or a bug: one line either way
        post(ChatLoadFailed(load_id=load_id, message=one_line(e)))
        return
    if chosen is not None and loaded is not None and not cancelled():
        post(ChatModelReady(load_id=load_id, chosen=chosen, loaded=loaded))


def relay_reply(post: Post, chat, job, turn_id: int, streaming: bool, cancelled: Callable[[], bool]) -> None:
    """A reply's events as messages: ChatReplyBegan, the text so far and the page-ins in batches (at most every
    STREAM_INTERVAL), then ChatReplyEnded with the engine's summary and streaming figures, or ChatReplyFailed. Before
    the process's first token on CUDA, ChatReplyNote says MLX is compiling its kernels."""

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
            post(ChatExperts(turn_id=turn_id, events=tuple(batch), rates=clock.rates()))
            batch = []

    def parts() -> tuple[tuple[str, bool], ...]:
        return tuple(("".join(pieces), thinking) for pieces, thinking in runs)

    try:
        for ev in job.items(cancelled):
            match ev:
                case PageIn():
                    clock.page_in(ev)
                    batch.append(ev)
                case TokenOut():
                    tokens += 1
                    clock.token()
                    if ev.text:
                        if runs and runs[-1][1] == ev.thinking:
                            runs[-1][0].append(ev.text)
                        else:
                            runs.append(([ev.text], ev.thinking))
                    if time.monotonic() - posted >= STREAM_INTERVAL:
                        flush()
                        post(ChatReplyProgress(turn_id=turn_id, parts=parts(), tokens=tokens))
                        posted = time.monotonic()
                case ReplyStarted():
                    started = True
                    post(ChatReplyBegan(turn_id=turn_id, event=ev))
                case MlxWarmup():
                    post(ChatReplyNote(turn_id=turn_id, text=report.mlx_warmup_line(ev)))
                case PrefillProgress():
                    post(ChatReplyNote(turn_id=turn_id, text=report.prefill_line(ev)))
                case ReplyDone():
                    done = ev
                case MlxWarmedUp():  # the first token, which follows, says it
                    pass
        job.stop()
        job.wait()  # the reply is closed on the engine thread: the conversation holds what was generated
        flush()
        if done is None and started and tokens:
            done = chat.last_reply()  # stopped with esc: the partial reply's figures
        stats = chat.stats() if streaming else None
    except Exception as e:  # TqbenchError or a bug: one line either way
        job.stop()
        flush()
        post(ChatReplyFailed(turn_id=turn_id, message=one_line(e)))
        return
    post(ChatReplyEnded(turn_id=turn_id, parts=parts(), done=done, stream=stats))

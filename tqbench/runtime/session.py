"""Chat as engine jobs, the same for both faces: a `tqbench.engine.Session` holds the loaded model and its
Conversation on the engine thread; the faces submit `open_model`, `reply` and `reset` and read plain events.

    session = Session()
    with session.submit(lambda s: open_model(s, path)) as job: loaded = job.result()[-1]
    with session.submit(lambda s: reply(s, "hello", loaded.sampling)) as job:
        for ev in job: ...            # ReplyStarted, TokenOut..., ReplyDone
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from tqbench.engine import Session
from tqbench.runtime.chat import Conversation, ReplyDone, ReplyStarted, Sampling, TokenOut

KEY = "conversation"


@dataclass(frozen=True)
class ModelLoaded:
    path: str
    model_type: str
    turboquant_modules: int
    weight_bytes: int  # the parameters as held in memory
    chat_template: bool  # False: a base model, turns are plain text
    sampling: Sampling  # defaults from generation_config.json and the user's options
    seconds: float


def open_model(session: Session, path: str, trust_remote_code: bool = False, system: str | None = None,
               chat_template: bool = True, **sampling: Any) -> Iterator[ModelLoaded]:
    """Load `path` (replacing any model the session holds) and start a conversation."""
    import time

    from tqbench.runtime.load import load

    t0 = time.perf_counter()
    session.state.pop(KEY, None)
    loaded = load(path, trust_remote_code)
    conv = Conversation(loaded, system=system, chat_template=chat_template)
    session.state[KEY] = conv
    yield ModelLoaded(str(loaded.path), loaded.model_type, loaded.turboquant_modules, loaded.weight_bytes,
                      conv.chat_template, Sampling.defaults(loaded.generation_config, **sampling),
                      time.perf_counter() - t0)


def reply(session: Session, text: str, sampling: Sampling) -> Iterator[ReplyStarted | TokenOut | ReplyDone]:
    yield from conversation(session).reply(text, sampling)


def last_reply(session: Session) -> ReplyDone | None:
    """The summary of the last reply, also of one stopped early (finish_reason "cancelled"). Use with session.call."""
    return conversation(session).last


def reset(session: Session) -> None:
    """Forget the conversation (messages and cache). Use with session.call."""
    conversation(session).reset()


def conversation(session: Session) -> Conversation:
    conv = session.state.get(KEY)
    if conv is None:
        raise RuntimeError("no model is loaded in this session")
    return conv

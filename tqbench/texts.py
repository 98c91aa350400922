"""The texts `tqbench eval` scores and a calibrated conversion (recipe part `cal`) runs the source model over: the
demo's held-out code and chat (shipped with tqbench, `eval/heldout.jsonl`; see docs/eval.md), or files the user names.
A text becomes one token stream (documents joined by the end-of-text token) cut into non-overlapping windows, each
scored from an empty context."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tqbench.errors import TqbenchError

HELDOUT = Path(__file__).parent / "eval" / "heldout.jsonl"


@dataclass(frozen=True, kw_only=True)
class Text:
    name: str  # "code", "chat" or the file's name
    documents: tuple[str, ...]


def default_texts() -> tuple[Text, ...]:
    """The demo's held-out code and conversations (no demo model trained on them)."""
    kinds: dict[str, list[str]] = {}
    for line in HELDOUT.read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        kinds.setdefault(d["kind"], []).append(d["text"])
    return tuple(Text(name=k, documents=tuple(v)) for k, v in kinds.items())


def file_text(path: str | Path) -> Text:
    """A file of UTF-8 text, one document."""
    p = Path(path).expanduser()
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise TqbenchError("no such file", p) from None
    except IsADirectoryError:
        raise TqbenchError("a directory, not a text file", p) from None
    except OSError as e:
        raise TqbenchError(f"cannot read it ({e.strerror})", p) from None
    except UnicodeDecodeError as e:
        raise TqbenchError(f"not UTF-8 text (byte {e.start})", p) from None
    if not text.strip():
        raise TqbenchError("empty: nothing to score", p)
    return Text(name=p.name, documents=(text,))


def token_stream(text: Text, tokenizer) -> np.ndarray:
    """The text's documents tokenized (special tokens written in a text count as special) and joined by the
    tokenizer's end-of-text token, int32."""
    eos = _end_token(tokenizer)
    ids: list[int] = []
    for i, doc in enumerate(text.documents):
        if i and eos is not None:
            ids.append(eos)
        ids.extend(tokenizer.encode(doc, add_special_tokens=False))
    return np.asarray(ids, dtype=np.int32)


def _end_token(tokenizer) -> int | None:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return min(ids)
    return getattr(tokenizer, "eos_token_id", None)


@dataclass(frozen=True, kw_only=True)
class Windows:
    """A text's scored windows: inputs `x` and targets `y` (windows x window, int32)."""

    name: str
    x: np.ndarray
    y: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.y.size)


def cut(name: str, stream: np.ndarray, window: int, count: int) -> Windows:
    """`count` windows of `window` tokens spread evenly over the stream's non-overlapping ones (fewer when the
    stream is short; one shorter window when it holds less than one)."""
    available = (len(stream) - 1) // window
    if available < 1:
        if len(stream) < 2:
            raise TqbenchError(f"text {name!r} has {len(stream)} token(s): nothing to predict")
        return Windows(name=name, x=stream[None, :-1].copy(), y=stream[None, 1:].copy())
    picks = sorted({int(round(i)) for i in np.linspace(0, available - 1, min(count, available))})
    x = np.stack([stream[i * window: (i + 1) * window] for i in picks])
    y = np.stack([stream[i * window + 1: (i + 1) * window + 1] for i in picks])
    return Windows(name=name, x=x, y=y)


def plan_windows(streams: dict[str, np.ndarray], window: int, tokens: int) -> list[Windows]:
    """About `tokens` predicted tokens split evenly over the texts (at least one window each)."""
    per_text = max(1, round(tokens / window / max(len(streams), 1)))
    return [cut(name, s, window, per_text) for name, s in streams.items()]


def digest(windows: list[Windows]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(w.name.encode() + b"\0" + w.x.tobytes() + w.y.tobytes())
    return h.hexdigest()

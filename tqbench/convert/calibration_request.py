"""What a calibrated conversion runs the source model over: which texts and about how many tokens. Light (no MLX):
faces build it from their fields, and its digest goes into the plan fingerprint before anything runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tqbench.errors import TqbenchError
from tqbench.texts import Text, default_texts, file_text

DEFAULT_TOKENS = 8192
MIN_TOKENS, MAX_TOKENS = 256, 2**24
WINDOW = 256  # tokens per calibration window


@dataclass(frozen=True, kw_only=True)
class CalibrationRequest:
    """What a calibrated conversion runs the source over: `texts` (files; empty: the demo's held-out texts) and
    about `tokens` tokens of them."""

    texts: tuple[str, ...] = ()
    tokens: int = DEFAULT_TOKENS
    sequential: bool = True  # each module's inputs from the copy with the modules before it calibrated (measure)

    def read(self) -> tuple[Text, ...]:
        """The texts, read (a bad file raises TqbenchError naming it, before anything is converted)."""
        return tuple(file_text(t) for t in self.texts) or default_texts()

    def digest(self) -> str:
        """sha256 of the texts and the token count: what the statistics depend on besides the source."""
        h = hashlib.sha256(f"{self.tokens}|{WINDOW}|{'staged' if self.sequential else 'source'}\n".encode())
        for t in self.read():
            h.update(t.name.encode() + b"\0")
            for d in t.documents:
                h.update(hashlib.sha256(d.encode()).digest())
        return h.hexdigest()


def read_calibration(*, texts: str, tokens: str) -> CalibrationRequest:
    """A face's two fields: text files separated by commas (blank: the demo's held-out texts) and the token count
    (blank: DEFAULT_TOKENS). One-line TqbenchError for a bad count or a file that cannot be read as text."""
    count = tokens.strip().replace(",", "").replace("_", "")
    try:
        n = int(count) if count else DEFAULT_TOKENS
    except ValueError:
        raise TqbenchError(f"calibration tokens: {tokens.strip()!r} is not a whole number") from None
    if not MIN_TOKENS <= n <= MAX_TOKENS:
        raise TqbenchError(f"calibration tokens: {n:,} is outside {MIN_TOKENS}..{MAX_TOKENS:,}")
    request = CalibrationRequest(texts=tuple(p.strip() for p in texts.split(",") if p.strip()), tokens=n)
    request.read()
    return request

"""The live expert view's model, plain Python run on a face's thread (never MLX): for every MoE layer and routed
expert, how it was served on its last routing and when, folded into bins for a narrow map; per layer, misses over
recent tokens and stall time; and a reply's rates as its events arrive (ReplyClock).

Fed with tqbench.stream.PageIn events in batches (the TUI's reply worker posts them at most every ~50 ms).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

# PageIn.served values, best first (a bin shows its worst)
KINDS = ("pinned", "cache", "prefetched", "host", "miss")
RANK = {k: i for i, k in enumerate(KINDS)}
GLYPHS = {"pinned": "P", "cache": "=", "prefetched": "+", "host": "h", "miss": "#", None: " "}  # None: never routed
LABELS = {"pinned": "pinned", "cache": "cache hit", "prefetched": "prefetched", "host": "copied from host RAM",
          "miss": "read from disk"}
FADE = 24  # tokens after which a routing is fully faded
SPARK = 8  # tokens of miss history kept per layer


def fold(experts: int, columns: int) -> int:
    """Experts per cell so that `experts` fit in `columns` cells (1 when they fit as they are)."""
    return max(1, -(-experts // max(1, columns)))


def bins(experts: int, per: int) -> list[range]:
    """The bins of `per` experts (the last may be shorter): every expert in exactly one."""
    return [range(a, min(a + per, experts)) for a in range(0, experts, per)]


@dataclass(kw_only=True)
class LayerState:
    experts: int
    # per expert: token * len(KINDS) + RANK of how it was served on its last routing, -1 never routed; so the largest
    # in a bin
    # is its most recent routing, the worst served among those of that token
    last: list[int] = field(default_factory=list)
    misses: deque = field(default_factory=lambda: deque(maxlen=SPARK))  # misses per recent token
    stall_s: float = 0.0

    def __post_init__(self) -> None:
        self.last = [-1] * self.experts


class PageInMap:
    """Layers x experts, from PageIn events. `layers`: each MoE layer's number of routed experts (from the model)."""

    def __init__(self, layers: dict[int, int]):
        self.layers = {n: LayerState(experts=e) for n, e in sorted(layers.items())}
        self.token = 0  # the newest PageIn.token seen
        self.seen = {k: 0 for k in KINDS}  # routings by how they were served, since the map was made
        self.bytes_read = 0
        self.stall_s = 0.0
        self.cache_bytes = 0  # after the newest event
        self.version = 0  # counts batches applied (the view caches its lines per version)

    @property
    def widest(self) -> int:
        return max((s.experts for s in self.layers.values()), default=0)

    def apply(self, events: Iterable) -> None:
        """Take a batch of PageIn events, in the order the engine produced them."""
        for ev in events:
            st = self.layers.get(ev.layer)
            if st is None:  # a layer the map was not told about: never expected, never fatal
                continue
            self.token = max(self.token, ev.token)
            misses = 0
            for e, how in zip(ev.experts, ev.served):
                if 0 <= e < st.experts:
                    st.last[e] = ev.token * len(KINDS) + RANK[how]
                self.seen[how] += 1
                misses += how == "miss"
            st.misses.append(misses)
            st.stall_s += ev.stall_s
            self.stall_s += ev.stall_s
            self.bytes_read += ev.bytes_read
            self.cache_bytes = ev.cache_bytes
        self.version += 1

    def cell(self, layer: int, expert: int) -> tuple[str | None, int]:
        """(how the expert was served on its last routing, tokens since): (None, -1) if never routed."""
        return self._state(self.layers[layer].last[expert])

    def bin(self, layer: int, experts: range) -> tuple[str | None, int]:
        """A bin's state: its most recent routing; among those of the same token, the worst served."""
        return self._state(max(self.layers[layer].last[experts.start:experts.stop], default=-1))

    def _state(self, last: int) -> tuple[str | None, int]:
        return (None, -1) if last < 0 else (KINDS[last % len(KINDS)], self.token - last // len(KINDS))

    def hits(self) -> int:
        return sum(n for k, n in self.seen.items() if k != "miss")

    def hit_rate(self) -> float:
        """As tqbench.stream.StreamStats.hit_rate: hits over routings."""
        n = self.hits() + self.seen["miss"]
        return self.hits() / n if n else 0.0


def heat(age: int) -> float:
    """1.0 for an expert routed this token, fading linearly to 0.0 after FADE tokens."""
    return 0.0 if age < 0 else max(0.0, 1.0 - age / FADE)


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Iterable[int], top: int, width: int = SPARK) -> str:
    """Recent values as block characters scaled to `top`, right-aligned in `width` cells (blank: no token yet)."""
    vals = list(values)[-width:]
    top = max(1, top)
    line = "".join(SPARKS[0 if v <= 0 else max(1, min(len(SPARKS) - 1, round(v / top * (len(SPARKS) - 1))))]
                   for v in vals)
    return line.rjust(width)


@dataclass(frozen=True, kw_only=True)
class ReplyRates:
    """A streaming reply's rates so far: decode tokens per second, expert bytes read per decode token, and bytes
    read per second since the reply began (prefill included)."""

    tok_s: float
    bytes_per_token: float
    read_bps: float


class ReplyClock:
    """Counts a reply's tokens and page-ins as the reply worker sees them (off the UI thread). Page-ins before the
    first token are the prompt's (prefill); those after it are decode passes, one per token."""

    def __init__(self) -> None:
        import time

        self._now = time.monotonic
        self.t0 = self._now()
        self.first: float | None = None  # when the first token came
        self.tokens = 0
        self.bytes = 0
        self.decode_bytes = 0
        self.decode_passes: set[int] = set()

    def token(self) -> None:
        self.tokens += 1
        if self.first is None:
            self.first = self._now()

    def page_in(self, ev) -> None:
        self.bytes += ev.bytes_read
        if self.first is not None:
            self.decode_bytes += ev.bytes_read
            self.decode_passes.add(ev.token)

    def rates(self) -> ReplyRates:
        now = self._now()
        tok_s = (self.tokens - 1) / (now - self.first) if self.tokens > 1 and now > self.first else 0.0
        per = self.decode_bytes / len(self.decode_passes) if self.decode_passes else 0.0
        return ReplyRates(tok_s=tok_s, bytes_per_token=per,
                          read_bps=self.bytes / (now - self.t0) if now > self.t0 else 0.0)

"""A prompt's processing before its first token, as mlx-lm's generate_step does it (chunks of PREFILL_STEP tokens into
the prompt cache, each evaluated before the next), run here so that each chunk can be told: a PrefillProgress after
it, with the routed experts it read. The generation that follows (mlx-lm's loop) processes the last token."""

from __future__ import annotations

import time
from typing import Any, Iterator

import mlx.core as mx

from tqbench.events import PrefillProgress
from tqbench.runtime.load import Loaded

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size, which chat and serve keep


def prefill(loaded: Loaded, tokens: list[int], cache: list[Any], total: int | None = None,
            step: int = PREFILL_STEP) -> Iterator[PrefillProgress]:
    """`tokens` into `cache`, `step` at a time, on mlx-lm's generation stream; a PrefillProgress after each chunk
    (`total`: the whole prompt's tokens, `tokens` and the last one still to come; default len(tokens))."""
    from mlx_lm.generate import generation_stream

    total = len(tokens) if total is None else total
    stats = loaded.streamer.stats if loaded.streamer is not None else None
    misses, read = (stats.misses, stats.critical_bytes) if stats is not None else (0, 0)
    t0 = time.perf_counter()
    done = 0
    with mx.stream(generation_stream):
        while done < len(tokens):
            n = min(step, len(tokens) - done)
            loaded.model(mx.array(tokens[done:done + n], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
            done += n
            mx.clear_cache()
            yield PrefillProgress(done, total, time.perf_counter() - t0,
                                  stats.misses - misses if stats is not None else 0,
                                  stats.critical_bytes - read if stats is not None else 0)

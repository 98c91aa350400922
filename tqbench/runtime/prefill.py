"""A prompt's processing before its first token, run here so that each step can be told (a PrefillProgress), in one
of two orders:

- chunk by chunk, as mlx-lm's generate_step does it: chunks of PREFILL_STEP tokens through the whole model, each
  evaluated into the prompt cache before the next. A streamed model then reads a routed expert again for every chunk
  that routes to it (each chunk's experts push the last chunk's out of a cache smaller than a layer's experts).
- layer by layer (streamed experts, a prompt of several chunks): every chunk runs up to a MoE layer, then that layer's
  routed experts run once for all the chunks' tokens (the streamer reads each expert it routes to once), then every
  chunk runs on to the next MoE layer. The chunks keep their PREFILL_STEP-token attention and their order through
  each layer's cache, so each token sees what it sees chunk by chunk; only the order in which the work is done
  changes. Each chunk's forward pass is mlx-lm's own model code, run in a greenlet of its own on the engine thread
  (one thread: MLX's rule), switching back here at each streamed MoE layer. Two things a chunk would otherwise read
  too early are given to it: the attention masks mlx-lm builds from its caches' offsets at the start of a forward
  pass (each chunk's cache stand-ins report the offset the chunk starts at), and the routed experts' output.

A prompt of more than LAYER_MAJOR_TOKENS tokens runs layer by layer in windows of that many (each window reads its
experts once): the bound on the activations held at once (per token: the hidden state and what its MoE layer takes,
tqbench.recipe.fit.prefill_bound, which `tqbench plan` states). The generation that follows (mlx-lm's loop)
processes the last token.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import mlx.core as mx

from tqbench.events import PrefillProgress
from tqbench.recipe.fit import LAYER_MAJOR_TOKENS
from tqbench.runtime.load import Loaded

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size, which chat and serve keep


def prefill(loaded: Loaded, tokens: list[int], cache: list[Any], total: int | None = None,
            step: int = PREFILL_STEP, window: int = LAYER_MAJOR_TOKENS) -> Iterator[PrefillProgress]:
    """`tokens` into `cache`, as the module's docstring says; a PrefillProgress after each chunk or each MoE layer
    (`total`: the whole prompt's tokens, `tokens` and the last one still to come; default len(tokens))."""
    from mlx_lm.generate import generation_stream

    total = len(tokens) if total is None else total
    clock = _Clock(loaded, total)
    with mx.stream(generation_stream):
        if layer_major(loaded, cache) and len(tokens) > step:
            for start in range(0, len(tokens), window):
                yield from _layer_major(loaded, tokens[start:start + window], cache, step=step, clock=clock,
                                        before=start)
            return
        done = 0
        while done < len(tokens):
            n = min(step, len(tokens) - done)
            loaded.model(mx.array(tokens[done:done + n], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
            done += n
            mx.clear_cache()
            yield clock.progress(done)


def layer_major(loaded: Loaded, cache: list[Any]) -> bool:
    """Whether a prompt runs layer by layer here: streamed experts on one process, and caches whose masks this module
    knows how to place (an integer offset, or none)."""
    if loaded.streamer is None or loaded.pipeline is not None:
        return False
    return all(isinstance(getattr(c, "offset", 0), int) for c in cache)


class _Clock:
    """Progress of one prompt: seconds since it started, and what the streamer read for it."""

    def __init__(self, loaded: Loaded, total: int) -> None:
        self.total = total
        self.t0 = time.perf_counter()
        self.stats = loaded.streamer.stats if loaded.streamer is not None else None
        self.misses, self.read = (self.stats.misses, self.stats.critical_bytes) if self.stats else (0, 0)

    def progress(self, done: int, layers_done: int = 0, layers: int = 0, window: int = 0) -> PrefillProgress:
        s = self.stats
        return PrefillProgress(done=done, total=self.total, seconds=time.perf_counter() - self.t0,
                               experts_read=s.misses - self.misses if s else 0,
                               bytes_read=s.critical_bytes - self.read if s else 0, layers_done=layers_done,
                               layers=layers, window=window)


class _FromOffset:
    """A chunk's stand-in for one of the prompt cache's entries: everything is the real cache's, but the attention
    mask mlx-lm builds at the start of a forward pass is the one of a cache holding `start` tokens (the chunks before
    this one, which a layer-by-layer prefill has not run through the later layers yet when this chunk starts)."""

    def __init__(self, cache: Any, start: int) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_start", start)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        cache = self._cache
        if not isinstance(getattr(cache, "offset", None), int):
            return cache.make_mask(*args, **kwargs)
        offset = cache.offset
        cache.offset = self._start
        try:
            return cache.make_mask(*args, **kwargs)
        finally:
            cache.offset = offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)

    def __getitem__(self, i: Any) -> Any:
        return self._cache[i]

    def __setitem__(self, i: Any, value: Any) -> None:
        self._cache[i] = value

    def __len__(self) -> int:
        return len(self._cache)

    def __bool__(self) -> bool:
        return bool(self._cache)


def _layer_major(loaded: Loaded, tokens: list[int], cache: list[Any], step: int, clock: _Clock,
                 before: int) -> Iterator[PrefillProgress]:
    """One window of `tokens` (the prompt's `before` tokens already in `cache`), layer by layer."""
    from greenlet import getcurrent, greenlet

    streamer = loaded.streamer
    here = getcurrent()
    starts = list(range(0, len(tokens), step))
    offset = _held(cache)

    def chunk(start: int):
        part = mx.array(tokens[start:start + step], dtype=mx.uint32)[None]
        stand_ins = [_FromOffset(c, offset + start) for c in cache]
        return greenlet(lambda: loaded.model(part, cache=stand_ins), parent=here)

    def park(layer: int, inner: Any, x: mx.array, indices: mx.array) -> mx.array:
        mx.eval(x, indices)  # this chunk's work up to here, alone (as chunk by chunk): its temporaries freed now
        return here.switch(("moe", layer, inner, x, indices))

    layers, done = len(streamer.store.layers), 0
    chunks = [chunk(s) for s in starts]
    streamer.park = park
    try:
        calls = [g.switch() for g in chunks]  # in order: each runs up to its first streamed MoE layer
        while not all(g.dead for g in chunks):
            outputs = _run_together(streamer, calls)
            done += 1
            calls = [g.switch(y) for g, y in zip(chunks, outputs)]  # in order, each on to its next MoE layer
            yield clock.progress(before, layers_done=done, layers=layers, window=len(tokens))
    finally:
        streamer.park = None
    mx.eval([c.state for c in cache])
    mx.clear_cache()
    yield clock.progress(before + len(tokens))


def _held(cache: list[Any]) -> int:
    """Tokens the prompt cache holds now (its first cache with an offset; 0 for none)."""
    return next((c.offset for c in cache if isinstance(getattr(c, "offset", None), int)), 0)


def _run_together(streamer, calls: list) -> list[mx.array]:
    """One MoE layer's routed experts for every chunk at once: their inputs joined along the tokens, one streamer
    call (each expert read once), the output split back."""
    kinds = {c[0] for c in calls}
    layers = {c[1] for c in calls}
    if kinds != {"moe"} or len(layers) != 1:  # every chunk runs the same layers: a difference is a bug
        raise RuntimeError(f"a layer-by-layer prefill's chunks came apart ({sorted(layers)})")
    _, layer, inner, _, _ = calls[0]
    xs, ids = [c[3] for c in calls], [c[4] for c in calls]
    axis = xs[0].ndim - 2  # the tokens' axis: x (..., tokens, dims), indices (..., tokens, k)
    y = streamer.run(layer, inner, mx.concatenate(xs, axis=axis), mx.concatenate(ids, axis=axis))
    cuts, at = [], 0
    for x in xs[:-1]:
        at += x.shape[axis]
        cuts.append(at)
    return mx.split(y, cuts, axis=axis)

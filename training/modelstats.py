"""Measurements of a loaded mlx-lm model: perplexity over token windows, and routing traces with their statistics.

`capture_routing(model)` records the experts every MoE block of an mlx-lm model picks: within the block, each MoE
block's expert module (`switch_mlp`, which mlx-lm calls with the chosen expert ids) is replaced by a small module that
records the ids and calls it, so it sees exactly what the model routes, under training, `mx.compile`, prefill and cached
decoding alike, and nothing outside the model is patched.
The statistics are plain numpy over a trace `[moe_layers, tokens, k]` of expert ids: how many experts cover a share of
the routings (the skew that hot-expert caches and profiles live on) and how much consecutive tokens' expert sets overlap
(what a per-layer LRU cache sees). MLX work stays on the calling thread.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np


def moe_blocks(model) -> list:
    """The MoE blocks of an mlx-lm model: the modules with an expert module `switch_mlp`, which mlx-lm's kimi_k3 (like
    its deepseek_v3 and qwen3_moe) calls with the chosen expert ids."""
    import mlx.nn as nn

    return [m for m in model.modules() if isinstance(m.get("switch_mlp"), nn.Module)]


@functools.cache
def _recorder_class():
    import mlx.nn as nn

    class RoutingRecorder(nn.Module):
        """Stands in for an MoE block's `switch_mlp`: records the expert ids, then calls the experts unchanged."""

        def __init__(self, experts, record):
            super().__init__()
            self.experts = experts
            self.record = record  # a callable, not a child: it adds no parameters

        def __call__(self, x, indices, *args, **kwargs):
            self.record(indices)
            return self.experts(x, indices, *args, **kwargs)

    return RoutingRecorder


@contextlib.contextmanager
def capture_routing(model) -> Iterator[list]:
    """Within the block, every MoE block of `model` appends the expert ids it routes to (`[..., k]`, an mx.array) to
    the yielded list, in call order: one entry per MoE layer per forward pass. Inside the block the experts'
    parameters sit one level deeper (`switch_mlp.experts.*`); the model is restored on leaving it."""
    calls: list = []
    recorder = _recorder_class()
    blocks = moe_blocks(model)
    originals = [b.switch_mlp for b in blocks]
    try:
        for b, experts in zip(blocks, originals):
            b.switch_mlp = recorder(experts, calls.append)
        yield calls
    finally:
        for b, experts in zip(blocks, originals):
            b.switch_mlp = experts


def windows(tokens: np.ndarray, window: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A token stream cut into non-overlapping windows: inputs `[n, window]` and next-token targets `[n, window]`;
    every token after the first is a target exactly once (the ragged tail is dropped)."""
    tokens = np.asarray(tokens)
    n = (len(tokens) - 1) // window
    if limit is not None:
        n = min(n, limit)
    x = tokens[: n * window].reshape(n, window)
    y = tokens[1 : n * window + 1].reshape(n, window)
    return x, y


def perplexity(model, tokens: np.ndarray, window: int = 256, batch: int = 16, limit: int | None = None) -> dict:
    """Mean next-token cross-entropy (nats) and perplexity of `model` over `tokens` cut by `windows` (each window
    starts from an empty context)."""
    import mlx.core as mx
    import mlx.nn as nn

    x, y = windows(tokens, window, limit)
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(mx.array(x[i : i + batch].astype(np.int32))).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, mx.array(y[i : i + batch].astype(np.int32)), reduction="sum")
        total += nll.item()
        count += y[i : i + batch].size
    loss = total / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "windows": len(x), "window": window}


def trace_routing(model, tokens: np.ndarray, window: int = 256, batch: int = 16,
                  limit: int | None = None) -> np.ndarray:
    """The experts each MoE layer picks for every token of `tokens` (cut by `windows`), as int16
    `[moe_layers, tokens, k]` in stream order (windows concatenated)."""
    import mlx.core as mx

    x, _ = windows(tokens, window, limit)
    parts = []
    for i in range(0, len(x), batch):
        with capture_routing(model) as calls:
            mx.eval(model(mx.array(x[i : i + batch].astype(np.int32))))
        layers = np.stack([np.array(c) for c in calls])  # [layers, b, window, k]
        parts.append(layers.reshape(layers.shape[0], -1, layers.shape[-1]))
    return np.concatenate(parts, axis=1).astype(np.int16)


def expert_counts(trace: np.ndarray, num_experts: int) -> np.ndarray:
    """Routings per expert per layer, `[layers, num_experts]`."""
    return np.stack([np.bincount(t.reshape(-1), minlength=num_experts) for t in trace])


def experts_covering(counts: np.ndarray, share: float) -> int:
    """The fewest experts (hottest first) that together take at least `share` of the routings in `counts`."""
    c = np.sort(np.asarray(counts))[::-1].astype(np.float64)
    cum = np.cumsum(c) / c.sum()
    return int(np.searchsorted(cum, share - 1e-12) + 1)


def consecutive_jaccard(trace: np.ndarray) -> np.ndarray:
    """Per layer, the mean Jaccard overlap |A & B| / |A | B| of the expert sets of consecutive tokens."""
    out = []
    for t in trace:  # [tokens, k]
        a, b = t[:-1], t[1:]
        inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
        k = t.shape[-1]
        out.append(float(np.mean(inter / (2 * k - inter))))
    return np.array(out)


def random_jaccard(num_experts: int, k: int) -> float:
    """The expected Jaccard overlap of two independent uniformly random k-sets out of `num_experts`."""
    from math import comb

    total = comb(num_experts, k)
    return sum(comb(k, i) * comb(num_experts - k, k - i) / total * i / (2 * k - i) for i in range(k + 1))


def distinct_per_span(trace: np.ndarray, span: int) -> np.ndarray:
    """Per layer, the mean number of distinct experts used within non-overlapping spans of `span` tokens."""
    out = []
    for t in trace:
        n = len(t) // span
        spans = t[: n * span].reshape(n, -1)
        out.append(float(np.mean([len(np.unique(s)) for s in spans])) if n else float("nan"))
    return np.array(out)


def segment_coverage(trace: np.ndarray, ends: Sequence[int], num_experts: int, share: float,
                     min_tokens: int = 1024) -> tuple[np.ndarray, int]:
    """Per layer, the mean over segments (documents ending at the stream positions `ends`, exclusive) of at least
    `min_tokens` tokens of the experts needed to cover `share` of that segment's routings; and the segment count.
    This is the skew one document shows, which a per-domain profile sees (the whole split is balanced by training)."""
    start, per = 0, []
    for end in ends:
        end = min(end, trace.shape[1])
        if end - start >= min_tokens:
            per.append([experts_covering(np.bincount(t[start:end].reshape(-1), minlength=num_experts), share)
                        for t in trace])
        start = end
    return (np.mean(per, axis=0) if per else np.full(len(trace), np.nan)), len(per)


def lru_hit_rate(trace_layer: np.ndarray, capacity: int) -> float:
    """The share of one layer's routings (`[tokens, k]`) found in an LRU cache of `capacity` experts, filled on miss."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in trace_layer.tolist():
        for e in row:
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(trace_layer.size, 1)


def random_trace(layers: int, tokens: int, num_experts: int, k: int, seed: int = 0) -> np.ndarray:
    """A trace of uniformly random, distinct top-k picks: the no-structure baseline for finite samples."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((layers, tokens, num_experts)), axis=-1)[..., :k].astype(np.int16)


def routing_summary(trace: np.ndarray, num_experts: int, layer_ids: Sequence[int] | None = None,
                    shares: Sequence[float] = (0.5, 0.8, 0.9), spans: Sequence[int] = (16, 256),
                    doc_ends: Sequence[int] | None = None, min_doc_tokens: int = 1024,
                    lru_sizes: Sequence[int] = (8, 16, 32)) -> dict:
    """Per-layer routing statistics of a trace, as a JSON-ready dict (with `doc_ends`, also the per-document
    coverage of `segment_coverage`). Random baselines come from `random_trace` of the same length."""
    counts = expert_counts(trace, num_experts)
    docs = {s: segment_coverage(trace, doc_ends, num_experts, s, min_doc_tokens) for s in shares} if doc_ends else {}
    jac = consecutive_jaccard(trace)
    distinct = {s: distinct_per_span(trace, s) for s in spans}
    k = trace.shape[-1]
    layers = []
    for i, c in enumerate(counts):
        share = c / c.sum()
        layers.append({
            "layer": int(layer_ids[i]) if layer_ids is not None else i,
            **{f"experts_for_{round(s * 100)}pct": experts_covering(c, s) for s in shares},
            "hottest_share": float(share.max()),
            "coldest_share": float(share.min()),
            "unused_experts": int((c == 0).sum()),
            "jaccard_consecutive": float(jac[i]),
            **{f"distinct_per_{s}_tokens": float(distinct[s][i]) for s in spans},
            **{f"per_document_experts_for_{round(s * 100)}pct": float(docs[s][0][i]) for s in docs},
            **{f"lru_{c}_hit_rate": lru_hit_rate(trace[i], c) for c in lru_sizes},
        })
    baseline = random_trace(1, trace.shape[1], num_experts, k)
    return {
        "tokens": int(trace.shape[1]),
        "num_experts": num_experts,
        "top_k": k,
        "uniform": {f"experts_for_{round(s * 100)}pct": math.ceil(s * num_experts) for s in shares},
        "jaccard_random": random_jaccard(num_experts, k),
        "distinct_random": {f"per_{s}_tokens": num_experts * (1 - (1 - k / num_experts) ** s) for s in spans},
        "lru_random": {f"lru_{c}_hit_rate": lru_hit_rate(baseline[0], c) for c in lru_sizes},
        **({"documents": docs[shares[0]][1], "min_document_tokens": min_doc_tokens,
            "per_document_random": {
                f"experts_for_{round(s * 100)}pct": float(segment_coverage(
                    baseline, doc_ends, num_experts, s, min_doc_tokens)[0][0])
                for s in shares}} if docs else {}),
        "layers": layers,
    }

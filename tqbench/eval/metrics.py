"""Per-window sums, computed in float32 with MLX and returned as Python numbers (evaluated: nothing lazy leaves).

For targets y and log-probabilities log p_M (the model), log p_S (the reference), over a window's tokens t:
  nll      = sum_t -log p_M(y_t)                          (perplexity = exp(nll / tokens); ref_nll: of p_S)
  kl       = sum_t sum_v p_S(v) (log p_S(v) - log p_M(v))  KL(S || M): what the reference expects the model to lose
  top1     = #t with argmax p_M = argmax p_S
  top5     = sum_t |top5(p_M) & top5(p_S)| / 5
Identical logits give kl = 0 and agreement 1 exactly (the same float32 operations on the same values)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, kw_only=True)
class WindowSums:
    tokens: int
    nll: float
    ref_nll: float | None = None
    kl: float | None = None
    top1: int | None = None
    top5: float | None = None
    kl_windows: tuple[float, ...] = ()  # the KL sum of each window in the batch (for a spread across windows)


def log_probs(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def nll_sum(logp: mx.array, targets: mx.array) -> mx.array:
    return -mx.take_along_axis(logp, targets[..., None], axis=-1).sum()


def top5(logp: mx.array) -> mx.array:
    return mx.argpartition(-logp, kth=4, axis=-1)[..., :5]


def window_sums(logits: mx.array, targets: mx.array, reference: mx.array | None = None) -> WindowSums:
    """The sums over one batch of windows: `logits` (..., T, V) of the model, `reference` the same shape from the
    reference model (None: perplexity only)."""
    lp = log_probs(logits)
    nll = nll_sum(lp, targets)
    if reference is None:
        mx.eval(nll)
        return WindowSums(tokens=int(targets.size), nll=float(nll.item()))
    ls = log_probs(reference)
    ref_nll = nll_sum(ls, targets)
    per_window = (mx.exp(ls) * (ls - lp)).sum(axis=-1).reshape(-1, targets.shape[-1]).sum(axis=-1)
    kl = per_window.sum()
    top1 = (mx.argmax(lp, axis=-1) == mx.argmax(ls, axis=-1)).sum()
    a, b = top5(lp), top5(ls)
    overlap = (a[..., :, None] == b[..., None, :]).sum().astype(mx.float32) / 5
    mx.eval([nll, ref_nll, kl, top1, overlap, per_window])
    return WindowSums(tokens=int(targets.size), nll=float(nll.item()), ref_nll=float(ref_nll.item()),
                      kl=float(kl.item()), top1=int(top1.item()), top5=float(overlap.item()),
                      kl_windows=tuple(float(v) for v in per_window.tolist()))

"""A chunked (parallel-in-time) gated delta rule for training the demo's KDA layers.

mlx-lm's `kimi_k3` runs Kimi Delta Attention in training mode through `gated_delta_ops`: a Python loop over the time
steps, a few small kernels each, forward and backward. On a GPU that loop, not arithmetic, bounds a training step.
This module computes the same recurrence a chunk of `chunk` steps at a time with matrix products (the WY form of the
delta rule with a per-key-dimension decay), so the sequential part is one cheap state update per chunk.

The recurrence (state S: [Dv, Dk] per batch and head; g_t: a decay per key dimension in (0, 1]):

    S_t = S_{t-1} diag(g_t) + beta_t (v_t - S_{t-1} diag(g_t) k_t) k_t^T,    o_t = S_t q_t.

Within a chunk, with c_t the cumulative log decay from the chunk's start (so diag(exp(c_t)) = g_1 ... g_t),

    S_t = S_0 diag(exp(c_t)) + sum_{s<=t} u_s (k_s * exp(c_t - c_s))^T

where the pseudo-values u solve the unit lower-triangular system

    u_t + beta_t sum_{s<t} A[t, s] u_s = beta_t (v_t - S_0 (k_t * exp(c_t))),
    A[t, s] = sum_d k_t[d] exp(c_t[d] - c_s[d]) k_s[d].

(I + diag(beta) A)^-1 = sum_{j<C} N^j with N = -diag(beta) A strictly lower (nilpotent), computed as the product
(I + N)(I + N^2)(I + N^4)... in log2(C) matrix products. Exponents are differences c_t - c_s with s <= t (never
positive), so nothing overflows. `tests/test_demo_delta.py` checks values and gradients against mlx-lm's loop.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import mlx.core as mx


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array | None = None, chunk: int = 16) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a whole sequence, `chunk` steps at a time. Shapes as mlx-lm's `gated_delta_ops`
    with a vector gate: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g [B, T, H, Dk] (decays, not logs); beta [B, T, H];
    state [B, H, Dv, Dk] (zeros when None). Returns (y [B, T, H, Dv], the final state), in float32 like the loop's
    state (y in q's dtype)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    if g.shape != k.shape:
        raise ValueError(f"chunked_gated_delta needs a per-key gate of shape {k.shape}, got {g.shape}")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    C = chunk
    n = -(-T // C)
    pad = n * C - T
    f32 = mx.float32
    q_, k_, v_, g_, b_ = (x.astype(f32) for x in (q, k, v, g, beta))
    if pad:  # padded steps: no decay (g = 1), nothing written (beta = 0), outputs dropped
        zeros = [(0, 0), (0, pad), (0, 0)]
        q_, k_, v_ = (mx.pad(x, zeros + [(0, 0)]) for x in (q_, k_, v_))
        g_ = mx.pad(g_, zeros + [(0, 0)], constant_values=1.0)
        b_ = mx.pad(b_, zeros)

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = x.reshape(B, n, C, H, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    qc, kc, vc, bc = chunks(q_), chunks(k_), chunks(v_), chunks(b_)
    c = mx.cumsum(mx.log(chunks(g_)), axis=3)  # [B, H, n, C, Dk], <= 0, decreasing in t
    t_idx = mx.arange(C)
    incl = (t_idx[:, None] >= t_idx[None, :])  # s <= t
    strict = (t_idx[:, None] > t_idx[None, :])  # s < t
    diff = c[..., :, None, :] - c[..., None, :, :]  # [B, H, n, C(t), C(s), Dk]: c_t - c_s
    decay = mx.exp(mx.where(incl[:, :, None], diff, -mx.inf))
    kd = decay * kc[..., None, :, :]  # exp(c_t - c_s) k_s, indexed [t, s]
    A = mx.where(strict, (kc[..., :, None, :] * kd).sum(-1), 0.0)  # [B, H, n, C, C]
    Bq = (qc[..., :, None, :] * kd).sum(-1)  # q_t . (exp(c_t - c_s) k_s), s <= t (zero above the diagonal)
    N = -bc[..., :, None] * A
    eye = mx.eye(C, dtype=f32)
    M, P = eye + N, N
    for _ in range(int(math.log2(C)) - 1):
        P = P @ P
        M = M @ (eye + P)
    k_start = kc * mx.exp(c)  # k_t * exp(c_t): what S_0 sees at step t
    q_start = qc * mx.exp(c)
    k_end = kc * mx.exp(c[..., -1:, :] - c)  # k_s * exp(c_C - c_s): how u_s enters the end state
    g_end = mx.exp(c[..., -1, :])  # [B, H, n, Dk]

    def per_chunk(x):  # [B, H, n, ...] -> n views [B, H, ...]: one split, whose gradient is one concatenation
        return [part.squeeze(2) for part in mx.split(x, n, axis=2)]  # (indexing x[:, :, i] costs 2-3 kernels each)

    b_i, v_i, ks_i, M_i, qs_i, Bq_i, ge_i, ke_i = map(per_chunk, (bc, vc, k_start, M, q_start, Bq, g_end, k_end))
    S = mx.zeros((B, H, Dv, Dk), f32) if state is None else state.astype(f32)
    ys = []
    for i in range(n):  # the only sequential part: one state update per chunk
        St = mx.swapaxes(S, -1, -2)  # [B, H, Dk, Dv]
        rhs = b_i[i][..., None] * (v_i[i] - ks_i[i] @ St)  # [B, H, C, Dv]
        u = M_i[i] @ rhs
        ys.append(qs_i[i] @ St + Bq_i[i] @ u)
        S = S * ge_i[i][:, :, None, :] + mx.swapaxes(u, -1, -2) @ ke_i[i]
    y = mx.stack(ys, axis=2).reshape(B, H, n * C, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(q.dtype), S


@contextmanager
def chunked_kda_training(chunk: int = 16):
    """While active, mlx-lm's `kimi_k3` runs its KDA layers' training-mode (unmasked, non-kernel) recurrence through
    `chunked_gated_delta`; inference, masked and cached calls are unchanged. Restores the original on exit."""
    from mlx_lm.models import gated_delta as gd
    from mlx_lm.models import kimi_k3

    original = kimi_k3.gated_delta_update

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True, lower_bound=None,
               allow_neg_eigval=False):
        if use_kernel or mask is not None or a.ndim != 4:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        beta = mx.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)
        g = gd.compute_g(A_log, a, dt_bias) if lower_bound is None else \
            gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        return chunked_gated_delta(q, k, v, g, beta, state, chunk)

    kimi_k3.gated_delta_update = update
    try:
        yield
    finally:
        kimi_k3.gated_delta_update = original

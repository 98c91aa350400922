"""Calibrated rounding: TurboQuant codes chosen for the least error of a layer's *output* on real inputs (GPTQ's error
feedback, in the rotated domain), stored in the very format `turboquant.quantize` writes.

A Linear y = W x is stored as codes of W_rot = rotate(W) (each row, along the input axis), per-group float16 scales
and a fixed codebook. Its inputs are rotated the same way at run time, so with calibration inputs X (tokens x in)
the output error is ||X_rot (W_rot - Q)^T||^2 = tr((W_rot - Q) H (W_rot - Q)^T), H = X_rot^T X_rot. Nearest
rounding minimises each weight's error alone; this minimises that trace, column by column (Frantar et al., GPTQ):

- H gets `damp` x its mean diagonal added (1%), then U, the upper Cholesky factor of H^-1 (H^-1 = U^T U).
- Columns are quantized in order, in blocks of BLOCK columns (a multiple of every group size). At the first column
  of a group, the group's scale is chosen by the recipe's rule (`turboquant.group_scales`: searched or RMS) from the
  group's weights as the error feedback has left them (`scales_from="current"`, the default) or from the original
  weights (`"original"`); then each column's codes are the nearest levels at that scale (the same boundaries and
  ties as `quantize`), and its error e = (w_j - q_j) / U[j, j] is taken out of the columns after it:
  W[:, k] -= e U[j, k] for k > j (inside the block at once, beyond it once per block).
- With H a multiple of the identity U is diagonal, nothing is fed back, and the codes and scales are exactly
  `quantize`'s (tests/test_calibrate.py checks it, and the codes against a plain least-squares formulation).
- Then REFITS rounds of two exact steps on the same (damped) objective, neither of which can raise it: each row's
  group scales solved for the codes (`refit_scales`: a groups x groups least-squares system, rounded to float16,
  kept only where better), and POLISH sweeps of coordinate descent on the codes (`polish_codes`: each weight moved
  to the level nearest its best value given all the others). On the demo at tq3-g64 they took KL from 0.270 (GPTQ
  alone) to 0.257; more rounds bought nothing measurable (docs/turboquant.md).

Everything is numpy (float32 weights, float64 for H's factorisation) except the scale rule, which is turboquant's.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from tqbench.quant import turboquant as tq

DAMP = 0.01  # of the mean diagonal of H, added to its diagonal (GPTQ's default)
BLOCK = 128  # columns updated at once; a multiple of every group size (32, 64, 128)
SCALES_FROM = ("current", "original")
REFITS = 1  # rounds of: scales refitted to the codes (refit_scales), then POLISH sweeps of the codes (polish_codes)
POLISH = 1


def rotated_hessian(h: np.ndarray, signs: np.ndarray | None) -> np.ndarray:
    """R^T H R for x_rot = x R (turboquant.rotate with `signs`; None: not rotated), float64 (in, in)."""
    if signs is None:
        return np.asarray(h, dtype=np.float64)
    s = mx.array(np.asarray(signs, dtype=np.float16))
    hr = tq.rotate(mx.array(np.asarray(h, dtype=np.float32)), s)  # H R
    hr = tq.rotate(mx.transpose(hr), s)  # R^T H R (H symmetric)
    out = np.array(hr, dtype=np.float64)
    return (out + out.T) / 2


def damped(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """H + damp * mean(diag H) I, float64: the objective every step minimises, tr(D H D^T) + damp * mean(diag H)
    ||D||^2 for the error D = W - Q (the output error, plus a little of the weights' own). Columns no input ever
    reached (a zero diagonal) get 1 there: they factor, and take no feedback."""
    h = np.array(h, dtype=np.float64)
    n = h.shape[0]
    d = np.diag(h).copy()
    d[d <= 0] = 1.0
    h[np.diag_indices(n)] = d + damp * float(np.mean(d))
    return h


def inverse_factor(h: np.ndarray) -> np.ndarray:
    """U upper triangular with H^-1 = U^T U, float64, for a damped H (positive definite). With P the reversal, the
    Cholesky factor of P H P gives H = V V^T for the upper triangular V = P L P, so U = V^-1: one factorisation and
    one inverse (instead of inverting H and factoring the inverse)."""
    lower = np.linalg.cholesky(np.ascontiguousarray(h[::-1, ::-1]))
    return np.linalg.inv(np.ascontiguousarray(lower[::-1, ::-1]))


def gptq_codes(w_rot: np.ndarray, h_rot: np.ndarray, kind: str, group: int, *, rule: str = "search",
               scales_from: str = "current", damp: float = DAMP,
               given: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Codes (out, in) uint32 and float16 scales (out, in / group) of rotated rows `w_rot` (out, in) for the
    rotated Hessian `h_rot` (in, in); with `given` scales (out, in / group) those are used as they are."""
    if scales_from not in SCALES_FROM:
        raise ValueError(f"scales_from must be one of {', '.join(SCALES_FROM)}, not {scales_from!r}")
    w = np.array(w_rot, dtype=np.float32)
    rows, n = w.shape
    if n % group or BLOCK % group:
        raise ValueError(f"in dimension {n} is not a multiple of the group size {group}")
    u = inverse_factor(damped(h_rot, damp)).astype(np.float32)
    book = tq.codebook(kind).astype(np.float32)
    bounds = tq.boundaries(kind)
    codes = np.zeros((rows, n), dtype=np.uint32)
    scales = np.zeros((rows, n // group), dtype=np.float16)
    fixed = given
    if fixed is None and scales_from == "original":
        fixed = np.array(tq.group_scales(mx.array(w), kind, group, rule))
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        block = w[:, b0:b1].copy()
        err = np.zeros_like(block)
        for j in range(b0, b1):
            i = j - b0
            if j % group == 0:  # the group lies in this block, up to date
                g = j // group
                scales[:, g] = fixed[:, g] if fixed is not None else np.array(
                    tq.group_scales(mx.array(block[:, i:i + group]), kind, group, rule))[:, 0]
                s32 = scales[:, g].astype(np.float32)
            col = block[:, i]
            c = np.searchsorted(bounds, col / s32, side="right")  # boundaries at or below: a tie takes the upper
            codes[:, j] = c
            e = (col - book[c] * s32) / u[j, j]
            block[:, i:] -= np.outer(e, u[j, j:b1])
            err[:, i] = e
        if b1 < n:
            w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes, scales


def refit_scales(w_rot: np.ndarray, h_rot: np.ndarray, codes: np.ndarray, scales: np.ndarray, *, kind: str,
                 group: int) -> np.ndarray:
    """For fixed codes, each row's group scales that minimise its output error (w - q) H (w - q)^T exactly: q is
    linear in the row's scales s, q = C s, so with A = C^T H C and b = C^T H w the error is w H w^T - 2 b.s + s A s,
    least at s = A^-1 b (a groups x groups system per row), rounded to float16. A row keeps `scales` where the
    rounded solution is not better."""
    rows, n = w_rot.shape
    groups = n // group
    levels = tq.codebook(kind).astype(np.float64)[codes].reshape(rows, groups, group)
    h = np.asarray(h_rot, dtype=np.float64)
    w = np.asarray(w_rot, dtype=np.float64)
    a = np.empty((rows, groups, groups))
    b = np.empty((rows, groups))
    for g in range(groups):  # t = L_g H_g,: for every row at once: one matrix product per group
        t = levels[:, g] @ h[g * group:(g + 1) * group]
        a[:, g] = np.einsum("rkj,rkj->rk", t.reshape(rows, groups, group), levels)
        b[:, g] = np.einsum("rj,rj->r", t, w)
    a += 1e-9 * np.trace(a, axis1=1, axis2=2)[:, None, None] / groups * np.eye(groups)
    new = np.maximum(np.linalg.solve(a, b[..., None])[..., 0], tq.MIN_SCALE).astype(np.float16)

    def err(sc: np.ndarray) -> np.ndarray:  # the error less w H w^T, which both share
        s64 = sc.astype(np.float64)
        return np.einsum("rg,rgk,rk->r", s64, a, s64) - 2 * np.einsum("rg,rg->r", b, s64)

    out = scales.copy()
    better = err(new) < err(scales)
    out[better] = new[better]
    return out


def polish_codes(w_rot: np.ndarray, h_rot: np.ndarray, codes: np.ndarray, scales: np.ndarray, *, kind: str,
                 group: int) -> np.ndarray:
    """One sweep of coordinate descent on the codes, scales fixed: column by column, each weight's code becomes the
    level nearest to its best value given every other code, q_j + r_j / H_jj with r = (w - q) H the row's residual
    gradient. Each step minimises the row's output error (w - q) H (w - q)^T along that weight exactly, so the sweep
    never raises it. r is kept current inside a block of BLOCK columns, and beyond it once per block."""
    rows, n = w_rot.shape
    h = np.asarray(h_rot, dtype=np.float64)
    book = tq.codebook(kind).astype(np.float64)
    bounds = tq.boundaries(kind)
    s = np.repeat(scales.astype(np.float64), group, axis=1)  # (rows, n)
    codes = codes.copy()
    q = book[codes] * s
    r = (np.asarray(w_rot, dtype=np.float64) - q) @ h
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        delta = np.zeros((rows, b1 - b0))
        for j in range(b0, b1):
            if h[j, j] <= 0:
                continue
            target = q[:, j] + r[:, j] / h[j, j]
            c = np.searchsorted(bounds, (target / s[:, j]).astype(np.float32), side="right")
            d = book[c] * s[:, j] - q[:, j]
            moved = np.flatnonzero(d)
            if len(moved):
                r[np.ix_(moved, np.arange(j, b1))] -= np.outer(d[moved], h[j, j:b1])
                q[moved, j] += d[moved]
                codes[moved, j] = c[moved]
                delta[moved, j - b0] = d[moved]
        if b1 < n:
            r[:, b1:] -= delta @ h[b0:b1, b1:]
    return codes


def quantize_calibrated(w: mx.array, kind: str, group: int, signs: mx.array | None, hessian: np.ndarray, *,
                        rule: str = "search", scales_from: str = "current", damp: float = DAMP, refits: int = REFITS,
                        polish: int = POLISH) -> tq.Quantized:
    """turboquant.quantize's result for one Linear w (out, in), its codes chosen by gptq_codes for the input
    second moments `hessian` (in, in) of the *unrotated* inputs (X^T X summed over calibration tokens).
    `rel_error` is the weight error ||W - W_hat|| / ||W||, as quantize reports it (here larger: the codes trade
    weight error for output error)."""
    if w.ndim != 2:
        raise ValueError(f"calibrated rounding takes one Linear (out, in), not shape {tuple(w.shape)}")
    n = w.shape[-1]
    x = tq.rotate(w, signs) if signs is not None else w.astype(mx.float32)
    w_rot = np.array(x, dtype=np.float32)
    h_rot = rotated_hessian(hessian, None if signs is None else np.array(signs))
    codes, scales = gptq_codes(w_rot, h_rot, kind, group, rule=rule, scales_from=scales_from, damp=damp)
    h_obj = damped(h_rot, damp)
    for _ in range(refits):
        scales = refit_scales(w_rot, h_obj, codes, scales, kind=kind, group=group)
        for _ in range(polish):
            codes = polish_codes(w_rot, h_obj, codes, scales, kind=kind, group=group)
    book = tq.codebook(kind).astype(np.float32)
    recon = book[codes].reshape(-1, n // group, group) * scales.astype(np.float32)[..., None]
    diff = recon.reshape(w_rot.shape) - w_rot
    rel = math.sqrt(float(np.sum(diff.astype(np.float64) ** 2)) / max(float(np.sum(w_rot.astype(np.float64) ** 2)),
                                                                        1e-30))
    packed = tq.pack(mx.array(codes), len(book))
    scales_mx = mx.array(scales)
    mx.eval(packed, scales_mx)
    return tq.Quantized(weight=packed, scales=scales_mx, rel_error=rel)


def expert_hessian(h: np.ndarray, count: float, pooled: np.ndarray, pooled_count: float, prior: float) -> np.ndarray:
    """One routed expert's H shrunk toward its layer's: H_e + prior * (H_pool / N_pool), where H_pool sums every
    expert's inputs (N_pool rows). An expert routed `count` tokens weighs its own inputs as `count` and the layer's
    mean as `prior` tokens: a rarely routed expert (count << width, H_e of low rank) is calibrated mostly for the
    inputs its layer sees, a busy one for its own. With no pooled rows it is H_e alone."""
    if pooled_count <= 0 or prior <= 0:
        return np.asarray(h, dtype=np.float64)
    return np.asarray(h, dtype=np.float64) + (prior / pooled_count) * np.asarray(pooled, dtype=np.float64)

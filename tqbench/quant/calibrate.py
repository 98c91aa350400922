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


def rotated_hessian(h: np.ndarray, signs: np.ndarray | None) -> np.ndarray:
    """R^T H R for x_rot = x R (turboquant.rotate with `signs`; None: not rotated), float64 (in, in)."""
    if signs is None:
        return np.asarray(h, dtype=np.float64)
    s = mx.array(np.asarray(signs, dtype=np.float16))
    hr = tq.rotate(mx.array(np.asarray(h, dtype=np.float32)), s)  # H R
    hr = tq.rotate(mx.transpose(hr), s)  # R^T H R (H symmetric)
    out = np.array(hr, dtype=np.float64)
    return (out + out.T) / 2


def inverse_factor(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """U upper triangular with (H + damp * mean(diag H) I)^-1 = U^T U, float64. Columns no input ever reached
    (a zero diagonal) get 1 there, so they factor and take no feedback."""
    h = np.array(h, dtype=np.float64)
    n = h.shape[0]
    d = np.diag(h).copy()
    d[d <= 0] = 1.0
    h[np.diag_indices(n)] = d + damp * float(np.mean(d))
    inv = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, H = L L^T
    h_inv = inv.T @ inv
    return np.linalg.cholesky(h_inv).T


def gptq_codes(w_rot: np.ndarray, h_rot: np.ndarray, kind: str, group: int, rule: str = "search",
               scales_from: str = "current", damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """Codes (out, in) uint32 and float16 scales (out, in / group) of rotated rows `w_rot` (out, in) for the
    rotated Hessian `h_rot` (in, in)."""
    if scales_from not in SCALES_FROM:
        raise ValueError(f"scales_from must be one of {', '.join(SCALES_FROM)}, not {scales_from!r}")
    w = np.array(w_rot, dtype=np.float32)
    rows, n = w.shape
    if n % group or BLOCK % group:
        raise ValueError(f"in dimension {n} is not a multiple of the group size {group}")
    u = inverse_factor(h_rot, damp).astype(np.float32)
    book = tq.codebook(kind).astype(np.float32)
    bounds = tq.boundaries(kind)
    codes = np.zeros((rows, n), dtype=np.uint32)
    scales = np.zeros((rows, n // group), dtype=np.float16)
    fixed = None
    if scales_from == "original":
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


def quantize_calibrated(w: mx.array, kind: str, group: int, signs: mx.array | None, hessian: np.ndarray,
                        rule: str = "search", scales_from: str = "current") -> tq.Quantized:
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
    codes, scales = gptq_codes(w_rot, h_rot, kind, group, rule, scales_from)
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

"""TurboQuant matmuls in plain MLX: the reference every fast path is tested against, and the path used wherever no
fused kernel applies (CPU, large prefill chunks, a kernel that failed its self-check).

A TurboQuant Linear stores packed codes `weight` (..., out, words), fp16 group scales `scales` (..., out, in / g), a
fp16 `codebook` (3, 4, 8 or 16 levels) and fp16 rotation `signs` (in,). Its output is `x_rot @ W_rot.T`, where
`W_rot[o, j] = codebook[code[o, j]] * scales[o, j // g]` and `x_rot` is the input rotated with the layer's signs
(TurboQuant keeps weights in the rotated domain and rotates activations online).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from tqbench.quant.turboquant import unpack


def rotate_input(x: mx.array, signs: mx.array, block: int | None) -> mx.array:
    """float32 `H_b(x * s) / sqrt(b)` per block of `block` columns along the last axis; `block` None: x as float32."""
    x = x.astype(mx.float32)
    if block is None:
        return x
    n = x.shape[-1]
    y = x * signs.astype(mx.float32)
    if block == n:
        return mx.hadamard_transform(y, scale=1 / math.sqrt(n))
    return mx.hadamard_transform(y.reshape(*y.shape[:-1], n // block, block),
                                 scale=1 / math.sqrt(block)).reshape(y.shape)


def dequantize_rotated(weight: mx.array, scales: mx.array, codebook: mx.array, n: int) -> mx.array:
    """float32 W_rot (..., out, n) from the stored tensors (still in the rotated domain)."""
    codes = unpack(weight, codebook.shape[0], n)
    group = n // scales.shape[-1]
    vals = codebook.astype(mx.float32)[codes].reshape(*codes.shape[:-1], n // group, group)
    return (vals * scales.astype(mx.float32)[..., None]).reshape(*codes.shape[:-1], n)


def matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array) -> mx.array:
    """x_rot (..., n) float32 -> (..., out) float32."""
    return _matmul(x_rot, weight, scales, codebook)


def _matmul_graph(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array) -> mx.array:
    return x_rot @ dequantize_rotated(weight, scales, codebook, x_rot.shape[-1]).T


# Compiled: decoding, lookup and scaling fuse into one pass (a decode step calls this for every quantized Linear,
# so op count matters). mx.compile retraces per input shape.
_matmul = mx.compile(_matmul_graph)


# MLX's CUDA gather_mm (the sorted one-row path that mlx-lm's SwitchGLU takes from 64 routings on) is a grouped GEMM
# that takes at most 1,024 matrices in b and computes each matrix's byte offset in 32-bit integers, so past 2 GiB of
# an operand it reads out of bounds ("an illegal memory access"). The reference gather never hands gather_mm more than
# GATHER_MAX_GROUPS matrices or GATHER_MAX_BYTES of x, of the decoded weights or of the output, on every backend: the
# same bound keeps the float32 weights a prefill decodes small (one K3 projection's 896 experts at once are 39 GB; a
# piece's decoding needs about three times its bytes while it runs).
GATHER_MAX_GROUPS = 1024
GATHER_MAX_BYTES = 1 << 29


def gather_matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool = False) -> mx.array:
    """The routed-expert product, as mlx-lm's SwitchLinear computes it with `mx.gather_mm`: x_rot (..., m, n) and
    expert indices (...) -> (..., m, out), float32. Small products run as one compiled graph; larger ones in pieces
    (`_gather_in_pieces`), each within gather_mm's limits."""
    n, m = x_rot.shape[-1], x_rot.shape[-2]
    out, experts = weight.shape[-2], weight.shape[0]
    expert_bytes = 4 * out * n  # one expert's decoded float32 weights
    pairs = math.prod(mx.broadcast_shapes(tuple(x_rot.shape[:-2]), tuple(indices.shape)))
    if 4 * pairs * m * max(n, out) <= GATHER_MAX_BYTES:
        copies_fit = indices.size <= GATHER_MAX_GROUPS and indices.size * expert_bytes <= GATHER_MAX_BYTES
        all_fit = experts <= GATHER_MAX_GROUPS and experts * expert_bytes <= GATHER_MAX_BYTES
        if copies_fit and (indices.size < experts or not all_fit):
            return _GATHER[(sorted_indices, False)](x_rot, weight, scales, codebook, indices)
        if all_fit:
            return _GATHER[(sorted_indices, True)](x_rot, weight, scales, codebook, indices)
    return _gather_in_pieces(x_rot, weight, scales, codebook, indices)


def _gather_graph(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool, every_expert: bool) -> mx.array:
    """One gather_mm over the experts decoded in float32: every expert once (`every_expert`, a prefill's choice), or
    one copy per index, in the indices' order (a few routings: only the experts they name)."""
    n = x_rot.shape[-1]
    if every_expert:
        w = dequantize_rotated(weight, scales, codebook, n)
        return mx.gather_mm(x_rot, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    flat = indices.reshape(-1)
    w = dequantize_rotated(weight[flat], scales[flat], codebook, n)
    local = mx.arange(flat.size, dtype=mx.uint32).reshape(indices.shape)
    return mx.gather_mm(x_rot, w.swapaxes(-1, -2), rhs_indices=local, sorted_indices=sorted_indices)


# Compiled per (sorted_indices, every_expert): decoding, lookup and scaling fuse.
_GATHER = {(s, e): mx.compile(lambda x, w, sc, b, i, s=s, e=e: _gather_graph(x, w, sc, codebook=b, indices=i,
                                                                             sorted_indices=s, every_expert=e))
           for s in (False, True) for e in (False, True)}


def _gather_in_pieces(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array,
                      indices: mx.array) -> mx.array:
    """gather_matmul for products past one gather_mm's limits. The indices are read on the host (they are evaluated
    here), the (x block, expert) pairs sorted by expert, and each run of pairs whose distinct experts and rows fit the
    limits is one gather_mm over just those experts, decoded once each; the results go back to the pairs' order."""
    n, m = x_rot.shape[-1], x_rot.shape[-2]
    out = weight.shape[-2]
    xbatch = tuple(x_rot.shape[:-2])
    bshape = tuple(mx.broadcast_shapes(xbatch, tuple(indices.shape)))
    mx.eval(indices)
    idx = np.broadcast_to(np.array(indices, dtype=np.int64), bshape).reshape(-1)
    xblock = np.broadcast_to(np.arange(math.prod(xbatch)).reshape(xbatch), bshape).reshape(-1)
    order = np.argsort(idx, kind="stable")
    ranked = idx[order]
    x2 = x_rot.reshape(-1, m, n)
    parts = []
    for lo, hi in gather_pieces(ranked, 4 * out * n, 4 * m * max(n, out)):
        experts = np.unique(ranked[lo:hi])
        local = mx.array(np.searchsorted(experts, ranked[lo:hi]).astype(np.uint32))
        rows = mx.array(xblock[order[lo:hi]].astype(np.uint32))
        pick = mx.array(experts.astype(np.uint32))
        # not compiled: every piece has shapes of its own (mx.compile would trace each anew)
        part = _gather_graph(x2[rows], weight[pick], scales[pick], codebook=codebook, indices=local,
                             sorted_indices=True, every_expert=True)
        mx.eval(part)  # one piece's decoded weights at a time
        parts.append(part)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if not np.array_equal(order, np.arange(order.size)):
        y = y[mx.array(np.argsort(order).astype(np.uint32))]
    return y.reshape(*bshape, m, out)


def gather_pieces(ranked: np.ndarray, expert_bytes: int, row_bytes: int) -> list[tuple[int, int]]:
    """Runs [lo, hi) of expert-sorted pairs `ranked`, each naming at most GATHER_MAX_GROUPS distinct experts (decoded,
    `expert_bytes` each) and rows (`row_bytes` each, of x or of the output) within GATHER_MAX_BYTES; an expert with
    more rows than that is split over several runs."""
    per_piece = max(1, min(GATHER_MAX_GROUPS, GATHER_MAX_BYTES // expert_bytes))
    rows_max = max(1, GATHER_MAX_BYTES // row_bytes)
    starts = np.flatnonzero(np.diff(ranked)) + 1
    segments = zip(np.concatenate([[0], starts]).tolist(), np.concatenate([starts, [ranked.size]]).tolist())
    pieces: list[tuple[int, int]] = []
    lo = hi = experts = 0
    for a, b in segments:
        if experts and (experts == per_piece or b - lo > rows_max):
            pieces.append((lo, hi))
            lo, experts = a, 0
        while b - lo > rows_max:  # one expert's rows alone exceed a piece
            pieces.append((lo, lo + rows_max))
            lo = lo + rows_max
        hi, experts = b, experts + 1
    if hi > lo:
        pieces.append((lo, hi))
    return pieces

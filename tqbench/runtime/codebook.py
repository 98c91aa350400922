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


def gather_matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool = False) -> mx.array:
    return (_gather_sorted if sorted_indices else _gather)(x_rot, weight, scales, codebook, indices)


def _gather_graph(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool = False) -> mx.array:
    """The routed-expert product, as mlx-lm's SwitchLinear computes it with `mx.gather_mm`: x_rot (..., m, n) and
    expert indices (...) -> (..., m, out). Only the experts the indices name are dequantized, unless they name more
    expert copies than the module holds (prefill), then every expert once."""
    n = x_rot.shape[-1]
    experts = weight.shape[0]
    if indices.size < experts:
        flat = indices.reshape(-1)
        w = dequantize_rotated(weight[flat], scales[flat], codebook, n)
        local = mx.arange(flat.size, dtype=mx.uint32).reshape(indices.shape)
        return mx.gather_mm(x_rot, w.swapaxes(-1, -2), rhs_indices=local, sorted_indices=sorted_indices)
    w = dequantize_rotated(weight, scales, codebook, n)
    return mx.gather_mm(x_rot, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


_gather = mx.compile(lambda x, w, s, b, i: _gather_graph(x, w, s, b, i, False))
_gather_sorted = mx.compile(lambda x, w, s, b, i: _gather_graph(x, w, s, b, i, True))

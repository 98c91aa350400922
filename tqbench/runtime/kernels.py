"""Which implementation serves a TurboQuant product: fused kernels where they exist and passed their self-check,
else the pure-MLX reference (tqbench.runtime.codebook)."""

from __future__ import annotations

import mlx.core as mx

from tqbench.runtime import codebook as ref


def matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array) -> mx.array:
    return ref.matmul(x_rot, weight, scales, codebook)


def gather_matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool = False) -> mx.array:
    return ref.gather_matmul(x_rot, weight, scales, codebook, indices, sorted_indices)

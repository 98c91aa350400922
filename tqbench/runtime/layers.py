"""TurboQuant modules that take the place of mlx-lm's Linear and SwitchLinear in a model built by mlx-lm.

Bits, group size and rotation come from the stored tensors (codebook length, scales shape, signs) and the module's
recorded rotation, never from a recipe name. Weights stay packed: a call decodes what it needs and keeps nothing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tqbench.quant.turboquant import codes_per_word
from tqbench.runtime import codebook as ref
from tqbench.runtime import kernels

LEVELS = {3: "ternary", 4: "2-bit", 8: "3-bit", 16: "4-bit"}


def packed_words(n: int, levels: int) -> int:
    return -(-n // codes_per_word(levels))


class TurboQuantLinear(nn.Module):
    """y = rotate(x) @ W_rot.T (+ bias). `block` is the rotation block length (None: stored unrotated)."""

    def __init__(self, input_dims: int, output_dims: int, levels: int, group_size: int, block: int | None,
                 bias: bool = False):
        super().__init__()
        if levels not in LEVELS:
            raise ValueError(f"a TurboQuant codebook has 3, 4, 8 or 16 levels, not {levels}")
        self.input_dims, self.output_dims, self.group_size, self.block = input_dims, output_dims, group_size, block
        self.weight = mx.zeros((output_dims, packed_words(input_dims, levels)), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // group_size), dtype=mx.float16)
        self.codebook = mx.zeros((levels,), dtype=mx.float16)
        self.signs = mx.ones((input_dims,), dtype=mx.float16)
        if bias:
            self.bias = mx.zeros((output_dims,), dtype=mx.float16)
        self.freeze()

    def _extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, codebook={LEVELS[self.codebook.shape[0]]}, "
                f"group_size={self.group_size}, rotation_block={self.block}")

    def __call__(self, x: mx.array) -> mx.array:
        xr = ref.rotate_input(x, self.signs, self.block)
        y = kernels.matmul(xr, self.weight, self.scales, self.codebook)
        if "bias" in self:
            y = y + self.bias.astype(mx.float32)
        return y.astype(x.dtype)


class TurboQuantSwitchLinear(nn.Module):
    """The routed experts of one projection: weight (E, out, words), scales (E, out, in / g), one codebook and one
    set of signs for all experts. Called like mlx-lm's SwitchLinear: (x, indices, sorted_indices)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, levels: int, group_size: int,
                 block: int | None, bias: bool = False):
        super().__init__()
        if levels not in LEVELS:
            raise ValueError(f"a TurboQuant codebook has 3, 4, 8 or 16 levels, not {levels}")
        self.input_dims, self.output_dims, self.num_experts = input_dims, output_dims, num_experts
        self.group_size, self.block = group_size, block
        self.weight = mx.zeros((num_experts, output_dims, packed_words(input_dims, levels)), dtype=mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, input_dims // group_size), dtype=mx.float16)
        self.codebook = mx.zeros((levels,), dtype=mx.float16)
        self.signs = mx.ones((input_dims,), dtype=mx.float16)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims), dtype=mx.float16)
        self.freeze()

    def _extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_experts={self.num_experts}, "
                f"codebook={LEVELS[self.codebook.shape[0]]}, group_size={self.group_size}, "
                f"rotation_block={self.block}")

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        xr = ref.rotate_input(x, self.signs, self.block)
        y = kernels.gather_matmul(xr, self.weight, self.scales, codebook=self.codebook, indices=indices,
                                  sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices].astype(mx.float32), -2)
        return y.astype(x.dtype)


class TurboQuantConcat(nn.Module):
    """Several TurboQuant Linears over one input whose outputs an architecture concatenates (mlx-lm's kimi_k3 fuses
    KDA's q/k/v projections into one `qkv_proj`): each keeps its own rotation signs, so they cannot share one matrix."""

    def __init__(self, parts: list[TurboQuantLinear]):
        super().__init__()
        self.parts = parts

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.parts], axis=-1)

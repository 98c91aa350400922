"""Slicing TurboQuant modules for tensor parallel (tqbench.distributed.tensor), in one process with explicit rank and
size: the input slices' products sum to the whole module's, the output slices are its columns in MLX's own order, and
a slice that would cut a rotation block, a scale group or a packed word is refused in one line."""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from tqbench.distributed.tensor import SliceError, row_ranges, slice_inputs, sliced
from tqbench.quant import turboquant as tq
from tqbench.runtime import codebook as ref
from tqbench.runtime.layers import TurboQuantConcat, TurboQuantLinear, TurboQuantSwitchLinear

LEVELS = {"4": 16, "3": 8, "T": 3}


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _module(n: int, out: int, kind: str, group: int, block: int | None, experts: int = 0, bias: bool = False):
    """A TurboQuant module of real quantized weights: rotated blockwise with `block` (as the loader's rotation does)
    and quantized to `kind`'s codebook."""
    rng = _rng(n, out, kind, group, block, experts)
    shape = (experts, out, n) if experts else (out, n)
    w = mx.array(rng.standard_normal(shape).astype(np.float32))
    signs = mx.array(tq.rotation_signs("layers.0.mlp.down_proj", n)).astype(mx.float16) if block else \
        mx.ones((n,), dtype=mx.float16)
    q = tq.quantize(ref.rotate_input(w, signs, block), kind, group, None)
    if experts:
        m = TurboQuantSwitchLinear(n, out, experts, LEVELS[kind], group, block, bias)
    else:
        m = TurboQuantLinear(n, out, LEVELS[kind], group, block, bias)
    m.update({"weight": q.weight, "scales": q.scales, "codebook": mx.array(tq.codebook(kind)).astype(mx.float16),
              "signs": signs})
    if bias:
        m.bias = mx.array(rng.standard_normal(m.bias.shape).astype(np.float16))
    return m


def _max_rel(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# float32 products of a few hundred terms, summed in another order: a few units of float32 rounding (2^-24 ~ 6e-8)
# times the terms' count, relative to the largest output
SUM_ORDER = 1e-5


@pytest.mark.parametrize("kind, n, group, block, size", [
    ("4", 256, 64, 64, 2),  # blockwise rotation, two blocks a slice
    ("3", 480, 32, 160, 3),  # 3-bit: 10 codes a word
    ("T", 320, 32, None, 2),  # ternary: 20 codes a word, 160 a slice
    ("4", 256, 128, None, 2),
])
@pytest.mark.parametrize("bias", [False, True])
def test_input_slices_sum_to_the_whole_product(kind, n, group, block, size, bias):
    m = _module(n, 48, kind, group, block, bias=bias)
    x = mx.array(_rng("x", n).standard_normal((2, 3, n)).astype(np.float32))
    whole = m(x)
    width = n // size
    parts = [slice_inputs(m, r, size, "m") for r in range(size)]
    assert all(p.weight.shape == (48, m.weight.shape[-1] // size) for p in parts)  # each rank holds 1/size
    assert all(p.signs.shape == (width,) and p.scales.shape == (48, n // group // size) for p in parts)
    assert ["bias" in p for p in parts] == [bias] + [False] * (size - 1)  # summed once
    total = sum(p(x[..., r * width:(r + 1) * width]) for r, p in enumerate(parts))
    assert _max_rel(total, whole) <= SUM_ORDER
    # the slices are not the whole: one alone is far from it
    assert _max_rel(parts[0](x[..., :width]), whole) > 0.1


def test_expert_input_slices_sum_to_the_whole_product():
    m = _module(128, 32, "4", 64, None, experts=6)
    x = mx.array(_rng("xe").standard_normal((5, 1, 1, 128)).astype(np.float32))
    idx = mx.array(_rng("i").integers(0, 6, (5, 1, 2)).astype(np.uint32))
    whole = m(x, idx)
    parts = [slice_inputs(m, r, 2, "e") for r in range(2)]
    assert parts[1].weight.shape == (6, 32, 8) and parts[1].scales.shape == (6, 32, 1)
    total = parts[0](x[..., :64], idx) + parts[1](x[..., 64:], idx)
    assert _max_rel(total, whole) <= SUM_ORDER


@pytest.mark.parametrize("segments", [1, 3])
def test_output_slices_are_the_columns_mlx_gives_each_rank(segments):
    """all-to-sharded: each rank's output is its columns of the whole output, in the order MLX's own `_shard`
    (mlx.nn.layers.distributed) gives a fused weight of `segments` parts; bias sliced alike."""
    from mlx.nn.layers.distributed import _all_to_sharded, _shard

    m = _module(128, 96, "4", 64, 128, bias=True)
    x = mx.array(_rng("xr").standard_normal((4, 128)).astype(np.float32))
    whole = m(x)
    cols = mx.arange(96).astype(mx.float32)[:, None]  # row numbers, sliced by MLX's own rule
    for r in range(2):
        group = _Group(r, 2)
        mine = _shard({"weight": cols}, _all_to_sharded(segments), group)["weight"][:, 0].astype(mx.int32)
        got = sliced(m, "all-to-sharded", r, 2, segments, "m")
        assert got.weight.shape == (48, 16) and got.bias.shape == (48,)
        assert mx.array_equal(got(x), whole[:, mine])  # the very rows: no arithmetic changes
        assert [lo for lo, _ in row_ranges(96, segments, r, 2)] == [int(mine[0])] + (
            [int(mine[16]), int(mine[32])] if segments == 3 else [])


def test_a_fused_concatenation_slices_each_part_as_its_segment():
    """KDA's qkv_proj: mlx-lm shards it all-to-sharded with 3 segments; tqbench's is three TurboQuant parts."""
    parts = [_module(128, 64, "4", 64, 128) for _ in range(3)]
    for i, p in enumerate(parts):  # three different weights
        p.weight = mx.roll(p.weight, i, axis=0)
    fused = TurboQuantConcat(parts)
    x = mx.array(_rng("xq").standard_normal((2, 128)).astype(np.float32))
    whole = fused(x)
    for r in range(2):
        got = sliced(fused, "all-to-sharded", r, 2, 3, "qkv")
        assert [p.weight.shape[0] for p in got.parts] == [32, 32, 32]
        cols = [s * 64 + r * 32 + j for s in range(3) for j in range(32)]
        assert mx.array_equal(got(x), whole[:, mx.array(cols)])


@pytest.mark.parametrize("kind, n, group, block, size, why", [
    ("4", 256, 64, 256, 2, "model.layers.3.mlp.down_proj: input width 256 in 2 slices of 128 cuts a rotation "
                           "block of 256"),
    ("4", 192, 64, 64, 2, "model.layers.3.mlp.down_proj: input width 192 in 2 slices of 96 cuts a rotation block "
                          "of 64"),
    ("4", 256, 128, None, 4, "model.layers.3.mlp.down_proj: input width 256 in 4 slices of 64 cuts a scale group "
                             "of 128"),
    ("T", 256, 64, None, 2, "model.layers.3.mlp.down_proj: input width 256 in 2 slices of 128 cuts a packed word of "
                            "20 codes"),
    ("4", 256, 64, None, 3, "model.layers.3.mlp.down_proj: input width 256 in 3 slices of 85.3333: not a whole "
                            "number of columns"),
])
def test_a_slice_that_cuts_is_refused_in_one_line(kind, n, group, block, size, why):
    m = _module(n, 16, kind, group, block)
    with pytest.raises(SliceError) as e:
        sliced(m, "sharded-to-all", 0, size, 1, "model.layers.3.mlp.down_proj")
    assert str(e.value) == why


def test_output_rows_that_do_not_split_evenly_are_refused():
    m = _module(128, 48, "4", 64, None)
    with pytest.raises(SliceError, match=r"^m: output width 16 does not split into 3 equal slices$"):
        sliced(m, "all-to-sharded", 0, 3, 3, "m")  # 48 rows in 3 segments of 16, each in 3


class _Group:
    """MLX's group as `_shard` asks it: a rank and a size (a one-process stand-in for the reference rule only)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

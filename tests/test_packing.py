"""Code packing (tqbench.quant.packing) and the plan's size formulas checked against really packed arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tqbench.quant.packing import (codes_per_word, pack, pack_ternary, packed_words, unpack, unpack_ternary)
from tqbench.recipe.plan import affine_layout, turboquant_layout

RAGGED = (1, 7, 9, 10, 11, 16, 19, 20, 21, 33, 100, 129)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", RAGGED)
def test_unpack_inverts_pack(bits: int, n: int) -> None:
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, size=(3, 5, n))
    words = pack(codes, bits)
    assert words.dtype == np.uint32
    assert words.shape == (3, 5, math.ceil(n / (32 // bits)))
    np.testing.assert_array_equal(unpack(words, bits, n), codes)


@pytest.mark.parametrize("n", RAGGED)
def test_unpack_ternary_inverts_pack_ternary(n: int) -> None:
    trits = np.random.default_rng(n).integers(0, 3, size=(4, n))
    words = pack_ternary(trits)
    assert words.dtype == np.uint32 and words.shape == (4, math.ceil(n / 20))
    np.testing.assert_array_equal(unpack_ternary(words, n), trits)


def test_bit_positions_are_lsb_first() -> None:
    assert pack(np.array([1, 2, 3]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    # ten 3-bit sevens fill bits 0..29: the top two bits of the word stay unused
    assert pack(np.full(10, 7), 3).tolist() == [2**30 - 1]
    assert pack(np.full(11, 7), 3).tolist() == [2**30 - 1, 7]
    assert pack(np.array([0xF, 0x1]), 4).tolist() == [0x1F]
    assert pack(np.arange(4), 8).tolist() == [0x03020100]


def test_ternary_is_little_endian_base_3() -> None:
    assert pack_ternary(np.array([2, 1])).tolist() == [2 + 1 * 3]
    assert pack_ternary(np.full(20, 2)).tolist() == [3**20 - 1]  # the largest word: still below 2^32
    assert pack_ternary(np.full(21, 2)).tolist() == [3**20 - 1, 2]


def test_words_per_row() -> None:
    assert [codes_per_word(b) for b in (2, 3, 4, 8)] == [16, 10, 8, 4]
    assert codes_per_word(2, ternary=True) == 20
    assert packed_words(3584, 2, ternary=True) == 180  # K3 gate/up: ceil(3584 / 20)
    assert packed_words(3072, 4) == 384  # K3 down at 4 bits
    assert packed_words(7168, 3) == 717


def test_bad_codes_are_refused() -> None:
    with pytest.raises(ValueError):
        pack(np.array([4]), 2)
    with pytest.raises(ValueError):
        pack_ternary(np.array([3]))
    with pytest.raises(ValueError):
        unpack(np.zeros(2, dtype=np.uint32), 4, 7)  # 7 codes need 1 word, not 2


def _really_packed(out: int, inp: int, bits: int, group: int, ternary: bool, experts: int = 0) -> int:
    """Bytes of arrays actually packed the TurboQuant way: weight words, fp16 scales, fp16 codebook and signs."""
    rng = np.random.default_rng(out + inp)
    lead = (experts,) if experts else ()
    if ternary:
        weight = pack_ternary(rng.integers(0, 3, size=(*lead, out, inp)))
    else:
        weight = pack(rng.integers(0, 1 << bits, size=(*lead, out, inp)), bits)
    scales = np.ones((*lead, out, inp // group), dtype=np.float16)
    codebook = np.zeros(3 if ternary else 2**bits, dtype=np.float16)
    signs = np.ones(inp, dtype=np.float16)
    return weight.nbytes + scales.nbytes + codebook.nbytes + signs.nbytes


@pytest.mark.parametrize("out,inp,bits,group,ternary", [
    (32, 64, 2, 32, False), (48, 192, 3, 64, False), (40, 320, 4, 64, False), (33, 128, 3, 128, False),
    (64, 96, 3, 32, False), (32, 640, 2, 64, True), (35, 96, 2, 32, True), (16, 3584, 2, 64, True)])
def test_turboquant_formula_matches_packed_bytes(out: int, inp: int, bits: int, group: int, ternary: bool) -> None:
    layout = turboquant_layout("m", out, inp, bits, group, ternary)
    w = 20 if ternary else 32 // bits
    formula = out * (4 * math.ceil(inp / w) + 2 * inp // group) + 2 * inp + 2 * (3 if ternary else 2**bits)
    assert sum(t.nbytes for t in layout) == formula == _really_packed(out, inp, bits, group, ternary)


def test_stacked_expert_layout_matches_packed_bytes() -> None:
    layout = turboquant_layout("e", 40, 96, 3, 32, experts=5, bias=True)
    assert [t.name for t in layout] == ["e.weight", "e.scales", "e.codebook", "e.signs", "e.bias"]
    assert [t.streamed for t in layout] == [True, True, False, False, True]
    assert sum(t.nbytes for t in layout) == _really_packed(40, 96, 3, 32, False, experts=5) + 5 * 40 * 2


def test_k3_expert_page_from_real_packing() -> None:
    """The published K3 page, tq3a-tqTe-down4-g64: gate+up 5,111,808 B, down 5,849,088 B, from packed arrays."""
    rng = np.random.default_rng(0)
    gate = pack_ternary(rng.integers(0, 3, size=(3072, 3584))).nbytes + 3072 * (3584 // 64) * 2
    down = pack(rng.integers(0, 16, size=(3584, 3072)), 4).nbytes + 3584 * (3072 // 64) * 2
    assert 2 * gate == 5_111_808
    assert down == 5_849_088
    tq_gate = turboquant_layout("g", 3072, 3584, None, 64, ternary=True, experts=1)
    tq_down = turboquant_layout("d", 3584, 3072, 4, 64, experts=1)
    assert sum(t.nbytes for t in tq_gate if t.streamed) == gate
    assert sum(t.nbytes for t in tq_down if t.streamed) == down


@pytest.mark.parametrize("out,inp,bits,group", [(64, 256, 4, 64), (32, 128, 3, 32), (48, 384, 8, 128),
                                                 (32, 256, 6, 64), (40, 192, 2, 64)])
def test_affine_formula_matches_mlx(out: int, inp: int, bits: int, group: int) -> None:
    mx = pytest.importorskip("mlx.core")
    w = mx.array(np.random.default_rng(1).standard_normal((out, inp)).astype(np.float16))
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    layout = affine_layout("m", out, inp, bits, group)
    assert [t.shape for t in layout] == [tuple(q.shape), tuple(scales.shape), tuple(biases.shape)]
    assert sum(t.nbytes for t in layout) == q.nbytes + scales.nbytes + biases.nbytes
    assert sum(t.nbytes for t in layout) == out * inp * bits // 8 + 4 * out * inp // group


@pytest.mark.parametrize("levels,n", [(4, 37), (8, 23), (16, 9), (3, 41)])
def test_numpy_packing_matches_the_mlx_quantizer(levels: int, n: int) -> None:
    """The converter's MLX packer and this numpy one must write the same words."""
    tq = pytest.importorskip("tqbench.quant.turboquant")
    mx = pytest.importorskip("mlx.core")
    codes = np.random.default_rng(levels + n).integers(0, levels, size=(6, n))
    ours = pack_ternary(codes) if levels == 3 else pack(codes, levels.bit_length() - 1)
    theirs = np.array(tq.pack(mx.array(codes.astype(np.uint32)), levels))
    np.testing.assert_array_equal(ours, theirs)

"""TurboQuant modules against an independent computation: dequantize-then-matmul in float32 with the weights taken
back to the input's own domain (tqbench.quant.turboquant.dequantize un-rotates), never the module's own path."""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from tqbench.quant import turboquant as tq
from tqbench.runtime.layers import TurboQuantLinear, TurboQuantSwitchLinear

KINDS = {"2": 4, "3": 8, "4": 16, "T": 3}  # codebook kind -> levels


def _quantized(w: mx.array, kind: str, group: int, path: str, rotated: bool):
    n = w.shape[-1]
    signs = mx.array(tq.rotation_signs(path, n)) if rotated else None
    q = tq.quantize(w, kind, group, signs)
    book = mx.array(tq.codebook(kind))
    stored_signs = signs.astype(mx.float16) if rotated else mx.ones((n,), dtype=mx.float16)
    expected_w = tq.dequantize(q.weight, q.scales, book, signs, n)  # float32, input domain
    return q, book, stored_signs, expected_w


def _fill(m, q, book, signs):
    m.weight, m.scales, m.codebook, m.signs = q.weight, q.scales, book, signs


def _rel(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("n, group", [(128, 64), (352, 32)])  # 352 = 11 x 32: blockwise rotation in blocks of 32
@pytest.mark.parametrize("rows", [1, 9])  # decode, prefill
def test_dense_module_equals_dequantize_then_matmul(kind, rotated, n, group, rows):
    rng = np.random.default_rng(zlib.crc32(repr((kind, rotated, n, rows)).encode()))
    w = mx.array(rng.standard_normal((48, n)).astype(np.float32))
    q, book, signs, expected_w = _quantized(w, kind, group, "layers.0.self_attn.q_proj", rotated)
    block = tq.rotation_block(n) if rotated else None
    assert block == (32 if n == 352 else n) or not rotated
    m = TurboQuantLinear(n, 48, KINDS[kind], group, block, bias=False)
    _fill(m, q, book, signs)
    x = mx.array(rng.standard_normal((2, rows, n)).astype(np.float32))
    got = m(x)
    assert got.dtype == mx.float32 and got.shape == (2, rows, 48)
    assert _rel(got, x @ expected_w.T) <= 1e-5
    # The weights really are quantized: the float weights give a clearly different product.
    assert _rel(got, x @ w.T) > 1e-3


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("tokens", [1, 40])  # decode (2 of 6 experts), prefill (more expert copies than experts)
def test_expert_module_equals_dequantize_then_gather_matmul(kind, rotated, tokens):
    rng = np.random.default_rng(zlib.crc32(repr((kind, rotated, tokens)).encode()))
    E, out, n, group, k = 6, 40, 160, 32, 2  # 160 = 20 x 8
    w = mx.array(rng.standard_normal((E, out, n)).astype(np.float32))
    q, book, signs, expected_w = _quantized(w, kind, group, "layers.1.mlp.switch_mlp.up_proj", rotated)
    m = TurboQuantSwitchLinear(n, out, E, KINDS[kind], group, tq.rotation_block(n) if rotated else None)
    _fill(m, q, book, signs)
    x = mx.array(rng.standard_normal((1, tokens, 1, 1, n)).astype(np.float32))  # as mlx-lm's SwitchGLU calls it
    idx = mx.array(rng.integers(0, E, (1, tokens, k)).astype(np.uint32))
    got = m(x, idx)
    assert got.shape == (1, tokens, k, 1, out)
    ew, xs, ids = np.array(expected_w), np.array(x), np.array(idx)
    expected = np.einsum("tn,tkon->tko", xs[0, :, 0, 0], ew[ids[0]])  # per token and slot: x @ W[expert].T
    assert _rel(got[0, :, :, 0], mx.array(expected)) <= 1e-5


def test_bias_and_bf16_input():
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((32, 64)).astype(np.float32))
    q, book, signs, expected_w = _quantized(w, "4", 32, "lm_head", True)
    m = TurboQuantLinear(64, 32, 16, 32, 64, bias=True)
    _fill(m, q, book, signs)
    m.bias = mx.array(rng.standard_normal(32).astype(np.float16))
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32)).astype(mx.bfloat16)
    got = m(x)
    assert got.dtype == mx.bfloat16  # the module answers in its input's dtype
    expected = x.astype(mx.float32) @ expected_w.T + m.bias.astype(mx.float32)
    assert _rel(got.astype(mx.float32), expected) <= 8e-3  # one bf16 rounding of the output
    assert _rel(m(x.astype(mx.float32)), expected) <= 1e-5


def test_codebook_length_must_be_a_turboquant_one():
    with pytest.raises(ValueError, match="3, 4, 8 or 16 levels, not 5"):
        TurboQuantLinear(64, 32, 5, 32, None)

"""The reference gather stays inside MLX's CUDA gather_mm limits on every backend: at most 1,024 matrices and
GATHER_MAX_BYTES of any operand per call (past 2 GiB its grouped GEMM's 32-bit byte offsets read out of bounds).

A CPU has neither limit, so the tests watch every gather_mm call the reference makes (the real op runs; the spy only
records its operands) and check the products against numpy on the decoded weights."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tqbench.runtime import codebook as ref
from tqbench.runtime.kernels import random_case


class GatherSpy:
    """Records (matrices in b, largest operand's bytes) of each mx.gather_mm call, then runs the real one."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        self.real = mx.gather_mm
        monkeypatch.setattr(mx, "gather_mm", self)

    def __call__(self, a, b, *args, **kw):
        y = self.real(a, b, *args, **kw)
        groups = math.prod(b.shape[:-2])
        self.calls.append((groups, max(a.nbytes, b.nbytes, y.nbytes)))
        return y


def numpy_gather(x, weight, scales, book, indices) -> np.ndarray:
    """x (..., m, n) times each indexed expert's decoded weights, in float64 (broadcast as gather_mm does)."""
    w = np.array(ref.dequantize_rotated(weight, scales, book, x.shape[-1]), np.float64)
    xs, idx = np.array(x, np.float64), np.array(indices)
    bshape = np.broadcast_shapes(xs.shape[:-2], idx.shape)
    xb = np.broadcast_to(xs, (*bshape, *xs.shape[-2:]))
    return np.einsum("...mn,...on->...mo", xb, w[np.broadcast_to(idx, bshape)])


def close(got, want) -> bool:
    got = np.array(got, np.float64)
    return got.shape == want.shape and float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


# ---- the pieces ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_pieces_cover_every_pair_in_order_within_the_limits(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    groups, rows_max = int(rng.integers(1, 6)), int(rng.integers(1, 40))
    monkeypatch.setattr(ref, "GATHER_MAX_GROUPS", groups)
    monkeypatch.setattr(ref, "GATHER_MAX_BYTES", 1000 * rows_max)
    ranked = np.sort(rng.integers(0, 30, int(rng.integers(1, 400))))
    ranked[: rng.integers(0, ranked.size)] = ranked[0]  # one expert with many rows
    ranked.sort()
    pieces = ref.gather_pieces(ranked, expert_bytes=1000, row_bytes=1000)
    assert pieces[0][0] == 0 and pieces[-1][1] == ranked.size
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, in order
    for lo, hi in pieces:
        assert 0 < hi - lo <= rows_max
        assert len(np.unique(ranked[lo:hi])) <= groups
    for (_, hi), (lo, _) in zip(pieces, pieces[1:]):  # an expert is split only where its own rows overflow a piece
        if ranked[hi - 1] == ranked[lo]:
            assert np.count_nonzero(ranked == ranked[lo]) > rows_max


def test_pieces_respect_the_decoded_bytes():
    ranked = np.repeat(np.arange(10), 3)
    pieces = ref.gather_pieces(ranked, expert_bytes=ref.GATHER_MAX_BYTES // 4, row_bytes=16)
    assert pieces == [(0, 12), (12, 24), (24, 30)]  # 4 experts of a quarter of the limit each


# ---- products against numpy -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [3, 16])
def test_products_in_pieces_match_numpy_in_every_shape(monkeypatch, levels):
    """SwitchGLU's two calls (unsorted: x (B, L, 1, 1, n) against indices (B, L, K); sorted: x (R, 1, n) against
    indices (R,)) and x with several rows per pair, at limits small enough to cut them into many pieces."""
    n, out, experts = 128, 24, 9
    weight, scales, book = random_case(levels, 32, n, out, experts, key=levels)
    spy = GatherSpy(monkeypatch)
    one_expert = 4 * out * n
    monkeypatch.setattr(ref, "GATHER_MAX_GROUPS", 3)
    monkeypatch.setattr(ref, "GATHER_MAX_BYTES", 5 * one_expert)
    rng = np.random.default_rng(levels)
    idx = mx.array(rng.integers(0, experts, (2, 7, 4)).astype(np.uint32))
    cases = [(mx.random.normal((2, 7, 1, 1, n), key=mx.random.key(1)), idx, False),
             (mx.random.normal((2, 7, 4, 3, n), key=mx.random.key(2)), idx, False)]
    flat = np.array(idx).reshape(-1)
    order = np.argsort(flat, kind="stable")
    x = mx.random.normal((56, 1, n), key=mx.random.key(3))
    cases.append((x[mx.array(order // 4)], mx.array(flat[order]), True))
    for x, indices, is_sorted in cases:
        spy.calls.clear()
        got = ref.gather_matmul(x, weight, scales, book, indices, is_sorted)
        assert close(got, numpy_gather(x, weight, scales, book, indices))
        assert len(spy.calls) > 1
        assert all(g <= 3 and b <= 5 * one_expert for g, b in spy.calls)


def test_more_routings_than_1024_never_reach_one_gather_mm(monkeypatch):
    """The demo at 140 tokens x top-8 (1,120 routings) against a pool of 1,217 slots: what failed on CUDA."""
    n, out, slots = 64, 32, 1217
    weight, scales, book = random_case(16, 32, n, out, slots, key=7)
    idx = np.sort(np.random.default_rng(0).integers(0, slots, 1120)).astype(np.uint32)
    x = mx.random.normal((1120, 1, n), key=mx.random.key(4))
    spy = GatherSpy(monkeypatch)
    got = ref.gather_matmul(x, weight, scales, book, mx.array(idx), True)
    assert close(got, numpy_gather(x, weight, scales, book, mx.array(idx)))
    assert spy.calls and max(g for g, _ in spy.calls) <= 1024


def test_small_products_stay_one_compiled_call(monkeypatch):
    """Decode-sized products do not sync on their indices: one gather_mm, as before."""
    weight, scales, book = random_case(8, 32, 64, 16, 40, key=9)
    spy = GatherSpy(monkeypatch)
    idx = mx.array([[3, 17, 3, 30]], dtype=mx.uint32)
    x = mx.random.normal((1, 1, 1, 64), key=mx.random.key(5))
    got = ref.gather_matmul(x, weight, scales, book, idx)
    assert close(got, numpy_gather(x, weight, scales, book, idx))
    assert [g for g, _ in spy.calls] == [4]  # the four named copies (a fresh trace of this shape)


@pytest.mark.slow
def test_k3_sized_experts_stay_under_the_byte_limit(monkeypatch):
    """K3's routed up/gate shape (3,584 -> 3,072: 44 MB decoded per expert) at 16 tokens x top-16, sorted as SwitchGLU
    sorts them: one gather_mm would decode 11 GB (what crashed on the GPU); each piece stays under the limit."""
    n, out, experts = 3584, 3072, 20
    weight, scales, book = random_case(3, 64, n, out, experts, key=11)
    idx = np.sort(np.random.default_rng(1).integers(0, experts, 256)).astype(np.uint32)
    x = mx.random.normal((256, 1, n), key=mx.random.key(6))
    spy = GatherSpy(monkeypatch)
    got = np.array(ref.gather_matmul(x, weight, scales, book, mx.array(idx), True))
    assert spy.calls and all(b <= ref.GATHER_MAX_BYTES for _, b in spy.calls)
    w = np.array(ref.dequantize_rotated(weight[:4], scales[:4], book, n), np.float64)  # rows of experts 0-3
    rows = np.flatnonzero(idx < 4)
    want = np.einsum("rn,ron->ro", np.array(x[mx.array(rows), 0], np.float64), w[idx[rows]])
    assert close(got[rows, 0], want)

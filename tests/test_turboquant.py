"""TurboQuant core, checked against independent numpy computations."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tqbench.errors import TqbenchError
from tqbench.quant import turboquant as tq


# TurboQuant-MLX's published levels (positive halves), typed in independently of the module.
PUBLISHED = {
    "2": [0.4527799975, 1.5104174569],
    "3": [0.2450941497, 0.7560051861, 1.3439090860, 2.1519452850],
    "4": [0.1285059463, 0.3883729570, 0.6572738605, 0.9430078288, 1.2570025732, 1.6188648437, 2.0698191883,
          2.7332986608],
    "T": [0.0, 1.2240],
}


def published_levels(kind: str) -> np.ndarray:
    half = PUBLISHED[kind]
    return np.array([-v for v in half[::-1] if v] + half, dtype=np.float64)


def published_boundaries(kind: str) -> np.ndarray:
    lv = published_levels(kind)
    return ((lv[1:] + lv[:-1]) / 2).astype(np.float32)


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
@pytest.mark.parametrize("n", [1, 7, 19, 20, 21, 64, 333])
def test_pack_roundtrip_and_layout(kind, n):
    levels = len(tq.CODEBOOKS[kind])
    rng = np.random.default_rng(n)
    codes = rng.integers(0, levels, (3, n)).astype(np.uint32)
    words = np.array(tq.pack(mx.array(codes), levels))
    per = tq.codes_per_word(levels)
    assert words.shape == (3, math.ceil(n / per)) and words.dtype == np.uint32
    # Independent packing: word j holds codes j*per .. j*per+per-1, the first in the lowest digit.
    base = 3 if levels == 3 else levels
    for r in range(3):
        for j in range(words.shape[1]):
            chunk = codes[r, j * per:(j + 1) * per]
            assert int(words[r, j]) == sum(int(c) * base**i for i, c in enumerate(chunk))
    np.testing.assert_array_equal(np.array(tq.unpack(mx.array(words), levels, n)), codes)


def test_codes_per_word():
    assert [tq.codes_per_word(x) for x in (4, 8, 16, 3)] == [16, 10, 8, 20]
    assert 3**20 < 2**32


def test_hadamard_support():
    assert all(tq.hadamard_ok(n) for n in (64, 3072, 3584, 7168, 12288, 20, 28 * 2**10))
    assert not any(tq.hadamard_ok(n) for n in (0, 3, 36, 100, 7000))


def test_rotation_is_the_normalised_sylvester_hadamard_with_signs():
    n = 256
    s = tq.rotation_signs("model.layers.0.self_attn.q_proj", n)
    assert set(np.unique(s)) == {-1, 1}
    x = np.random.default_rng(0).standard_normal((5, n)).astype(np.float32)
    expected = (x * s) @ sylvester(n).T / math.sqrt(n)
    np.testing.assert_allclose(np.array(tq.rotate(mx.array(x), mx.array(s))), expected, atol=1e-4)


def test_rotation_preserves_products_for_k3_sizes():
    rng = np.random.default_rng(1)
    for n in (3584, 3072, 7168):
        s = mx.array(tq.rotation_signs(f"layer.{n}", n))
        w = rng.standard_normal((4, n)).astype(np.float32)
        x = rng.standard_normal((n,)).astype(np.float32)
        w_rot, x_rot = tq.rotate(mx.array(w), s), tq.rotate(mx.array(x), s)
        np.testing.assert_allclose(np.linalg.norm(np.array(w_rot), axis=1), np.linalg.norm(w, axis=1), rtol=1e-5)
        np.testing.assert_allclose(np.array(w_rot @ x_rot), w @ x, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.array(tq.unrotate(w_rot, s)), w, atol=1e-4)


def test_seeds_are_stable_across_processes():
    # crc32("model.layers.1.mlp") = 0x6a2cf6b0; the seed must not depend on Python's hash salt.
    import zlib

    assert tq.layer_seed("model.layers.1.mlp") == 42 + zlib.crc32(b"model.layers.1.mlp")
    a = tq.rotation_signs("x", 64)
    b = tq.rotation_signs("x", 64)
    c = tq.rotation_signs("y", 64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("kernel", tq.available_quantizer_kernels())
@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
def test_codes_count_the_published_boundaries(kind, kernel):
    # Every kernel (the compiled one of the CPU and Metal, the unfused ones for CUDA) against one numpy reference.
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    g = 64
    q = tq.quantize(mx.array(w), kind, g, None, kernel=kernel)
    book = tq.codebook(kind).astype(np.float32)
    # Independent: fp16 RMS scale per group, then the number of boundaries (midpoints of the published levels) <= v.
    groups = w.reshape(8, 256 // g, g)
    scales = np.maximum(np.sqrt((groups.astype(np.float64) ** 2).mean(-1)), 1e-7).astype(np.float16)
    np.testing.assert_array_equal(np.array(q.scales), scales)
    ratio = groups / scales.astype(np.float32)[..., None]
    want = (ratio[..., None] >= published_boundaries(kind)).sum(-1).reshape(8, 256)
    got = np.array(tq.unpack(q.weight, len(book), 256))
    np.testing.assert_array_equal(got, want)
    nearest = np.abs(ratio[..., None] - book).argmin(-1).reshape(8, 256)
    assert (got != nearest).mean() < 1e-3  # the published midpoints sit within 4e-4 of the fp16 levels' midpoints
    recon = book[got].reshape(8, 256 // g, g) * scales.astype(np.float32)[..., None]
    rel = np.linalg.norm(recon - groups) / np.linalg.norm(groups)
    assert q.rel_error == pytest.approx(rel, rel=1e-4)


def test_the_default_quantizer_is_compiled_on_the_cpu_and_cuda_on_cuda():
    default = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert tq.quantizer_kernel() == "compiled"
    finally:
        mx.set_default_device(default)
    assert tq.quantizer_kernel() == ("cuda" if mx.cuda.is_available() and default.type == mx.gpu else "compiled")
    with pytest.raises(ValueError, match="unknown quantizer kernel 'fast'"):
        tq.quantize(mx.zeros((2, 64)), "3", 64, None, kernel="fast")


def test_the_environment_chooses_the_quantizer_kernel(monkeypatch):
    monkeypatch.setenv("TQBENCH_QUANTIZER", "compare")
    assert tq.quantizer_kernel() == "compare"
    monkeypatch.setenv("TQBENCH_QUANTIZER", "fast")
    usable = ", ".join(tq.available_quantizer_kernels())
    with pytest.raises(TqbenchError, match=f"TQBENCH_QUANTIZER='fast': choose one of {usable}$"):
        tq.quantizer_kernel()
    if "cuda" not in tq.available_quantizer_kernels():
        monkeypatch.setenv("TQBENCH_QUANTIZER", "cuda")
        with pytest.raises(TqbenchError, match=r"choose one of compiled, passes, compare \(cuda needs MLX's CUDA"):
            tq.quantizer_kernel()
        with pytest.raises(ValueError, match="the cuda quantizer kernel needs MLX's CUDA build"):
            tq.quantize(mx.zeros((2, 64)), "3", 64, None, kernel="cuda")


@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
def test_the_cuda_kernel_source_holds_the_exact_boundaries_and_levels(kind):
    # The CUDA kernel runs only where MLX has a GPU (the tests above run it there); its constants are checked here.
    import re

    from tqbench.quant import cuda_quantizer

    book = tuple(float(v) for v in tq.codebook(kind).astype(np.float32))
    src = cuda_quantizer.kernel_source(book, tuple(float(b) for b in tq.boundaries(kind)), 64, 20)
    consts = [np.uint32(int(h, 16)).view(np.float32) for h in re.findall(r"__int_as_float\(0x([0-9a-f]{8})\)", src)]
    np.testing.assert_array_equal(consts[0], published_levels(kind).astype(np.float16).astype(np.float32)[0])
    np.testing.assert_array_equal(consts[1::2], published_boundaries(kind))  # each boundary, then the level above it
    np.testing.assert_array_equal(consts[2::2], published_levels(kind).astype(np.float16).astype(np.float32)[1:])


@pytest.mark.parametrize("kernel", tq.available_quantizer_kernels())
@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
def test_searched_scales_are_each_groups_best_candidate(kind, kernel):
    """The search rule against numpy: every group's scale is one of the float16 candidates (multiples of its RMS),
    with the least squared error among them (float64 here); its codes count the boundaries as the RMS rule's do;
    and no group ends worse than under the RMS rule."""
    rng = np.random.default_rng(7)
    w = (rng.standard_t(5, (16, 256)) * rng.uniform(0.05, 2, (16, 1))).astype(np.float32)
    g = 64
    q = tq.quantize(mx.array(w), kind, g, None, kernel=kernel, rule="search")
    book = tq.codebook(kind).astype(np.float32)
    groups = w.reshape(16, 256 // g, g)
    rms = np.sqrt((groups.astype(np.float64) ** 2).mean(-1))

    def error(scales: np.ndarray) -> np.ndarray:
        ratio = groups / scales.astype(np.float32)[..., None]
        codes = (ratio[..., None] >= published_boundaries(kind)).sum(-1)
        return ((book[codes] * scales.astype(np.float64)[..., None] - groups) ** 2).sum(-1), codes

    candidates = np.stack([np.maximum(rms * m, 1e-7).astype(np.float16) for m in tq.SEARCH_MULTIPLIERS])
    errors = np.stack([error(c)[0] for c in candidates])
    got = np.array(q.scales)
    assert ((candidates == got).any(0)).all()  # a candidate
    got_error, got_codes = error(got)
    assert (got_error <= errors.min(0) * (1 + 1e-5) + 1e-12).all()  # the best one
    rms_error = error(candidates[list(tq.SEARCH_MULTIPLIERS).index(1.0)])[0]
    assert (got_error <= rms_error * (1 + 1e-6)).all() and got_error.sum() < 0.99 * rms_error.sum()
    np.testing.assert_array_equal(np.array(tq.unpack(q.weight, len(book), 256)), got_codes.reshape(16, 256))
    assert q.rel_error == pytest.approx(math.sqrt(got_error.sum() / (groups.astype(np.float64) ** 2).sum()), rel=1e-4)


@pytest.mark.parametrize("kernel", [k for k in tq.available_quantizer_kernels() if k != "cuda"])
def test_the_search_in_one_graph_equals_one_candidate_at_a_time(kernel, monkeypatch):
    """Small matrices try every candidate in one graph, large ones one at a time: the same scales and codes."""
    w = mx.array(np.random.default_rng(3).standard_t(4, (48, 256)).astype(np.float32))
    at_once = tq.quantize(w, "3", 64, None, kernel=kernel, rule="search")
    monkeypatch.setattr(tq, "SEARCH_AT_ONCE", 0)
    in_turn = tq.quantize(w, "3", 64, None, kernel=kernel, rule="search")
    np.testing.assert_array_equal(np.array(at_once.scales), np.array(in_turn.scales))
    np.testing.assert_array_equal(np.array(at_once.weight), np.array(in_turn.weight))


def test_an_unknown_scale_rule_is_refused():
    with pytest.raises(ValueError, match="unknown scale rule 'max'"):
        tq.quantize(mx.zeros((4, 64)), "4", 64, None, rule="max")


@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
def test_gaussian_error_matches_codebook_mse(kind):
    w = mx.random.normal((256, 3584), key=mx.random.key(3))
    s = mx.array(tq.rotation_signs("gauss", 3584))
    q = tq.quantize(w, kind, 64, s)
    mse = q.rel_error**2
    # Per-group RMS normalisation makes the error slightly lower than the ideal N(0,1) figure.
    assert 0.93 * tq.CODEBOOK_MSE[kind] < mse < 1.01 * tq.CODEBOOK_MSE[kind]
    w_hat = tq.dequantize(q.weight, q.scales, mx.array(tq.codebook(kind)), s, 3584)
    true_rel = float(mx.sqrt(mx.sum((w_hat - w) ** 2) / mx.sum(w * w)))
    assert true_rel == pytest.approx(q.rel_error, rel=1e-3)


def test_group_must_divide():
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        tq.quantize(mx.zeros((2, 96)), "3", 64, None)


# --- codebook levels and ties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
def test_codebook_is_the_published_levels(kind):
    levels = published_levels(kind)
    np.testing.assert_array_equal(tq.codebook(kind), levels.astype(np.float16))
    np.testing.assert_array_equal(tq.boundaries(kind), published_boundaries(kind))
    if kind != "T":
        # The 4-decimal roundings give the same float16 codebook but boundaries up to 4e-4 away: boundaries must come
        # from the full-precision levels, not from the stored float16 ones.
        rounded = np.round(levels, 4)
        np.testing.assert_array_equal(rounded.astype(np.float16), tq.codebook(kind))
        b16 = tq.codebook(kind).astype(np.float64)
        assert not np.array_equal(((b16[1:] + b16[:-1]) / 2).astype(np.float32), tq.boundaries(kind))


@pytest.mark.parametrize("kernel", tq.available_quantizer_kernels())
@pytest.mark.parametrize("kind", ["2", "3", "4", "T"])
@pytest.mark.parametrize("power", [1.0, 4.0, 0.125])
def test_values_exactly_on_a_boundary_take_the_upper_code(kind, power, kernel):
    """Group RMS = a power of two (exact in fp16), so v = w / scale is exactly the boundary, or its float32 neighbour."""
    bounds = published_boundaries(kind)
    g = 64
    rows = []
    for shift in (-np.inf, 0, np.inf):  # just below, exactly on, just above each boundary
        vals = np.nextafter(bounds, np.float32(shift)) if shift else bounds.copy()
        vals[bounds == 0] = np.float32(np.sign(shift) * 2.0**-20) if shift else 0  # scaling keeps no denormal
        fill = g - len(vals)
        c = math.sqrt((g - float((vals.astype(np.float64) ** 2).sum())) / fill)
        rows.append(np.concatenate([vals, np.full(fill, c, np.float32)]))
    w = (np.stack(rows) * np.float32(power)).astype(np.float32)
    scales = np.sqrt((w.astype(np.float64) ** 2).mean(-1)).astype(np.float16)
    assert np.all(scales == power)  # precondition: the division below is exact
    q = tq.quantize(mx.array(w), kind, g, None, kernel=kernel)
    np.testing.assert_array_equal(np.array(q.scales)[:, 0], scales)
    got = np.array(tq.unpack(q.weight, len(tq.CODEBOOKS[kind]), g))
    v = w / scales.astype(np.float32)[:, None]
    np.testing.assert_array_equal(got, (v[..., None] >= bounds).sum(-1))
    k = len(bounds)
    np.testing.assert_array_equal(got[0, :k], np.arange(k))  # below boundary i: code i
    np.testing.assert_array_equal(got[1, :k], np.arange(1, k + 1))  # on boundary i: the upper code i + 1
    np.testing.assert_array_equal(got[2, :k], np.arange(1, k + 1))


# --- rotation: full and blockwise -----------------------------------------------------------------------------------


def mlx_hadamard(b: int) -> np.ndarray:
    """mx.hadamard_transform of length b as a matrix M (y = x @ M), checked to be a scaled Hadamard matrix."""
    m = np.array(mx.hadamard_transform(mx.eye(b), scale=1.0)).astype(np.float64)
    assert set(np.unique(m)) == {-1.0, 1.0}
    np.testing.assert_array_equal(m @ m.T, b * np.eye(b))
    return m / math.sqrt(b)


@pytest.mark.parametrize(("n", "block"), [
    (64, 64), (3584, 3584), (3072, 3072), (7168, 7168), (96, 96), (20, 20),  # one transform
    (352, 32), (11264, 1024), (1056, 96), (288, 96), (1920, 640), (2688, 896), (7000, 56), (144, 48),  # blockwise
    (33792, 3072),  # K3's dense down_proj: 33 x 1024 = 11 x 3072, and 3072 = 12 * 2^8 is the largest block
    (36, None), (72, None), (100, None), (9, None), (0, None),  # no block of >= 32
])
def test_rotation_block(n, block):
    assert tq.rotation_block(n) == block
    if block:
        # Independent: the largest divisor of n of the form m * 2^k.
        cands = [d for d in range(1, n + 1) if n % d == 0 and any(
            d % m == 0 and (d // m) & (d // m - 1) == 0 for m in (1, 12, 20, 28))]
        assert max(cands) == block


def test_rotation_record():
    assert tq.rotation_record(7168, True) == {"kind": "hadamard", "block": 7168}
    assert tq.rotation_record(33792, True) == {"kind": "blockwise-hadamard", "block": 3072}
    assert tq.rotation_record(33792, False) == {"kind": "none", "block": None}
    assert tq.rotation_record(72, False) == {"kind": "none", "block": None}
    with pytest.raises(ValueError, match="no Hadamard rotation of length 72"):
        tq.rotation_record(72, True)


@pytest.mark.parametrize("n", [352, 11264])
def test_blockwise_rotation_is_the_sylvester_matrix_per_block(n):
    b = tq.rotation_block(n)
    s = tq.rotation_signs("model.layers.0.mlp.down_proj", n)
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    blocks = (x * s).astype(np.float64).reshape(3, n // b, b)
    expected = (blocks @ sylvester(b).T / math.sqrt(b)).reshape(3, n)  # signs over all n first, then each block
    np.testing.assert_allclose(np.array(tq.rotate(mx.array(x), mx.array(s))), expected, atol=1e-4)


@pytest.mark.parametrize("n", [1056, 1920, 2688, 240, 560])
def test_blockwise_rotation_of_12_20_28_blocks(n):
    b = tq.rotation_block(n)
    s = tq.rotation_signs("blk", n)
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    expected = ((x * s).astype(np.float64).reshape(3, n // b, b) @ mlx_hadamard(b)).reshape(3, n)
    np.testing.assert_allclose(np.array(tq.rotate(mx.array(x), mx.array(s))), expected, atol=1e-4)


@pytest.mark.parametrize("n", [64, 96, 20 * 64, 28 * 32, 3584, 352, 288, 1056, 1920, 2688, 7000])
def test_rotation_is_orthogonal_and_unrotate_inverts_it(n):
    s = mx.array(tq.rotation_signs(f"layer.{n}", n))
    x = np.random.default_rng(n).standard_normal((4, 2, n)).astype(np.float32)
    r = tq.rotate(mx.array(x), s)
    np.testing.assert_allclose(np.linalg.norm(np.array(r), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.array(tq.unrotate(r, s)), x, atol=1e-5)
    # unrotate is the transpose: <rotate(x), y> == <x, unrotate(y)>
    y = np.random.default_rng(n + 1).standard_normal((4, 2, n)).astype(np.float32)
    lhs = (np.array(r).astype(np.float64) * y).sum(-1)
    rhs = (x.astype(np.float64) * np.array(tq.unrotate(mx.array(y), s))).sum(-1)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-3)


def test_full_size_k3_dense_down_proj_roundtrip():
    n = 33792
    s = mx.array(tq.rotation_signs("language_model.model.layers.0.mlp.down_proj", n))
    x = np.random.default_rng(7).standard_normal((2, n)).astype(np.float32)
    r = tq.rotate(mx.array(x), s)
    np.testing.assert_allclose(np.linalg.norm(np.array(r), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np.array(tq.unrotate(r, s)), x, atol=1e-5)


@pytest.mark.parametrize("n", [36, 72, 100])
def test_every_rotating_function_refuses_the_same_lengths(n):
    s = mx.ones((n,))
    with pytest.raises(ValueError) as e:
        tq.rotate(mx.zeros((2, n)), s)
    msg = str(e.value)
    assert msg.startswith(f"no Hadamard rotation of length {n}")
    words = mx.zeros((2, n), dtype=mx.uint32)
    scales = mx.ones((2, n // 4), dtype=mx.float16)
    book = mx.array(tq.codebook("3"))
    calls = [lambda: tq.unrotate(mx.zeros((2, n)), s), lambda: tq.quantize(mx.zeros((2, n)), "3", 4, s),
             lambda: tq.dequantize(words, scales, book, s, n), lambda: tq.rotation_record(n, True)]
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == msg
    # Without signs nothing is rotated, so the same lengths quantize and dequantize.
    q = tq.quantize(mx.ones((2, n)), "3", 4, None)
    assert np.isfinite(np.array(tq.dequantize(q.weight, q.scales, book, None, n))).all()


@pytest.mark.parametrize(("n", "group"), [(3584, 64), (1056, 32), (288, 32)])
def test_rotation_lowers_the_error_on_heavy_tailed_weights(n, group):
    rng = np.random.default_rng(n)
    w = rng.standard_t(2.5, (64, n)).astype(np.float32) * rng.uniform(0.5, 2, n).astype(np.float32)
    s = mx.array(tq.rotation_signs("heavy", n))
    book = mx.array(tq.codebook("3"))
    errors = {}
    for name, signs in (("rotated", s), ("plain", None)):
        q = tq.quantize(mx.array(w), "3", group, signs)
        w_hat = np.array(tq.dequantize(q.weight, q.scales, book, signs, n))
        errors[name] = np.linalg.norm(w_hat - w) / np.linalg.norm(w)
        assert q.rel_error == pytest.approx(errors[name], rel=1e-3)
    assert errors["rotated"] < 0.9 * errors["plain"]

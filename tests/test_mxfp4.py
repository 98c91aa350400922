"""mxfp4 packer and decoder: bit-exact against MLX's decoder, and round-to-nearest against a brute-force reference."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mlx_decode(packed: np.ndarray, scales: np.ndarray, dtype=mx.float32) -> np.ndarray:
    w = mx.dequantize(mx.array(packed).view(mx.uint32), mx.array(scales), None, group_size=32, bits=4, mode="mxfp4",
                      dtype=dtype)  # fmt: skip
    return np.array(w.astype(mx.float32))


def test_decode_matches_mlx_for_every_scale_and_code():
    codes = np.arange(16, dtype=np.uint8)
    row = np.concatenate([codes, codes[::-1]])  # every code in a low and in a high nibble
    packed = np.tile(row[0::2] | (row[1::2] << 4), (256, 1)).astype(np.uint8)
    scales = np.arange(256, dtype=np.uint8)[:, None]
    ours = unpack_mxfp4(packed, scales)
    assert ours.dtype == np.float32 and ours.shape == (256, 32)
    np.testing.assert_array_equal(ours, mlx_decode(packed, scales))
    np.testing.assert_array_equal(ours, mlx_decode(packed, scales, dtype=None))  # MLX's bf16 default output
    # Spot values: scale byte 127 is 2^0, low nibble first; byte 0 is 2^-127; byte 255 decodes to inf.
    np.testing.assert_array_equal(ours[127, :16], GRID + [-v for v in GRID])
    assert ours[0, 1] == np.float32(2.0**-128) and ours[130, 7] == 48.0 and ours[130, 31] == 0.0
    assert np.isnan(ours[255, 0]) and ours[255, 1] == np.inf and ours[255, 9] == -np.inf


def ref_scale_byte(group: np.ndarray) -> int:
    amax = float(np.abs(group).max())
    if amax == 0:
        return 127
    return min(max(math.floor(math.log2(amax)) - 2 + 127, 0), 254)


def ref_nearest(x: float, scale_byte: int) -> float:
    """Nearest value of the E2M1 grid at this scale; ties go to the even code (the lower of two neighbours' codes
    that is even)."""
    scale = 2.0 ** (scale_byte - 127)
    target = abs(x) / scale
    dists = [abs(target - g) for g in GRID]
    best = min(dists)
    code = [c for c, d in enumerate(dists) if d == best]
    code = code[0] if len(code) == 1 else next(c for c in code if c % 2 == 0)
    return math.copysign(GRID[code] * scale, x)


def special_groups() -> np.ndarray:
    k = 2.0**-3
    ties = [4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5]
    rows = [
        ties + [0.0] * (32 - len(ties)),  # exact midpoints: ties to even
        [7.9, 7.99, -7.5, 6.5, 6.0, 5.5] + [1.0] * 26,  # above 6 saturates
        [0.0] * 32,  # all zero
        [1e-45, -1e-45, 3e-44] + [0.0] * 29,  # subnormal: the scale clamps at 2^-127
        [2.0**-125, -(2.0**-126)] + [2.0**-127] * 30,  # tiny but exactly representable
        [3.0e38, -1.0e38, 1.0, 1e-30] + [2.0e37] * 28,  # huge
        [6.0, -4.0, 3.0, 1.5, 0.5, -0.5, 0.0, -0.0] * 4,  # exactly on the grid
    ]
    g = np.array(rows, dtype=np.float64)
    g[0] *= 1 / k  # ties at a non-unit scale
    return g.astype(np.float32).reshape(1, -1)


def test_pack_rounds_to_nearest_grid_value():
    rng = np.random.default_rng(7)
    # Random groups at scales from 2^-100 to 2^100, plus hand-made groups: ties, saturation, zeros, tiny, huge.
    w = rng.standard_normal((24, 256)) * np.exp2(rng.integers(-100, 100, size=(24, 8))).repeat(32, axis=1)
    w = w.astype(np.float32)
    specials = special_groups()
    for data in (w, specials):
        packed, scales = pack_mxfp4(data)
        assert packed.dtype == np.uint8 and packed.shape == (data.shape[0], data.shape[1] // 2)
        assert scales.dtype == np.uint8 and scales.shape == (data.shape[0], data.shape[1] // 32)
        out = unpack_mxfp4(packed, scales)
        groups = data.reshape(data.shape[0], -1, 32)
        expected_scales = np.array([[ref_scale_byte(g) for g in row] for row in groups], dtype=np.uint8)
        np.testing.assert_array_equal(scales, expected_scales)
        expected = np.array(
            [[ref_nearest(float(x), int(s)) for x, s in zip(row, np.repeat(srow, 32))] for row, srow in
             zip(data, scales)],  # fmt: skip
            dtype=np.float32,
        )
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(out, mlx_decode(packed, scales))

    out = unpack_mxfp4(*pack_mxfp4(specials)).reshape(-1, 32)
    np.testing.assert_array_equal(out[0, :15] * 2.0**-3, [4, 0, 1, 1, 2, 2, 4, 4, -0, -1, -1, -2, -2, -4, -4])
    np.testing.assert_array_equal(out[1, :6], [6, 6, -6, 6, 6, 6])
    assert not out[2].any() and pack_mxfp4(specials)[1][0, 2] == 127
    assert not out[3].any() and pack_mxfp4(specials)[1][0, 3] == 0
    np.testing.assert_array_equal(out[4], specials.reshape(-1, 32)[4])  # representable values survive exactly
    np.testing.assert_array_equal(out[6], specials.reshape(-1, 32)[6])
    assert out[5, 0] == np.float32(6 * 2.0**125) and pack_mxfp4(specials)[1][0, 5] == 252


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="divisible by 32"):
        unpack_mxfp4(np.zeros((2, 24), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="scales shape"):
        unpack_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="inf or nan"):
        pack_mxfp4(np.full((1, 32), np.inf, np.float32))

"""mxfp4 packer and decoder: byte-exact against compressed-tensors' packer (a fixture it wrote), bit-exact against MLX's
decoder, and round-to-nearest against a brute-force reference."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4

DATA = Path(__file__).resolve().parent / "data"
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
    """compressed-tensors' scale: the group max rounded to a power of two p (up when max >= 1.75 p), then
    p / 4 (E2M1's largest exponent is 2) as a biased exponent, clipped at 0; an all-zero group gets 0."""
    amax = float(np.abs(group).max())
    if amax == 0:
        return 0
    e = math.floor(math.log2(amax))
    e += (2.0**e > amax) * -1 + (2.0 ** (e + 1) <= amax)  # log2 may round across a power of two
    if amax >= 1.75 * 2.0**e:
        e += 1
    return max(e - 2 + 127, 0)


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
        [6.9, 6.99, -6.5, 6.25, 6.0, 5.5] + [1.0] * 26,  # a max in (6, 7) saturates at 6
        [0.0] * 32,  # all zero
        [1e-45, -1e-45, 3e-44] + [0.0] * 29,  # subnormal: the scale clamps at 2^-127
        [2.0**-125, -(2.0**-126)] + [2.0**-127] * 30,  # tiny but exactly representable
        [2.9e38, -1.0e38, 1.0, 1e-30] + [2.0e37] * 28,  # huge (below 1.75 * 2^127)
        [6.0, -4.0, 3.0, 1.5, 0.5, -0.5, 0.0, -0.0] * 4,  # exactly on the grid
        [7.0, -7.9, 3.5, 2.9, -0.5, 0.25] + [0.0] * 26,  # a max from 7 up: the scale rounds up to 2^1
    ]
    g = np.array(rows, dtype=np.float64)
    g[0] *= 1 / k  # ties at a non-unit scale
    return g.astype(np.float32).reshape(1, -1)


def codes(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


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
        # The sign bit is set exactly for the values below zero (-0.0 has none, -1e-45 rounded to 0 keeps it).
        np.testing.assert_array_equal(codes(packed) >> 3, data < 0)

    packed, scales = pack_mxfp4(specials)
    out = unpack_mxfp4(packed, scales).reshape(-1, 32)
    np.testing.assert_array_equal(out[0, :15] * 2.0**-3, [4, 0, 1, 1, 2, 2, 4, 4, -0, -1, -1, -2, -2, -4, -4])
    np.testing.assert_array_equal(out[1, :6], [6, 6, -6, 6, 6, 6])
    assert not out[2].any() and scales[0, 2] == 0
    assert not out[3].any() and scales[0, 3] == 0
    np.testing.assert_array_equal(out[4], specials.reshape(-1, 32)[4])  # representable values survive exactly
    np.testing.assert_array_equal(out[6], specials.reshape(-1, 32)[6])
    assert out[5, 0] == np.float32(6 * 2.0**125) and scales[0, 5] == 252
    assert scales[0, 7] == 128 and list(out[7, :6]) == [8, -8, 4, 3, -0.0, 0]


def test_matches_compressed_tensors():
    """Byte for byte what compressed-tensors 0.20 wrote for the same matrices (scripts/ct_mxfp4_fixture.py)."""
    f = np.load(DATA / "compressed_tensors_mxfp4.npz")
    offsets = np.cumsum([0] + [r * c for r, c in f["shapes"]])
    differs_from_floor = 0
    for name, (rows, cols), bf16, lo, hi in zip(f["names"], f["shapes"], f["bf16"], offsets[:-1], offsets[1:]):
        w = f["weight"][lo:hi].reshape(rows, cols)
        want_packed = f["weight_packed"][lo // 2 : hi // 2].reshape(rows, cols // 2)
        want_scales = f["weight_scale"][lo // 32 : hi // 32].reshape(rows, cols // 32)
        packed, scales = pack_mxfp4(w)
        np.testing.assert_array_equal(scales, want_scales, err_msg=str(name))
        np.testing.assert_array_equal(packed, want_packed, err_msg=str(name))
        np.testing.assert_array_equal(unpack_mxfp4(packed, scales), mlx_decode(packed, scales))
        amax = np.abs(w.reshape(rows, -1, 32)).max(-1)
        floor_rule = np.where(amax > 0, np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1))) + 125, 0, 254), 127)
        differs_from_floor += int((floor_rule != scales).sum())
    assert offsets[-1] == f["weight"].size and set(f["names"]) >= {"gaussian", "zeros", "grid_and_ties"}
    assert f["bf16"].any()
    assert differs_from_floor > 20  # the fixture tells the rule from the OCP floor rule


def test_scale_rule_on_a_gaussian():
    """On Gaussian weights the round-up of the scale hits the groups whose max has a mantissa of 1.75 or more:
    about log2(8/7) = 19% of them."""
    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    _, scales = pack_mxfp4(w)
    amax = np.abs(w.reshape(512, -1, 32)).max(-1)
    floor_rule = np.floor(np.log2(amax)) + 125
    up = scales != floor_rule
    np.testing.assert_array_equal(scales[up], floor_rule[up] + 1)
    mantissa = amax / np.exp2(np.floor(np.log2(amax)))
    np.testing.assert_array_equal(up, mantissa >= 1.75)
    assert 0.15 < up.mean() < 0.25


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="divisible by 32"):
        unpack_mxfp4(np.zeros((2, 24), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="scales shape"):
        unpack_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="inf or nan"):
        pack_mxfp4(np.full((1, 32), np.inf, np.float32))
    # compressed-tensors' scale overflows to inf from a group max of 1.75 * 2^127 (it then writes zeros).
    pack_mxfp4(np.full((1, 32), np.nextafter(np.float32(1.75 * 2.0**127), np.float32(0))))
    with pytest.raises(ValueError, match="cannot scale"):
        pack_mxfp4(np.full((1, 32), 1.75 * 2.0**127, np.float32))

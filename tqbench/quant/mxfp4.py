"""mxfp4 as compressed-tensors stores it (`mxfp4-pack-quantized`), packed and decoded exactly in numpy.

Per row, every 32 consecutive weights share one E8M0 scale byte s (value 2^(s-127)); each weight is an E2M1 4-bit
code (sign, 2 exponent bits, 1 mantissa bit), two per byte with the LOW nibble holding the even column. No zero point.

`pack_mxfp4` writes the bytes compressed-tensors (0.20) writes for the same float32 or bf16 weights (checked against
the library in tests/test_mxfp4.py). Its scale rule differs from the OCP MX spec's floor(log2(amax)) - 2: the group's
largest magnitude is first rounded to a power of two, UP when its mantissa is 1.75 or more (so 7 * 2^k gets the
scale 2^(k-1), where the spec's scale would clip it to 6), and an all-zero group gets the byte 0, not 127.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
# E2M1 magnitudes of codes 0..7; codes 8..15 are the same values negated.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
LUT = np.concatenate([E2M1, -E2M1])
_MIDS = (E2M1[1:] + E2M1[:-1]) / 2  # decision points between neighbouring codes
_TIES_UP = _MIDS[1::2]  # midpoints whose upper neighbour has the even code: 0.75, 1.75, 3.5
ZERO_GROUP_SCALE = 0  # the scale byte of an all-zero group (2^-127)
# A group max from here up rounds to 2^128, which float32 cannot hold: compressed-tensors' scale becomes inf there.
MAX_GROUP_AMAX = np.float32(1.75 * 2.0**127)


def _check_cols(cols: int) -> None:
    if cols % GROUP:
        raise ValueError(f"mxfp4 needs a column count divisible by {GROUP}, got {cols}")


def scale_bytes(amax: np.ndarray) -> np.ndarray:
    """The E8M0 scale byte of groups with largest magnitude `amax` (float32), by compressed-tensors' rule:
    127 + log2(amax rounded to a power of two, up from a mantissa of 1.75) - 2, clipped at 0; 0 for amax == 0."""
    amax = np.asarray(amax, dtype=np.float32)
    m, e = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): the mantissa is 2m, its exponent e - 1
    exponent = e.astype(np.int32) - 1 + (m >= 0.875)
    return np.where(amax == 0, ZERO_GROUP_SCALE, np.clip(exponent - 2 + 127, 0, 255)).astype(np.uint8)


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., cols] -> (packed uint8 [..., cols/2], scales uint8 [..., cols/32]), byte for byte as
    compressed-tensors packs the same weights."""
    w = np.asarray(w, dtype=np.float32)
    _check_cols(w.shape[-1])
    if not np.isfinite(w).all():
        raise ValueError("mxfp4 cannot represent inf or nan weights")
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(axis=-1)
    if (amax >= MAX_GROUP_AMAX).any():
        raise ValueError(f"mxfp4 cannot scale a group whose largest magnitude is {MAX_GROUP_AMAX:.4g} or more")
    scales = scale_bytes(amax)
    # Exact division by a power of two; clip to 6 (the largest E2M1 magnitude) and round to the nearest magnitude,
    # ties to the even code. Values below zero keep their sign bit even when they round to 0; -0.0 does not.
    a = np.abs(np.ldexp(g, 127 - scales.astype(np.int32)[..., None]))
    code = np.zeros(a.shape, np.uint8)
    for m in _MIDS:
        code += a > m
    for m in _TIES_UP:
        code += a == m
    code |= (g < 0).astype(np.uint8) << 3
    code = code.reshape(w.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(np.uint8), scales


def unpack_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(packed uint8 [..., cols/2], scales uint8 [..., cols/32]) -> float32 [..., cols], exactly as MLX decodes it."""
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    cols = packed.shape[-1] * 2
    _check_cols(cols)
    if scales.shape != (*packed.shape[:-1], cols // GROUP):
        raise ValueError(f"scales shape {scales.shape} does not fit packed shape {packed.shape}")
    code = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1, GROUP)
    with np.errstate(over="ignore", invalid="ignore"):
        # Scale byte 255 decodes to 2^128 = inf (MLX does the same), so 0 * inf gives nan there.
        scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
        out = LUT[code] * scale[..., None]
    return out.reshape(*packed.shape[:-1], cols)

"""mxfp4 as compressed-tensors stores it (`mxfp4-pack-quantized`), packed and decoded exactly in numpy.

Per row, every 32 consecutive weights share one E8M0 scale byte s (value 2^(s-127)); each weight is an E2M1 4-bit
code (sign, 2 exponent bits, 1 mantissa bit), two per byte with the LOW nibble holding the even column. No zero point.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
# E2M1 magnitudes of codes 0..7; codes 8..15 are the same values negated.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
LUT = np.concatenate([E2M1, -E2M1])
_MIDS = (E2M1[1:] + E2M1[:-1]) / 2  # decision points between neighbouring codes
_TIES_UP = _MIDS[1::2]  # midpoints whose upper neighbour has the even code: 0.75, 1.75, 3.5
ZERO_GROUP_SCALE = 127  # the scale byte given to an all-zero group (2^0)


def _check_cols(cols: int) -> None:
    if cols % GROUP:
        raise ValueError(f"mxfp4 needs a column count divisible by {GROUP}, got {cols}")


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., cols] -> (packed uint8 [..., cols/2], scales uint8 [..., cols/32]) following the OCP MX spec."""
    w = np.asarray(w, dtype=np.float32)
    _check_cols(w.shape[-1])
    if not np.isfinite(w).all():
        raise ValueError("mxfp4 cannot represent inf or nan weights")
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(axis=-1)
    # Shared exponent = floor(log2(amax)) - 2 (E2M1's emax); frexp gives amax = m * 2^e with m in [0.5, 1).
    _, e = np.frexp(amax)
    shared = np.clip(e.astype(np.int32) - 3, -127, 127)
    shared = np.where(amax == 0, ZERO_GROUP_SCALE - 127, shared)
    # Exact division by a power of two, then round to the nearest E2M1 magnitude, ties to the even code.
    a = np.abs(np.ldexp(g, -shared[..., None]))
    code = np.zeros(a.shape, np.uint8)
    for m in _MIDS:
        code += a > m
    for m in _TIES_UP:
        code += a == m
    code |= np.signbit(g).astype(np.uint8) << 3
    code = code.reshape(w.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(np.uint8), (shared + 127).astype(np.uint8)


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

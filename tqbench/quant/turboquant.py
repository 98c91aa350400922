"""TurboQuant ("polar") weight quantization, in MLX.

For a Linear weight W (out, in): rotate each row with a seeded randomized Hadamard transform, scale each group of g
rotated columns by its RMS (fp16, no zero point), round value/scale to a Lloyd-Max codebook for N(0, 1) and pack the
codes into uint32 words, LSB first. At inference the input is rotated the same way, so W_rot x_rot == W x.
See shared/reference/turboquant-recipes.md. The codebook length says the packing: 2^b levels -> b-bit codes,
floor(32/b) per word; 3 levels (ternary) -> base-3 digits, 20 per word.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from tqbench.quant import packing

# Lloyd-Max reconstruction levels for N(0, 1), ascending; boundaries are the midpoints.
CODEBOOKS: dict[str, tuple[float, ...]] = {
    "2": (-1.5104, -0.4528, 0.4528, 1.5104),
    "3": (-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519),
    "4": (-2.7333, -2.0698, -1.6189, -1.2570, -0.9430, -0.6573, -0.3884, -0.1285,
          0.1285, 0.3884, 0.6573, 0.9430, 1.2570, 1.6189, 2.0698, 2.7333),
    "T": (-1.2240, 0.0, 1.2240),  # ternary
}
# Mean squared error of each codebook on N(0, 1), as published.
CODEBOOK_MSE = {"2": 0.1175, "3": 0.0345, "4": 0.0095, "T": 0.190}

BASE_SEED = 42
HADAMARD_FACTORS = (1, 12, 20, 28)  # mx.hadamard_transform handles n = m * 2^k for these m
MIN_SCALE = 1e-7


def codebook(kind: str) -> np.ndarray:
    """The codebook as float16, the dtype it is stored in."""
    return np.asarray(CODEBOOKS[kind], dtype=np.float16)


def codes_per_word(levels: int) -> int:
    """How many codes of a codebook with `levels` entries one uint32 word holds: 20 trits, or floor(32 / bits)."""
    return packing.codes_per_word(int(math.log2(levels)), ternary=levels == 3)


def hadamard_ok(n: int) -> bool:
    """Whether mx.hadamard_transform supports length n (it crashes on others, so always check first)."""
    for m in HADAMARD_FACTORS:
        if n > 0 and n % m == 0 and (q := n // m) & (q - 1) == 0:
            return True
    return False


def layer_seed(path: str, base: int = BASE_SEED) -> int:
    """Per-layer rotation seed, stable across processes (never Python's salted hash())."""
    return base + zlib.crc32(path.encode())


def rotation_signs(path: str, n: int, base: int = BASE_SEED) -> np.ndarray:
    """The +-1 signs of the randomized Hadamard rotation of a layer, as float16."""
    rng = np.random.default_rng(layer_seed(path, base))
    return (rng.integers(0, 2, n, dtype=np.int8) * 2 - 1).astype(np.float16)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """x_rot = H(x * s) / sqrt(n) along the last axis (an orthogonal map)."""
    n = x.shape[-1]
    if not hadamard_ok(n):
        raise ValueError(f"no Hadamard transform of length {n} (need m * 2^k with m in {HADAMARD_FACTORS})")
    return mx.hadamard_transform(x.astype(mx.float32) * signs.astype(mx.float32), scale=1 / math.sqrt(n))


@lru_cache(maxsize=4)
def _hadamard_matrix(n: int) -> mx.array:
    """M with rotate-without-signs(x) == x @ M; M is orthogonal but not symmetric for m = 20 or 28."""
    m = mx.hadamard_transform(mx.eye(n), scale=1 / math.sqrt(n))
    mx.eval(m)
    return m


def unrotate(x_rot: mx.array, signs: mx.array) -> mx.array:
    """The inverse of rotate: x = (x_rot @ M^T) * s."""
    return (x_rot @ _hadamard_matrix(x_rot.shape[-1]).T) * signs.astype(mx.float32)


def pack(codes: mx.array, levels: int) -> mx.array:
    """Pack integer codes (..., n) in [0, levels) into uint32 words (..., ceil(n / per_word)), LSB first."""
    per = codes_per_word(levels)
    n = codes.shape[-1]
    words = -(-n // per)
    codes = codes.astype(mx.uint32)
    if words * per != n:
        codes = mx.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, words * per - n)])
    codes = codes.reshape(*codes.shape[:-1], words, per)
    if levels == 3:
        weights = mx.array([3**i for i in range(per)], dtype=mx.uint32)
    else:
        weights = mx.array([1 << (int(math.log2(levels)) * i) for i in range(per)], dtype=mx.uint32)
    return (codes * weights).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, levels: int, n: int) -> mx.array:
    """The inverse of pack: uint32 words -> codes (..., n) as uint32."""
    per = codes_per_word(levels)
    w = words[..., None]
    if levels == 3:
        codes = (w // mx.array([3**i for i in range(per)], dtype=mx.uint32)) % 3
    else:
        bits = int(math.log2(levels))
        codes = (w >> mx.array([bits * i for i in range(per)], dtype=mx.uint32)) & (levels - 1)
    return codes.reshape(*words.shape[:-1], -1)[..., :n]


@dataclass(frozen=True)
class Quantized:
    """One TurboQuant Linear: evaluated arrays, ready to write."""

    weight: mx.array  # uint32 (..., out, ceil(in / per_word))
    scales: mx.array  # float16 (..., out, in / g)
    rel_error: float  # ||W - W_hat|| / ||W||, measured in the rotated domain (the rotation is orthogonal)


@lru_cache(maxsize=16)
def _quantizer(kind: str, group: int):
    """A compiled (fused) kernel: rotated rows -> codes, fp16 group scales, squared error and squared norm.

    The code of a value is the number of codebook boundaries below it, and its reconstruction is the first level
    plus the steps it passed: elementwise work only, which MLX fuses into one pass over the weights.
    """
    book = [float(v) for v in codebook(kind).astype(np.float32)]
    bounds = [(a + b) / 2 for a, b in zip(book, book[1:])]
    steps = [b - a for a, b in zip(book, book[1:])]

    def run(x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        scales = mx.maximum(mx.sqrt(mx.mean(g * g, axis=-1, keepdims=True)), MIN_SCALE).astype(mx.float16)
        s32 = scales.astype(mx.float32)
        v = g / s32
        codes = mx.zeros(v.shape, dtype=mx.uint32)
        recon = mx.full(v.shape, book[0], dtype=mx.float32)
        for b, step in zip(bounds, steps):
            above = v > b
            codes = codes + above.astype(mx.uint32)
            recon = recon + mx.where(above, step, 0.0)
        err = mx.sum((recon * s32 - g) ** 2)
        return codes.reshape(x.shape), scales.squeeze(-1), err, mx.sum(g * g)

    return mx.compile(run)


def quantize(w: mx.array, kind: str, group: int, signs: mx.array | None) -> Quantized:
    """Quantize w (..., out, in); `signs` None means no rotation."""
    n = w.shape[-1]
    if n % group:
        raise ValueError(f"in dimension {n} is not a multiple of the group size {group}")
    x = rotate(w, signs) if signs is not None else w.astype(mx.float32)
    codes, scales, err, norm = _quantizer(kind, group)(x)
    packed = pack(codes, len(CODEBOOKS[kind]))
    rel = mx.sqrt(err / mx.maximum(norm, 1e-30))
    mx.eval(packed, scales, rel)
    return Quantized(packed, scales, rel.item())


def dequantize(weight: mx.array, scales: mx.array, book: mx.array, signs: mx.array | None, n: int) -> mx.array:
    """Float32 W_hat (..., out, n) from stored tensors; un-rotates when `signs` is given."""
    codes = unpack(weight, book.shape[0], n)
    group = n // scales.shape[-1]
    vals = book.astype(mx.float32)[codes].reshape(*codes.shape[:-1], n // group, group)
    x = (vals * scales.astype(mx.float32)[..., None]).reshape(*codes.shape[:-1], n)
    return unrotate(x, signs) if signs is not None else x

"""TurboQuant ("polar") weight quantization, in MLX.

For a Linear weight W (out, in): rotate each row with a seeded randomized Hadamard transform, scale each group of g
rotated columns by its RMS (fp16, no zero point), round value/scale to a Lloyd-Max codebook for N(0, 1) and pack the
codes into uint32 words, LSB first. At inference the input is rotated the same way, so W_rot x_rot == W x.
The format is described in docs/turboquant.md.

- Rotation: x_rot = H_b(x * s) with H_b the Hadamard transform of length b scaled by 1/sqrt(b), applied to each block of
  b consecutive columns after the +-1 signs s (one per column). b = rotation_block(n): n itself when
  mx.hadamard_transform supports n (m * 2^k, m in 1, 12, 20, 28), otherwise the largest such length dividing n
  ("blockwise", as TurboQuant-MLX does: K3's 33,792-wide dense down_proj rotates in 11 blocks of 3072 = 12 * 2^8,
  not 33 blocks of 1024). Blocks shorter than MIN_BLOCK are refused: rotate, unrotate, quantize and dequantize raise
  the same ValueError for such lengths.
- Codes: the code of a value v is the number of boundaries b with v >= b (boundaries are the midpoints of the
  full-precision published levels, in float32), so a value exactly on a boundary takes the UPPER code, as in
  TurboQuant-MLX. Levels are stored as float16; reconstruction uses the stored float16 levels.
- Packing: the codebook length says it: 2^b levels -> b-bit codes, floor(32/b) per word; 3 levels (ternary) -> base-3
  digits, 20 per word.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import mlx.core as mx
import numpy as np

from tqbench.errors import TqbenchError
from tqbench.managed import on_cuda
from tqbench.quant import cuda_quantizer, packing

# Lloyd-Max reconstruction levels for N(0, 1), ascending, as TurboQuant-MLX publishes them (they are up to 8e-4 away
# from the exact optimum; matching them matters more). Stored as float16: the 4-decimal roundings give the very same
# float16 codebook, but not the same boundaries, which are the midpoints of these full-precision values (in float32),
# so codes agree with the seed's. The ternary level is published only as ~1.2240.
CODEBOOKS: dict[str, tuple[float, ...]] = {
    "2": (-1.5104174569, -0.4527799975, 0.4527799975, 1.5104174569),
    "3": (-2.1519452850, -1.3439090860, -0.7560051861, -0.2450941497,
          0.2450941497, 0.7560051861, 1.3439090860, 2.1519452850),
    "4": (-2.7332986608, -2.0698191883, -1.6188648437, -1.2570025732,
          -0.9430078288, -0.6572738605, -0.3883729570, -0.1285059463,
          0.1285059463, 0.3883729570, 0.6572738605, 0.9430078288,
          1.2570025732, 1.6188648437, 2.0698191883, 2.7332986608),
    "T": (-1.2240, 0.0, 1.2240),  # ternary
}
# Mean squared error of each codebook on N(0, 1), as published.
CODEBOOK_MSE = {"2": 0.1175, "3": 0.0345, "4": 0.0095, "T": 0.190}

# How a group's scale is chosen. "rms": the root mean square of its values (TurboQuant-MLX's rule, right for a
# Gaussian). "search": the scale among SEARCH_MULTIPLIERS x RMS (float16, as stored) with the least squared error for
# that group; the RMS itself is a candidate and wins ties, so no group gets worse. Decoding is the same for both.
SCALE_RULES = ("search", "rms")
SEARCH_MULTIPLIERS = tuple(round(0.6 + 0.05 * i, 2) for i in range(16))  # 0.60 .. 1.35
SEARCH_AT_ONCE = 1 << 20  # weights a matrix may have for every candidate to be tried in one graph (16x its floats)

BASE_SEED = 42
HADAMARD_FACTORS = (1, 12, 20, 28)  # mx.hadamard_transform handles n = m * 2^k for these m
MIN_SCALE = 1e-7
# The shortest block a blockwise rotation may use. A shorter one barely mixes (a block of 1 is sign flips only), and no
# quantizable Linear needs one: groups are 32, 64 or 128 columns and must divide the input length, so 32 always does.
MIN_BLOCK = 32


def codebook(kind: str) -> np.ndarray:
    """The codebook as float16, the dtype it is stored in."""
    return np.asarray(CODEBOOKS[kind], dtype=np.float16)


def boundaries(kind: str) -> np.ndarray:
    """The decision boundaries of a codebook as float32: midpoints of its full-precision levels, ascending."""
    levels = np.asarray(CODEBOOKS[kind], dtype=np.float64)
    return ((levels[1:] + levels[:-1]) / 2).astype(np.float32)


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


def rotation_block(n: int) -> int | None:
    """The length of the Hadamard blocks a rotation of length n uses: n itself when hadamard_ok(n), else the largest
    m * 2^k (m in HADAMARD_FACTORS) dividing n, or None when that is shorter than MIN_BLOCK (n can't be rotated)."""
    if hadamard_ok(n):
        return n
    best = 0
    for m in HADAMARD_FACTORS:
        b = m
        while 0 < b <= n:
            if n % b == 0:
                best = max(best, b)
            b *= 2
    return best if best >= MIN_BLOCK else None


def rotation_record(n: int, rotated: bool) -> dict:
    """How a module of input length n is rotated, for config records: {"kind": "hadamard" (one transform of length
    n) | "blockwise-hadamard" (n / block transforms) | "none", "block": the transform length or None}. Raises the
    rotation's ValueError when `rotated` and n can't be rotated."""
    if not rotated:
        return {"kind": "none", "block": None}
    b = _block(n)
    return {"kind": "hadamard" if b == n else "blockwise-hadamard", "block": b}


def _block(n: int) -> int:
    """rotation_block(n), or the one ValueError every rotating function raises for a length it can't rotate."""
    b = rotation_block(n)
    if b is None:
        raise ValueError(f"no Hadamard rotation of length {n}: no block m * 2^k >= {MIN_BLOCK} "
                         f"(m in {HADAMARD_FACTORS}) divides it")
    return b


def _check_signs(signs: mx.array, n: int) -> None:
    if signs.shape != (n,):
        raise ValueError(f"rotation signs have shape {tuple(signs.shape)}, expected ({n},)")


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """x_rot = H_b(x * s) / sqrt(b) along the last axis, per block of b = rotation_block(n) columns (orthogonal)."""
    n = x.shape[-1]
    b = _block(n)
    _check_signs(signs, n)
    y = x.astype(mx.float32) * signs.astype(mx.float32)
    if b == n:
        return mx.hadamard_transform(y, scale=1 / math.sqrt(n))
    blocks = y.reshape(*y.shape[:-1], n // b, b)
    return mx.hadamard_transform(blocks, scale=1 / math.sqrt(b)).reshape(y.shape)


def _factors(b: int) -> tuple[int, int]:
    """(m, 2^k) with b = m * 2^k, m in HADAMARD_FACTORS."""
    for m in reversed(HADAMARD_FACTORS):
        if b % m == 0 and (q := b // m) & (q - 1) == 0:
            return m, q
    raise ValueError(f"no Hadamard transform of length {b}")


@lru_cache(maxsize=None)
def _factor_matrix(m: int) -> np.ndarray:
    """A (m, m) with mx.hadamard_transform(x, scale=1/sqrt(m)) == x @ A; not symmetric for m = 20 or 28."""
    return np.array(mx.hadamard_transform(mx.eye(m), scale=1 / math.sqrt(m)))


def unrotate(x_rot: mx.array, signs: mx.array) -> mx.array:
    """The inverse of rotate (float32), per block of b = rotation_block(n) columns.

    mx.hadamard_transform of length b = m * 2^k is x -> x @ kron(A, S) / sqrt(b), with A the (m, m) factor matrix and
    S the symmetric Sylvester matrix of 2^k. Its inverse is the transpose: viewing a block as X (m, 2^k), rotate
    computes A^T X S / sqrt(b), so X = A Y S / sqrt(b): the power-of-two transform along the last axis, then A.
    """
    n = x_rot.shape[-1]
    b = _block(n)
    _check_signs(signs, n)
    m, p = _factors(b)
    lead = x_rot.shape[:-1]
    y = x_rot.astype(mx.float32).reshape(*lead, n // b, m, p)
    if p > 1:
        y = mx.hadamard_transform(y, scale=1 / math.sqrt(p))
    if m > 1:
        y = mx.array(_factor_matrix(m)) @ y
    return y.reshape(*lead, n) * signs.astype(mx.float32)


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


@dataclass(frozen=True, kw_only=True)
class Quantized:
    """One TurboQuant Linear: evaluated arrays, ready to write."""

    weight: mx.array  # uint32 (..., out, ceil(in / per_word))
    scales: mx.array  # float16 (..., out, in / g)
    rel_error: float  # ||W - W_hat|| / ||W||, measured in the rotated domain (the rotation is orthogonal)


QUANTIZER_KERNELS = ("compiled", "passes", "compare", "cuda")


def available_quantizer_kernels() -> tuple[str, ...]:
    """QUANTIZER_KERNELS that run on the default device (`cuda` needs MLX's CUDA build, a GPU, and an MLX that
    launches precompiled CUDA kernels)."""
    cuda = on_cuda() and hasattr(mx.fast, "precompiled_cuda_kernel")
    return QUANTIZER_KERNELS if cuda else tuple(k for k in QUANTIZER_KERNELS if k != "cuda")


@lru_cache(maxsize=32)
def _quantizer(kind: str, group: int, kernel: str = "compiled", rule: str = "rms"):
    """Rotated rows -> packed codes, fp16 group scales, squared error and squared norm, by one of QUANTIZER_KERNELS.

    The code of a value is the number of codebook boundaries at or below it (a tie takes the upper code). `compiled`
    and `passes` reconstruct it as the first stored level plus the steps it passed: elementwise work only, which
    mx.compile fuses into one pass over the weights (`compiled`); unfused (`passes`), the same graph runs as MLX's
    prebuilt kernels, five passes per boundary. `compare` counts the boundaries with one broadcast comparison and a
    sum, and looks the level up: a handful of prebuilt kernels whatever the codebook, nothing compiled at run time.
    `cuda` is one hand-written kernel that also packs (tqbench.quant.cuda_quantizer), after MLX's kernels compute
    the scales. All give the same codes and scales; the error differs in the last bits (summed in another order).
    """
    if kernel not in QUANTIZER_KERNELS:
        raise ValueError(f"unknown quantizer kernel {kernel!r} (one of {', '.join(QUANTIZER_KERNELS)})")
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r} (one of {', '.join(SCALE_RULES)})")
    if kernel == "cuda" and "cuda" not in available_quantizer_kernels():
        raise ValueError("the cuda quantizer kernel needs MLX's CUDA build and a GPU as the default device")
    book = [float(v) for v in codebook(kind).astype(np.float32)]
    bounds = [float(v) for v in boundaries(kind)]
    searched = _scale_search(book, bounds, group, kernel)
    codes_of = _coder(book, bounds, group, kernel)

    def packed(x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        # rms: the scales are computed inside the kernel's graph; search: chosen first, then given to it
        out = codes_of(x, searched(x)) if rule == "search" else codes_of(x)
        if kernel == "cuda":
            return out
        codes, scales, err, norm = out
        return pack(codes, len(book)), scales, err, norm

    return packed


def _grouped(x: mx.array, group: int) -> tuple[mx.array, mx.array]:
    """Rows in groups of `group` values (..., groups, group), and each group's RMS (at least MIN_SCALE)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return g, mx.maximum(mx.sqrt(mx.mean(g * g, axis=-1, keepdims=True)), MIN_SCALE)


def _scale_search(book: list[float], bounds: list[float], group: int, kernel: str) -> Callable[[mx.array], mx.array]:
    """The search rule's scales of rotated rows, float16 (..., groups, 1): per group, the candidate scale
    (SEARCH_MULTIPLIERS x its RMS) with the least squared error, by `kernel`."""
    steps = [b - a for a, b in zip(book, book[1:])]

    def group_error(g: mx.array, s32: mx.array) -> mx.array:
        """Each group's squared error with scales s32 (the codes as `_coder` computes them)."""
        v = g / s32
        recon = mx.full(v.shape, book[0], dtype=mx.float32)
        for b, step in zip(bounds, steps):
            recon = recon + mx.where(v >= b, step, 0.0)
        return mx.sum((recon * s32 - g) ** 2, axis=-1, keepdims=True)

    order = (1.0, *(m for m in SEARCH_MULTIPLIERS if m != 1.0))  # the RMS first: it keeps ties

    def candidates_of(rms: mx.array, mults) -> mx.array:
        return mx.maximum(rms * mults, MIN_SCALE).astype(mx.float16)

    def best_at_once(g: mx.array, rms: mx.array) -> mx.array:
        """Every candidate in one graph: (..., groups, candidates, group) values, for matrices up to SEARCH_AT_ONCE."""
        cands = candidates_of(rms, mx.array(order, dtype=mx.float32))  # (..., groups, candidates)
        err = group_error(mx.expand_dims(g, -2), cands.astype(mx.float32)[..., None]).squeeze(-1)
        pick = mx.argmin(err, axis=-1, keepdims=True)  # the first of equal errors
        return mx.take_along_axis(cands, pick, axis=-1)

    def best_in_turn(g: mx.array, rms: mx.array) -> mx.array:
        """One candidate at a time, each evaluated before the next (bounded memory for large matrices)."""
        scales = candidates_of(rms, order[0])
        best = group_error(g, scales.astype(mx.float32))
        for m in order[1:]:
            candidate = candidates_of(rms, m)
            err = group_error(g, candidate.astype(mx.float32))
            better = err < best
            best, scales = mx.where(better, err, best), mx.where(better, candidate, scales)
            mx.eval(best, scales)
        return scales

    # Calls, not arithmetic, cost most on small matrices (a demo expert is 2,048 values): all candidates in one graph
    # (one fused kernel when compiled) up to SEARCH_AT_ONCE values, then one candidate at a time.
    at_once = mx.compile(best_at_once) if kernel == "compiled" else best_at_once

    def searched(x: mx.array) -> mx.array:
        """float16 scales (..., groups, 1) by the search rule."""
        g, rms = _grouped(x, group)
        if kernel == "cuda":  # one kernel, every candidate: MLX's operations would take ~45 launches each
            return cuda_quantizer.search_scales(x, rms.squeeze(-1), tuple(book), bounds=tuple(bounds), group=group,
                                                multipliers=SEARCH_MULTIPLIERS, min_scale=MIN_SCALE)[..., None]
        return at_once(g, rms) if x.size <= SEARCH_AT_ONCE else best_in_turn(g, rms)

    return searched


@lru_cache(maxsize=32)
def _searcher(kind: str, group: int, kernel: str) -> Callable[[mx.array], mx.array]:
    book = [float(v) for v in codebook(kind).astype(np.float32)]
    return _scale_search(book, [float(v) for v in boundaries(kind)], group, kernel)


def group_scales(x: mx.array, kind: str, group: int, rule: str = "search", kernel: str | None = None) -> mx.array:
    """The float16 scales (..., in / group) that `rule` gives rotated rows x: exactly what quantize stores for them.
    (tqbench.quant.calibrate chooses a group's scale with it before choosing the group's codes.)"""
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r} (one of {', '.join(SCALE_RULES)})")
    x = x.astype(mx.float32)
    if rule == "rms":
        return _grouped(x, group)[1].squeeze(-1).astype(mx.float16)
    return _searcher(kind, group, kernel or quantizer_kernel())(x).squeeze(-1)


def _coder(book: list[float], bounds: list[float], group: int, kernel: str) -> Callable[..., tuple]:
    """Rotated rows (and float16 scales, or None for their RMS, computed in the same graph) -> codes (for `cuda`
    packed words), float16 scales, squared error and squared norm, by `kernel`."""
    steps = [b - a for a, b in zip(book, book[1:])]

    def scaled(x: mx.array, given: mx.array | None) -> tuple[mx.array, mx.array, mx.array]:
        g, rms = _grouped(x, group)
        scales = rms.astype(mx.float16) if given is None else given
        return g, scales, scales.astype(mx.float32)

    def run(x: mx.array, given: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        g, scales, s32 = scaled(x, given)
        v = g / s32
        codes = mx.zeros(v.shape, dtype=mx.uint32)
        recon = mx.full(v.shape, book[0], dtype=mx.float32)
        for b, step in zip(bounds, steps):
            above = v >= b
            codes = codes + above.astype(mx.uint32)
            recon = recon + mx.where(above, step, 0.0)
        err = mx.sum((recon * s32 - g) ** 2)
        return codes.reshape(x.shape), scales.squeeze(-1), err, mx.sum(g * g)

    def run_compare(x: mx.array, given: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        g, scales, s32 = scaled(x, given)
        codes = (mx.expand_dims(g / s32, -1) >= mx.array(bounds, dtype=mx.float32)).sum(-1).astype(mx.uint32)
        recon = mx.array(book, dtype=mx.float32)[codes]
        err = mx.sum((recon * s32 - g) ** 2)
        return codes.reshape(x.shape), scales.squeeze(-1), err, mx.sum(g * g)

    def run_cuda(x: mx.array, given: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        scales = scaled(x, given)[1].squeeze(-1)
        words, err, norm = cuda_quantizer.quantize_rows(x, scales, tuple(book), bounds=tuple(bounds), group=group,
                                                        per=codes_per_word(len(book)))
        return words, scales, err, norm

    return {"cuda": run_cuda, "compare": run_compare, "passes": run, "compiled": mx.compile(run)}[kernel]


def quantizer_kernel() -> str:
    """The quantizer kernel for the default device: `cuda` on CUDA, `compiled` elsewhere; the environment variable
    TQBENCH_QUANTIZER (one of available_quantizer_kernels()) chooses another.

    On CUDA every mx.compile'd graph is compiled at run time into a module of dozens of kernel variants: a K3-shaped
    conversion's first run took 171 s against 3 s warm, ~154 s of it in the quantizer (measured on an H200). The
    `cuda` kernel is one small hand-written kernel per codebook, compiled in well under a second and cached
    (cuda_quantizer). On the CPU (compiling a shape costs ~0.3 s, the fused pass saves ~1 s on each 3072 x 3584
    matrix) and on Metal (fast compiles, bandwidth-bound) the fused `compiled` kernel serves. benchmarks/quantizer.py
    times them all on one K3 expert.
    """
    chosen = os.environ.get("TQBENCH_QUANTIZER")
    if chosen:
        usable = available_quantizer_kernels()
        if chosen not in usable:
            why = " (cuda needs MLX's CUDA build and a GPU)" if chosen in QUANTIZER_KERNELS else ""
            raise TqbenchError(f"TQBENCH_QUANTIZER={chosen!r}: choose one of {', '.join(usable)}{why}")
        return chosen
    if on_cuda():
        return "cuda" if "cuda" in available_quantizer_kernels() else "passes"
    return "compiled"


def quantize(w: mx.array, kind: str, group: int, signs: mx.array | None, kernel: str | None = None,
             rule: str = "rms") -> Quantized:
    """Quantize w (..., out, in); `signs` None means no rotation, else the rotation of rotate(). `rule`: how group
    scales are chosen (SCALE_RULES: "rms", TurboQuant-MLX's, or "search").

    `kernel` None picks one for the device (quantizer_kernel); all give the same codes and scales.
    """
    n = w.shape[-1]
    if signs is not None:
        _block(n)
    if n % group:
        raise ValueError(f"in dimension {n} is not a multiple of the group size {group}")
    x = rotate(w, signs) if signs is not None else w.astype(mx.float32)
    packed, scales, err, norm = _quantizer(kind, group, kernel or quantizer_kernel(), rule)(x)
    rel = mx.sqrt(err / mx.maximum(norm, 1e-30))
    mx.eval(packed, scales, rel)
    return Quantized(weight=packed, scales=scales, rel_error=rel.item())


def dequantize(weight: mx.array, scales: mx.array, book: mx.array, signs: mx.array | None, n: int) -> mx.array:
    """Float32 W_hat (..., out, n) from stored tensors; un-rotates when `signs` is given (the rotation of rotate())."""
    if signs is not None:
        _block(n)
    codes = unpack(weight, book.shape[0], n)
    group = n // scales.shape[-1]
    vals = book.astype(mx.float32)[codes].reshape(*codes.shape[:-1], n // group, group)
    x = (vals * scales.astype(mx.float32)[..., None]).reshape(*codes.shape[:-1], n)
    return unrotate(x, signs) if signs is not None else x

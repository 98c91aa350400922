"""TurboQuant's quantizer as one CUDA kernel: rotated rows and their fp16 group scales -> packed code words and each
word's squared error and squared norm, in one pass over the weights (MLX's prebuilt kernels take several passes per
codebook boundary, and mx.compile's fused graphs compile for minutes on CUDA).

One thread per output word. For each of its values it divides by the group's scale with IEEE division (`__fdiv_rn`,
so the codes do not depend on fast-math flags), counts the boundaries at or below the ratio (a value on a boundary
takes the upper code, as turboquant.py specifies), takes the level with the same comparisons, packs the code (base-3
digits for ternary, b-bit fields otherwise, LSB first, as turboquant.pack) and sums the squared error and norm.
Boundaries and levels are written into the source as exact float32 bit patterns; the rows and their length are
arguments, so one kernel serves every matrix of a codebook and group size.

Compiling: `mx.fast.cuda_kernel` would compile it with MLX's device headers on every process start, which alone made
a small conversion 4x slower; so it is plain CUDA C compiled once per machine (`tqbench.cubin`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from tqbench.cubin import cached_cubin

THREADS = 256
KERNEL = "tq_quantize"


def _f32(v: float) -> str:
    """An exact float32 constant."""
    return f"__int_as_float(0x{int(np.float32(v).view(np.uint32)):08x})"


def kernel_source(book: tuple[float, ...], bounds: tuple[float, ...], group: int, per: int, name: str = KERNEL) -> str:
    """The whole CUDA source of kernel `name` for one codebook (levels `book`, boundaries `bounds`), group size and
    `per` codes a word. Arguments: x (rows, n) float32, scales (rows, n / group) as fp16 bits, then the outputs words (rows,
    ceil(n / per)), err and norm (one float per word), then rows and n."""
    levels = len(book)
    L = [
        f'extern "C" __global__ void {name}(const float* x, const unsigned short* scales, unsigned int* words,',
        "                                   float* err, float* norm, int rows, int n) {",
        "  const unsigned long long gid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;",
        f"  const unsigned int nwords = ((unsigned int)n + {per - 1}u) / {per}u;",
        "  if (gid >= (unsigned long long)rows * nwords) return;",
        "  const unsigned long long row = gid / nwords;",
        "  const unsigned int wd = (unsigned int)(gid % nwords);",
        "  const float* xr = x + row * (unsigned long long)n;",
        f"  const unsigned short* sr = scales + row * (unsigned long long)(n / {group});",
        "  unsigned int word = 0u, pw = 1u;  // pw: 3^i, the weight of the i-th ternary digit",
        "  float e = 0.0f, q2 = 0.0f;",
        "#pragma unroll",
        f"  for (unsigned int i = 0; i < {per}u; ++i) {{",
        f"    const unsigned int j = wd * {per}u + i;",
        "    if (j < (unsigned int)n) {",
        "      const float v = xr[j];",
        "      float s;",
        f'      asm("cvt.f32.f16 %0, %1;" : "=f"(s) : "h"(sr[j / {group}u]));',
        "      const float r = __fdiv_rn(v, s);",
        "      unsigned int c = 0u;",
        f"      float level = {_f32(book[0])};",
    ]
    for b, lv in zip(bounds, book[1:]):
        L.append(f"      if (r >= {_f32(b)}) {{ c += 1u; level = {_f32(lv)}; }}")
    L += ["      const float d = __fmul_rn(level, s) - v;", "      e += d * d;", "      q2 += v * v;"]
    L.append("      word += c * pw;" if levels == 3 else f"      word |= c << ({int(math.log2(levels))}u * i);")
    L.append("    }")
    if levels == 3:
        L.append("    pw *= 3u;")
    L += ["  }", "  words[gid] = word;", "  err[gid] = e;", "  norm[gid] = q2;", "}"]
    return "\n".join(L) + "\n"


@lru_cache(maxsize=16)
def _cubin(book: tuple[float, ...], bounds: tuple[float, ...], group: int, per: int) -> tuple[str, bytes]:
    """(the kernel's name, its cubin): compiled once per machine, then read from tqbench's cache (`tqbench.cubin`)."""
    return cached_cubin(f"{KERNEL}_l{len(book)}_g{group}", lambda name: kernel_source(book, bounds, group, per, name))


def quantize_rows(x: mx.array, scales: mx.array, book: tuple[float, ...], bounds: tuple[float, ...], group: int,
                  per: int) -> tuple[mx.array, mx.array, mx.array]:
    """x (..., n) float32 and its fp16 group scales (..., n / group) -> (uint32 words (..., ceil(n / per)), summed
    squared error, summed squared norm); `book` the float32 levels, `bounds` the boundaries, `per` codes a word."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    rows = math.prod(lead)
    words = -(-n // per)
    total = rows * words
    if total >= 2**31:
        raise ValueError(f"{rows} rows of {n} are too many for one quantizer kernel call")
    name, cubin = _cubin(tuple(book), tuple(bounds), group, per)
    w, e, q = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[x.astype(mx.float32), scales.astype(mx.float16).view(mx.uint16)],
        output_shapes=[(*lead, words), (total,), (total,)], output_dtypes=[mx.uint32, mx.float32, mx.float32],
        scalars=[rows, n], grid=(-(-total // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        ensure_row_contiguous=True)
    return w, mx.sum(e), mx.sum(q)


SEARCH_KERNEL = "tq_search"


def search_source(book: tuple[float, ...], bounds: tuple[float, ...], group: int, multipliers: tuple[float, ...],
                  min_scale: float, name: str = SEARCH_KERNEL) -> str:
    """The CUDA source of the search rule's scale choice (turboquant.SCALE_RULES): one thread per group tries each
    multiplier of the group's RMS (rounded to float16 as MLX rounds, the RMS first so it keeps ties), codes the group
    with it as `kernel_source` does and keeps the candidate with the least squared error. Arguments: x (rows, n)
    float32, rms (rows, n / group) float32, then the output scales (rows, n / group) as fp16 bits, rows and n."""
    order = [1.0] + [m for m in multipliers if m != 1.0]
    L = [
        f'extern "C" __global__ void {name}(const float* x, const float* rms, unsigned short* scales, int rows,',
        "                                   int n) {",
        "  const unsigned long long gid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;",
        f"  const unsigned int groups = (unsigned int)n / {group}u;",
        "  if (gid >= (unsigned long long)rows * groups) return;",
        "  const unsigned long long row = gid / groups;",
        f"  const float* xg = x + row * (unsigned long long)n + (gid % groups) * {group}u;",
        "  const float r = rms[gid];",
        "  float best_e = __int_as_float(0x7f800000);",
        "  unsigned short best = 0;",
        f"  const float ms[{len(order)}] = {{{', '.join(_f32(m) for m in order)}}};",
        f"  for (int k = 0; k < {len(order)}; ++k) {{",
        f"    const float scaled = fmaxf(__fmul_rn(r, ms[k]), {_f32(min_scale)});",
        "    unsigned short h;",
        '    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(scaled));',
        "    float s;",
        '    asm("cvt.f32.f16 %0, %1;" : "=f"(s) : "h"(h));',
        "    float e = 0.0f;",
        f"    for (unsigned int j = 0; j < {group}u; ++j) {{",
        "      const float v = xg[j];",
        "      const float q = __fdiv_rn(v, s);",
        f"      float level = {_f32(book[0])};",
    ]
    for b, lv in zip(bounds, book[1:]):
        L.append(f"      if (q >= {_f32(b)}) level = {_f32(lv)};")
    L += ["      const float d = __fmul_rn(level, s) - v;", "      e += d * d;", "    }",
          "    if (e < best_e) { best_e = e; best = h; }", "  }", "  scales[gid] = best;", "}"]
    return "\n".join(L) + "\n"


@lru_cache(maxsize=16)
def _search_cubin(book: tuple[float, ...], bounds: tuple[float, ...], group: int, multipliers: tuple[float, ...],
                  min_scale: float) -> tuple[str, bytes]:
    return cached_cubin(f"{SEARCH_KERNEL}_l{len(book)}_g{group}_m{len(multipliers)}",
                        lambda name: search_source(book, bounds, group, multipliers=multipliers, min_scale=min_scale,
                                                   name=name))


def search_scales(x: mx.array, rms: mx.array, book: tuple[float, ...], bounds: tuple[float, ...], group: int,
                  multipliers: tuple[float, ...], min_scale: float) -> mx.array:
    """x (..., n) float32 and its group RMS (..., n / group) -> the searched fp16 scales (..., n / group)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    total = math.prod(lead) * (n // group)
    if total >= 2**31:
        raise ValueError(f"{math.prod(lead)} rows of {n} are too many for one scale search kernel call")
    name, cubin = _search_cubin(tuple(book), tuple(bounds), group, tuple(multipliers), min_scale)
    (bits,) = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=cubin, inputs=[x.astype(mx.float32), rms.astype(mx.float32)],
        output_shapes=[(*lead, n // group)], output_dtypes=[mx.uint16], scalars=[math.prod(lead), n],
        grid=(-(-total // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), ensure_row_contiguous=True)
    return bits.view(mx.float16)

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

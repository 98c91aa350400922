"""The source of the fused TurboQuant kernels: codebook matrix-vector products for decode and tiny batches that
read the packed codes directly and never materialise float weights. Everything here is text; choosing a kernel per
product, building and launching it is tqbench.runtime.kernels' job.

One template, `kernel_source`, writes the kernel for either dialect: CUDA and Metal differ only in spellings (thread
indices, warp / simdgroup shuffles, shared / threadgroup memory, casts). Metal builds it with `mx.fast.metal_kernel`;
CUDA wraps it into a whole program (`cuda_program`) that NVRTC compiles once per machine (`tqbench.cubin`).
`kernel_name` names a source uniquely (MLX caches kernels by name), so a changed template never reuses an old build.

Kernel design (docs: benchmarks/README.md, "Fused TurboQuant kernels"):
- A *unit* is the smallest run of whole words that holds a whole number of 32-code *blocks*: 4 words (4-bit), 2
  words (2-bit), 16 words (3-bit, 10 codes a word) or 8 words (ternary, 20 trits a word): 32 or 160 codes. Group
  sizes are multiples of 32, so every block lies in one group and takes one scale; inside a unit every code's word
  and bit position is a compile-time constant.
- A warp (simdgroup) splits into row tiles of `lanes` lanes; a tile owns `rows` consecutive rows of W and its lanes
  walk the units of those rows. A lane loads x once per block and uses it for all its rows (and the codes of a
  row once for all rows of x), so x traffic is divided by `rows` and lookups by the batch. Few lanes per tile and
  many rows per lane measured fastest on an H200 (a warp's fixed costs are paid once); Metal takes fewer where its
  registers would not fit: tqbench.runtime.kernel_layout. Binary formats load the next unit's words before the current unit's arithmetic
  (`prefetch`); ternary does not, and does not preload x as float4s (`xpre`): both raise its registers (to
  195-255) and were no faster.
- Weight and scale offsets are 32-bit on Metal where the tensors' sizes allow (`offset_type`), 64-bit on CUDA.
- A threadgroup has at most 256 threads, so that even 255 registers a thread fit the register file: MLX does not
  report a launch that asks for too many, the output is then left unwritten (seen on the H200 with 320 threads
  and 255 registers, and caught by the self-check).
- 3-bit and ternary units hold 5 blocks; five warps of a block each take one block position of every unit (a
  warp-uniform switch, no divergence) and their sums meet in shared memory. Their rows are not 16-byte aligned,
  so a lane loads aligned uint4 words around its words: row tiles start at multiples of 4 rows, which makes each
  row's misalignment a compile-time constant of the template (it depends on words-per-row mod 4 only).
- Codes: b-bit codes are shifted and masked and looked up in a float table in shared memory (at most 16 entries,
  so every entry has its own bank and lookups never conflict). Ternary words are split into runs of at most 10
  trits, each turned into a 32-bit fixed-point fraction whose trits come out top-down, one 32x32->64-bit
  multiply by 3 per trit (Metal: `mulhi` and a 32-bit multiply, since Apple GPUs emulate 64-bit integers); the multiply's addend puts the trit t into the bits of the float 2^23 + t, so
  e = t - 1 in {-1, 0, 1} costs one float subtraction, and codebook[t] = c1 + beta * e + gamma * e^2
  (gamma = 0 for a symmetric codebook: one multiply-add per trit and row).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

KERNEL_BATCH = 4  # rows of x one kernel launch takes (more rows: several launches)
LEVELS = (3, 4, 8, 16)
GROUPS = (32, 64, 128)


def format_of(levels: int) -> tuple[int, int]:
    """(bits per code, codes per uint32 word); ternary: (0, 20)."""
    if levels == 3:
        return 0, 20
    if levels not in (4, 8, 16):
        raise ValueError(f"a TurboQuant codebook has 3, 4, 8 or 16 levels, not {levels}")
    bits = int(math.log2(levels))
    return bits, 32 // bits


def unit_codes(levels: int) -> int:
    """Codes in one unit: the least multiple of 32 that is a whole number of words."""
    per = format_of(levels)[1]
    return per * 32 // math.gcd(per, 32)


@functools.lru_cache(maxsize=None)
def trit_constants(digits: int) -> tuple[int, int]:
    """(K, C) such that f = v * K + C is a 32-bit fixed-point fraction of v / 3^digits from which `digits`
    multiplications by 3 produce the trits of v, most significant first, for every v < 3^digits (digits <= 10).
    The error of f is then in [0, 2^32 / 3^digits), which keeps every step's integer part exact."""
    if not 1 <= digits <= 10:
        raise ValueError("1..10 trits per fixed-point run")
    p = 3**digits
    k = (1 << 32) // p
    deficit = (1 << 32) - k * p  # 2^32/p - k = deficit/p
    lo = -(-(p - 1) * deficit // p)  # C >= (p - 1) * (2^32/p - k)
    hi = (1 << 32) // p  # C < 2^32 / p
    c = (lo + hi) // 2
    assert lo <= c < hi and (p - 1) * k + c < (1 << 32)
    return k, c


def trit_digits(word: int, start: int, count: int) -> list[int]:
    """The trits [start, start + count) of a word as the kernel computes them (top-down), most significant first:
    a pure-Python model of the kernel's arithmetic, for tests."""
    k, c = trit_constants(count)
    v = (word // 3**start) % 3**count
    f = (v * k + c) & 0xFFFFFFFF
    out = []
    for _ in range(count):
        p = f * 3
        out.append(p >> 32)
        f = p & 0xFFFFFFFF
    return out


TRIT_MAGIC = 0x4B000000  # float bits of 2^23: the multiply's addend makes the high word the float 2^23 + trit


@dataclass(frozen=True, kw_only=True)
class Dialect:
    name: str
    header: str
    dev: str  # address space of device pointers
    shared: str  # qualifier of block-shared arrays
    barrier: str
    tid: str
    bid_x: str
    bid_y: str
    shfl: str  # format with {v}, {o}
    h2f: Callable[[str, str], str]  # (expr, dtype name) -> float expression
    u2f: str  # format with {v}
    inline: str
    fma: str
    mulhi: str | None  # 32x32 -> high 32 bits of the product (None: the trit step multiplies in 64 bits)


def _cuda_h2f(v: str, dtype: str) -> str:
    return {"float16": f"__half2float({v})", "bfloat16": f"__bfloat162float({v})", "float32": f"({v})"}[dtype]


def _metal_h2f(v: str, dtype: str) -> str:
    return f"float({v})"


_COMMON_HELPERS = """
{inline} uint4 tq_load4(const {dev} tq_u32* w, {off} word, {off} total) {{
  // Four words from a 16-byte aligned word index; words past `total` read as 0 (only ever at the very end).
  if (word + 4 <= total) {{
    return ((const {dev} uint4*)(w + word))[0];
  }}
  uint4 r = uint4{zero4};
  if (word + 0 < total) r.x = w[word + 0];
  if (word + 1 < total) r.y = w[word + 1];
  if (word + 2 < total) r.z = w[word + 2];
  if (word + 3 < total) r.w = w[word + 3];
  return r;
}}
"""

DIALECTS = {
    "cuda": Dialect(
        name="cuda",
        header="typedef unsigned int tq_u32;\ntypedef unsigned long long tq_u64;\n",
        dev="", shared="__shared__", barrier="__syncthreads();",
        tid="threadIdx.x", bid_x="blockIdx.x", bid_y="blockIdx.y",
        shfl="__shfl_xor_sync(0xffffffffu, {v}, {o})",
        h2f=_cuda_h2f, u2f="__uint_as_float({v})", inline="__device__ __forceinline__", fma="__fmaf_rn",
        mulhi=None,  # as measured on the H200 (the compiler makes the 64-bit product one wide multiply)
    ),
    "metal": Dialect(
        name="metal",
        header="typedef uint tq_u32;\ntypedef ulong tq_u64;\n",
        dev="device", shared="threadgroup", barrier="threadgroup_barrier(mem_flags::mem_threadgroup);",
        tid="thread_position_in_threadgroup.x", bid_x="threadgroup_position_in_grid.x",
        bid_y="threadgroup_position_in_grid.y",
        shfl="simd_shuffle_xor({v}, (ushort)({o}))",
        h2f=_metal_h2f, u2f="as_type<float>({v})", inline="inline", fma="metal::fma",
        mulhi="mulhi",  # Apple GPUs emulate 64-bit integers
    ),
}


@dataclass(frozen=True, kw_only=True)
class Spec:
    """Everything one compiled kernel is specialised for."""

    levels: int
    group: int
    n: int  # input columns
    out: int  # rows of W (per expert)
    experts: int  # leading expert axis of weight/scales (1 for a plain Linear)
    batch: int  # rows of x per product (1..KERNEL_BATCH)
    gather: bool  # the products are (x row block, expert) pairs
    xdiv: int = 0  # gather: x block of pair p is p // xdiv (input `indices`: P experts); 0: input `pairs` (P, 2)
    rows: int = 4  # rows of W per lane
    lanes: int = 32  # lanes per row tile (4, 8, 16 or 32)
    tiles: int = 1  # warps (per block position) per threadgroup
    xpre: bool = False  # ternary: load a block's 32 x values as float4s first
    prefetch: bool | None = None  # load the next unit's words before this unit's arithmetic (None: not for ternary)
    scale_dtype: str = "float16"
    book_dtype: str = "float16"
    wide: bool | None = None  # 64-bit weight and scale offsets (None: the dialect's choice, `offset_type`)

    def __post_init__(self):
        bits, per = format_of(self.levels)
        if self.group not in GROUPS or self.n % self.group:
            raise ValueError(f"group {self.group} must be one of {GROUPS} and divide n={self.n}")
        if self.lanes not in (4, 8, 16, 32) or not 1 <= self.batch <= KERNEL_BATCH or self.rows not in (1, 2, 4, 8):
            raise ValueError("lanes in 4/8/16/32, batch 1..4, rows 1/2/4/8")
        if self.blocks > 1 and (self.rows % 4 or self.out % 4):
            raise ValueError("3-bit and ternary kernels take rows=4 or 8 and need out % 4 == 0")
        if self.threads > 256:
            raise ValueError(f"{self.threads} threads a threadgroup: at most 256 (255 registers each must fit)")
        if self.wide is False and not self.offsets_fit_32:
            raise ValueError(f"{self.experts} x {self.out} rows of {self.words} words need 64-bit offsets")

    @property
    def offsets_fit_32(self) -> bool:
        """Whether every weight and scale offset the kernel computes fits 32 bits: the last row tile may start 7 rows
        past the last row (its words guarded), and a load reads at most a 16-byte frame past a row's end."""
        words = (self.experts * self.out + 8) * self.words + 64
        scales = self.experts * self.out * (self.n // self.group)
        return max(words, scales) < 1 << 32

    @property
    def per_word(self) -> int:
        return format_of(self.levels)[1]

    @property
    def bits(self) -> int:
        return format_of(self.levels)[0]

    @property
    def unit(self) -> int:
        return unit_codes(self.levels)

    @property
    def unit_words(self) -> int:
        return self.unit // self.per_word

    @property
    def blocks(self) -> int:
        return self.unit // 32

    @property
    def words(self) -> int:  # words per row
        return -(-self.n // self.per_word)

    @property
    def units(self) -> int:  # units per row holding at least one code
        return -(-self.n // self.unit)

    @property
    def warps(self) -> int:
        return self.tiles * self.blocks

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_block(self) -> int:
        return self.tiles * (32 // self.lanes) * self.rows

    def grid(self, pairs: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        blocks = -(-self.out // self.rows_per_block)
        return (blocks * self.threads, pairs, 1), (self.threads, 1, 1)


def offset_type(spec: Spec, dialect: str) -> str:
    """The integer type of weight and scale offsets: 64-bit on CUDA (as measured on the H200) and wherever the sizes
    need it, else 32-bit (Metal: Apple GPUs emulate 64-bit integer arithmetic). x and y offsets stay 64-bit: their
    sizes depend on the launch (pairs), and each thread computes them once."""
    wide = spec.wide if spec.wide is not None else (dialect == "cuda" or not spec.offsets_fit_32)
    return "tq_u64" if wide else "tq_u32"


# The ternary step: f * 3 with TRIT_MAGIC added in the high word, which is then the float 2^23 + trit; with `mulhi`
# the high and low words come from two 32-bit multiplies.
_TRIT_STEP_64 = r"""            const tq_u64 p = (tq_u64)f * 3u + ((tq_u64)TQ_TRIT_MAGIC << 32); \
            f = (tq_u32)p; \
            const float e = TQ_U2F((tq_u32)(p >> 32)) - 8388609.0f; \
"""
_TRIT_STEP_MULHI = r"""            const tq_u32 hi = {mulhi}(f, 3u) + TQ_TRIT_MAGIC; \
            f = f * 3u; \
            const float e = TQ_U2F(hi) - 8388609.0f; \
"""


def _c(d: Dialect) -> str:
    """`const` plus the device address space, for pointer casts."""
    return f"const {d.dev}".strip()


_MACROS = r"""
#define TQ_MISALIGN(r) ((TQ_BLOCKS > 1) ? (((r) * TQ_WORDS) & 3) : 0)
#define TQ_Q0(J, r) ((TQ_MISALIGN(r) + (32 * (J)) / TQ_PER) >> 2)
#define TQ_Q1(J, r) ((TQ_MISALIGN(r) + (32 * (J) + 31) / TQ_PER) >> 2)
#define TQ_WORD(J, r, wi) tq_comp(wq[r][((TQ_MISALIGN(r) + (wi)) >> 2) - TQ_Q0(J, r)], (TQ_MISALIGN(r) + (wi)) & 3)
#define TQ_LOAD_INTO(J, DST, UU) \
  _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { \
    _Pragma("unroll") for (int q = 0; q < 2; ++q) { \
      if (TQ_Q0(J, r) + q <= TQ_Q1(J, r)) { DST[r][q] = TQ_LOAD(r, TQ_Q0(J, r) + q, UU); } \
    } \
  }
#define TQ_COPY_WORDS(J, DST, SRC) \
  _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { \
    _Pragma("unroll") for (int q = 0; q < 2; ++q) { \
      if (TQ_Q0(J, r) + q <= TQ_Q1(J, r)) { DST[r][q] = SRC[r][q]; } \
    } \
  }
#define TQ_SCALE_LOOP(EXPR) \
  _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { \
    const float sc = TQ_H2F_S(scales[srow[r] + gi]); \
    _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { acc[r][b] = TQ_FMA(sc, EXPR, acc[r][b]); } \
  }
#define TQ_BLOCK_BIN(J) { \
  float t[TQ_R][TQ_M]; \
  _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { t[r][b] = 0.0f; } } \
  _Pragma("unroll") for (int k4 = 0; k4 < 8; ++k4) { \
    float4 xv[TQ_M]; \
    _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { xv[b] = ((TQ_CDEV float4*)(xb[b] + col))[k4]; } \
    _Pragma("unroll") for (int kk = 0; kk < 4; ++kk) { \
      const int c = 32 * (J) + 4 * k4 + kk; \
      _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { \
        const float v = tab[(TQ_WORD(J, r, c / TQ_PER) >> (TQ_BITS * (c % TQ_PER))) & TQ_MASK]; \
        _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { t[r][b] = TQ_FMA(v, tq_comp4(xv[b], kk), t[r][b]); } \
      } \
    } \
  } \
  TQ_SCALE_LOOP(t[r][b]) \
}
#define TQ_BLOCK_TER(J, GEN) { \
  float t[TQ_R][TQ_M]; float uu[TQ_R][TQ_M]; float s[TQ_M]; float xa[TQ_M][32]; \
  if (TQ_XPRE) { \
    _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { \
      _Pragma("unroll") for (int k4 = 0; k4 < 8; ++k4) { \
        const float4 v4 = ((TQ_CDEV float4*)(xb[b] + col))[k4]; \
        xa[b][4 * k4] = v4.x; xa[b][4 * k4 + 1] = v4.y; xa[b][4 * k4 + 2] = v4.z; xa[b][4 * k4 + 3] = v4.w; \
      } \
    } \
  } \
  _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { \
    s[b] = 0.0f; \
    _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { t[r][b] = 0.0f; uu[r][b] = 0.0f; } \
  } \
  _Pragma("unroll") for (int wi = (32 * (J)) / 20; wi <= (32 * (J) + 31) / 20; ++wi) { \
    const int lo = tq_imax(0, 32 * (J) - 20 * wi); \
    const int hi = tq_imin(20, 32 * (J) + 32 - 20 * wi); \
    _Pragma("unroll") for (int top = hi; top > lo; top -= 10) { \
      const int cnt = tq_imin(10, top - lo); \
      const int first = top - cnt; \
      float xr[TQ_M][10]; \
      _Pragma("unroll") for (int i = 0; i < 10; ++i) { \
        if (i < cnt) { \
          const int k = 20 * wi + top - 1 - i - 32 * (J); \
          _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { \
            xr[b][i] = TQ_XPRE ? xa[b][k] : xb[b][col + k]; s[b] += xr[b][i]; \
          } \
        } \
      } \
      _Pragma("unroll") for (int r = 0; r < TQ_R; ++r) { \
        tq_u32 v = TQ_WORD(J, r, wi); \
        if (first > 0) { v = v / tq_pow3(first); } \
        if (first + cnt < 20) { v = v % tq_pow3(cnt); } \
        tq_u32 f = v * tq_trit_k(cnt) + tq_trit_c(cnt); \
        _Pragma("unroll") for (int i = 0; i < 10; ++i) { \
          if (i < cnt) { \
@TRIT_STEP@            _Pragma("unroll") for (int b = 0; b < TQ_M; ++b) { \
              t[r][b] = TQ_FMA(e, xr[b][i], t[r][b]); \
              if (GEN) { uu[r][b] = TQ_FMA(e * e, xr[b][i], uu[r][b]); } \
            } \
          } \
        } \
      } \
    } \
  } \
  TQ_SCALE_LOOP(TQ_FMA(tq_gamma, uu[r][b], TQ_FMA(beta, t[r][b], c1 * s[b]))) \
}
#define TQ_UNIT_LOOP(J) { \
  uint4 wq[TQ_R][2]; \
  uint4 wn[TQ_R][2]; \
  if (TQ_PREFETCH && ustart < TQ_UNITS) { TQ_LOAD_INTO(J, wq, ustart) } \
  for (tq_u32 u = ustart; u < TQ_UNITS; u += TQ_LANES) { \
    if (TQ_PREFETCH) { \
      if (u + TQ_LANES < TQ_UNITS) { TQ_LOAD_INTO(J, wn, u + TQ_LANES) }  /* the next unit's words, in flight */ \
    } else { \
      TQ_LOAD_INTO(J, wq, u) \
    } \
    const tq_u32 col = u * TQ_UNIT + 32u * (J); \
    if (TQ_TAIL && col >= TQ_N) { break; } \
    const tq_u32 gi = col / TQ_G; \
    TQ_BLOCK(J) \
    if (TQ_PREFETCH) { TQ_COPY_WORDS(J, wq, wn) } \
  } \
}
"""


def _defines(spec: Spec, d: Dialect, off: str) -> str:
    consts = dict(
        TQ_R=spec.rows, TQ_M=spec.batch, TQ_PER=spec.per_word, TQ_BITS=max(spec.bits, 1),
        TQ_MASK=f"{(1 << spec.bits) - 1 if spec.bits else 0}u", TQ_UW=spec.unit_words, TQ_UNIT=f"{spec.unit}u",
        TQ_BLOCKS=spec.blocks, TQ_WORDS=spec.words, TQ_N=f"{spec.n}u", TQ_OUT=f"{spec.out}u", TQ_G=f"{spec.group}u",
        TQ_UNITS=f"{spec.units}u", TQ_LANES=f"{spec.lanes}u", TQ_TAIL=int(spec.n % spec.unit != 0),
        TQ_TRIT_MAGIC=f"{TRIT_MAGIC}u", TQ_CDEV=_c(d), TQ_XPRE=int(spec.xpre),
        TQ_PREFETCH=int(spec.levels != 3 if spec.prefetch is None else spec.prefetch),
    )
    lines = [f"#define {k} {v}" for k, v in consts.items()]
    lines.append(f"#define TQ_H2F_S(v) {d.h2f('(v)', spec.scale_dtype)}")
    lines.append(f"#define TQ_U2F(v) {d.u2f.format(v='(v)')}")
    lines.append(f"#define TQ_FMA(a, b, c) {d.fma}((a), (b), (c))")
    if spec.blocks == 1:
        vec = "uint4" if spec.unit_words == 4 else "uint2"
        mk = "uint4{{v2.x, v2.y, 0u, 0u}}" if d.name == "cuda" else "uint4(v2.x, v2.y, 0u, 0u)"
        if vec == "uint4":
            lines.append(f"#define TQ_LOAD(r, q, UU) ((({_c(d)} uint4*)(w + wrow[r]))[UU])")
        else:
            lines.append(f"#define TQ_LOAD(r, q, UU) tq_widen((({_c(d)} uint2*)(w + wrow[r]))[UU])")
            lines.append(f"{d.inline} uint4 tq_widen(uint2 v2) {{ return {mk.format()}; }}")
    else:
        lines.append(f"#define TQ_LOAD(r, q, UU) tq_load4(w, wrow[r] + ({off})(UU) * {spec.unit_words}u + 4u * (q), "
                     "total_words)")
    lines.append("#define TQ_BLOCK(J) if (general) TQ_BLOCK_TER(J, true) else TQ_BLOCK_TER(J, false)"
                 if spec.levels == 3 else
                 "#define TQ_BLOCK(J) TQ_BLOCK_BIN(J)")
    return "\n".join(lines) + "\n"


def _helpers(d: Dialect) -> str:  # noqa: C901
    pow3 = " ".join(f"case {i}: return {3**i}u;" for i in range(21))
    tk = " ".join(f"case {c}: return {trit_constants(c)[0]}u;" for c in range(1, 11))
    tc = " ".join(f"case {c}: return {trit_constants(c)[1]}u;" for c in range(1, 11))
    return (
        f"{d.inline} tq_u32 tq_comp(uint4 v, int c) "
        "{ return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w)); }\n"
        f"{d.inline} float tq_comp4(float4 v, int c) "
        "{ return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w)); }\n"
        f"{d.inline} int tq_imin(int a, int b) {{ return a < b ? a : b; }}\n"
        f"{d.inline} int tq_imax(int a, int b) {{ return a > b ? a : b; }}\n"
        f"{d.inline} tq_u32 tq_pow3(int k) {{ switch (k) {{ {pow3} default: return 1u; }} }}\n"
        f"{d.inline} tq_u32 tq_trit_k(int c) {{ switch (c) {{ {tk} default: return 0u; }} }}\n"
        f"{d.inline} tq_u32 tq_trit_c(int c) {{ switch (c) {{ {tc} default: return 0u; }} }}\n"
    )


def kernel_source(spec: Spec, dialect: str) -> tuple[str, str]:
    """(header, body) of the fused kernel for `spec` in `dialect` ("cuda" or "metal").

    Inputs: x (float32; (x blocks, batch, n)), w (uint32), scales, codebook and, when `spec.gather`, pairs (uint32
    (P, 2): x block, expert). Output: y (float32 (P, batch, out)). Everything shape-like is a compile-time
    constant; the loops over codes and rows have constant trip counts and are unrolled by the compiler.
    """
    d = DIALECTS[dialect]
    R, M, Lanes = spec.rows, spec.batch, spec.lanes
    T = 32 // Lanes
    off = offset_type(spec, dialect)
    step = _TRIT_STEP_MULHI.format(mulhi=d.mulhi) if d.mulhi else _TRIT_STEP_64
    header = (d.header + _COMMON_HELPERS.format(inline=d.inline, dev=d.dev, off=off,
                                                zero4="{0u, 0u, 0u, 0u}" if dialect == "cuda" else "(0u)")
              + _helpers(d) + _defines(spec, d, off) + _MACROS.replace("@TRIT_STEP@", step))
    L: list[str] = []
    a = L.append
    a(f"// TurboQuant fused codebook matvec: levels={spec.levels} group={spec.group} n={spec.n} out={spec.out} "
      f"experts={spec.experts} batch={M} gather={int(spec.gather)} rows={R} lanes={Lanes} tiles={spec.tiles} "
      f"dialect={dialect}")
    a(f"// {spec.per_word} codes per word, {spec.words} words per row, units of {spec.unit_words} words "
      f"({spec.unit} codes, {spec.blocks} blocks of 32), {spec.units} units per row")
    a(f"const tq_u32 tid = {d.tid};")
    a("const tq_u32 warp = tid / 32u;")
    a("const tq_u32 lane = tid % 32u;")
    a(f"const tq_u32 j = warp % {spec.blocks}u;  // block position this warp takes in every unit")
    a(f"const tq_u32 tile = (warp / {spec.blocks}u) * {T}u + lane / {Lanes}u;  // row tile within the threadgroup")
    a(f"const tq_u32 lt = lane % {Lanes}u;  // lane within the row tile")
    a(f"const tq_u32 row0 = {d.bid_x} * {spec.rows_per_block}u + tile * {R}u;")
    a(f"const tq_u32 p = {d.bid_y};")
    if spec.gather and spec.xdiv:
        a(f"const tq_u32 xblk = p / {spec.xdiv}u;")
        a("const tq_u32 expert = indices[p];")
    elif spec.gather:
        a("const tq_u32 xblk = pairs[2u * p];")
        a("const tq_u32 expert = pairs[2u * p + 1u];")
    else:
        a("const tq_u32 xblk = 0u;")
        a("const tq_u32 expert = 0u;")
    a(f"const {off} total_words = ({off}){spec.experts * spec.out}u * {spec.words}u;")
    if spec.levels == 3:
        a(f"const float c0 = {d.h2f('codebook[0]', spec.book_dtype)};")
        a(f"const float c1 = {d.h2f('codebook[1]', spec.book_dtype)};")
        a(f"const float c2 = {d.h2f('codebook[2]', spec.book_dtype)};")
        a("const float beta = 0.5f * (c2 - c0);")
        a("const float tq_gamma = 0.5f * (c0 + c2) - c1;  // 0 for a symmetric codebook")
        a("const bool general = tq_gamma != 0.0f;")
    else:
        a(f"{d.shared} float tab[16];")
        a(f"if (tid < {spec.levels}u) tab[tid] = {d.h2f('codebook[tid]', spec.book_dtype)};")
        a(d.barrier)
    a(f"{off} wrow[TQ_R];  // first word of each row's 16-byte aligned frame")
    a(f"{off} srow[TQ_R];")
    a("_Pragma(\"unroll\") for (int r = 0; r < TQ_R; ++r) {")
    if spec.blocks == 1:
        a("  const tq_u32 rowc = row0 + (tq_u32)r < TQ_OUT ? row0 + (tq_u32)r : TQ_OUT - 1u;  "
          "// clamped: loads stay in bounds")
    else:
        a("  const tq_u32 rowc = row0 + (tq_u32)r;")
    a(f"  const {off} grow = ({off})expert * TQ_OUT + rowc;")
    a(f"  wrow[r] = grow * ({off})TQ_WORDS - ({off})TQ_MISALIGN(r);")
    a("  // rows past the last (only in a tile of 8 rows) read clamped scales and guarded words; never written")
    a(f"  srow[r] = (({off})expert * TQ_OUT + (rowc < TQ_OUT ? rowc : TQ_OUT - 1u)) * {spec.n // spec.group}u;")
    a("}")
    a(f"{_c(d)} float* xb[TQ_M];")
    a("_Pragma(\"unroll\") for (int b = 0; b < TQ_M; ++b) { xb[b] = x + ((tq_u64)xblk * TQ_M + (tq_u64)b) * TQ_N; }")
    a("float acc[TQ_R][TQ_M];")
    a("_Pragma(\"unroll\") for (int r = 0; r < TQ_R; ++r) { "
      "_Pragma(\"unroll\") for (int b = 0; b < TQ_M; ++b) { acc[r][b] = 0.0f; } }")
    a("const tq_u32 ustart = row0 < TQ_OUT ? lt : TQ_UNITS;  // tiles past the last row do nothing")
    if spec.blocks == 1:
        a("TQ_UNIT_LOOP(0)")
    else:
        a("switch (j) {")
        for jj in range(spec.blocks):
            a(f"  case {jj}u: {{ TQ_UNIT_LOOP({jj}) }} break;")
        a("  default: break;")
        a("}")
    # reduce over the lanes of a tile
    a("_Pragma(\"unroll\") for (int r = 0; r < TQ_R; ++r) { _Pragma(\"unroll\") for (int b = 0; b < TQ_M; ++b) {")
    a(f"  _Pragma(\"unroll\") for (tq_u32 o = {Lanes // 2}u; o > 0u; o >>= 1) "
      f"{{ acc[r][b] += {d.shfl.format(v='acc[r][b]', o='o')}; }}")
    a("} }")
    if spec.blocks == 1:
        a("if (lt == 0u) {")
        a("  _Pragma(\"unroll\") for (int r = 0; r < TQ_R; ++r) {")
        a("    if (row0 + (tq_u32)r < TQ_OUT) {")
        a("      _Pragma(\"unroll\") for (int b = 0; b < TQ_M; ++b) "
          "{ y[((tq_u64)p * TQ_M + (tq_u64)b) * TQ_OUT + row0 + (tq_u32)r] = acc[r][b]; }")
        a("    }")
        a("  }")
        a("}")
    else:
        nout = spec.rows_per_block * M
        a(f"{d.shared} float red[{spec.blocks * nout}];")
        a("if (lt == 0u) {")
        a("  _Pragma(\"unroll\") for (int r = 0; r < TQ_R; ++r) { _Pragma(\"unroll\") for (int b = 0; b < TQ_M; ++b) {")
        a(f"    red[j * {nout}u + (tile * TQ_R + (tq_u32)r) * TQ_M + (tq_u32)b] = acc[r][b];")
        a("  } }")
        a("}")
        a(d.barrier)
        a(f"for (tq_u32 i = tid; i < {nout}u; i += {spec.threads}u) {{")
        a(f"  const tq_u32 rr = {d.bid_x} * {spec.rows_per_block}u + i / TQ_M;")
        a("  float s = red[i];")
        a(f"  for (tq_u32 jj = 1u; jj < {spec.blocks}u; ++jj) {{ s += red[jj * {nout}u + i]; }}")
        a("  if (rr < TQ_OUT) y[((tq_u64)p * TQ_M + i % TQ_M) * TQ_OUT + rr] = s;")
        a("}")
    return header, "\n".join(L) + "\n"


def kernel_name(spec: Spec, dialect: str) -> str:
    """A name unique to the source (MLX caches compiled kernels by name, on disk too)."""
    header, body = kernel_source(spec, dialect)
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
    kind = "tq_gather" if spec.gather else "tq_matvec"
    return f"{kind}_l{spec.levels}_g{spec.group}_n{spec.n}_o{spec.out}_b{spec.batch}_{digest}"


INPUTS = ("x", "w", "scales", "codebook")

# Built with no includes: 16-bit floats arrive as their bits and are widened as cuda_fp16.h / cuda_bf16.h would
# (the integer path where no GPU compiles it: the tests' CPU emulation).
_CUDA_PRELUDE = r"""struct tq_half { unsigned short bits; };
struct tq_bf16 { unsigned short bits; };
__device__ __forceinline__ float tq_half2float(tq_half h) {
#if defined(__CUDA_ARCH__)
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits)); return f;
#else
  const unsigned int s = ((unsigned int)h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 31u, m = h.bits & 1023u;
  if (e == 31u) return __uint_as_float(s | 0x7f800000u | (m << 13));
  if (e == 0u) { const float v = (float)m * 5.9604644775390625e-08f; return s ? -v : v; }  // m * 2^-24, exact
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
#endif
}
__device__ __forceinline__ float tq_bf162float(tq_bf16 h) { return __uint_as_float(((unsigned int)h.bits) << 16); }
#define __half2float tq_half2float
#define __bfloat162float tq_bf162float
"""
_CUDA_TYPES = {"float16": "tq_half", "bfloat16": "tq_bf16", "float32": "float"}


def input_names(spec: Spec) -> list[str]:
    return list(INPUTS) + ((["indices"] if spec.xdiv else ["pairs"]) if spec.gather else [])


def cuda_program(spec: Spec, name: str) -> str:
    """The whole CUDA C source of kernel `name` for `spec`: `kernel_source`'s body as an extern "C" function taking
    the inputs in `input_names` order, then the output y (what `mx.fast.precompiled_cuda_kernel` passes)."""
    header, body = kernel_source(spec, "cuda")
    types = dict(x="const float*", w="const tq_u32*", scales=f"const {_CUDA_TYPES[spec.scale_dtype]}*",
                 codebook=f"const {_CUDA_TYPES[spec.book_dtype]}*", indices="const tq_u32*", pairs="const tq_u32*")
    params = ", ".join([f"{types[n]} {n}" for n in input_names(spec)] + ["float* y"])
    return f'{_CUDA_PRELUDE}{header}extern "C" __global__ void {name}({params}) {{\n{body}}}\n'

"""The layout of each fused TurboQuant kernel (rows of W per lane, lanes per row tile, warps per threadgroup), per
backend, and the register estimate that bounds it.

CUDA keeps the layouts measured fastest on an H200 (benchmarks/README.md): many rows per lane, few lanes per tile.
An H200 thread may hold 255 registers; an Apple GPU thread has about 128 32-bit registers before it spills to
memory, and 64-bit integers are emulated there. So Metal starts from the same layout and takes fewer rows per lane
(then no prefetch of the next unit's words, then fewer rows of x per launch) until `registers` fits
METAL_REGISTER_BUDGET. `registers` counts what a thread holds at the kernel's busiest point; on the H200 it comes
within 10% of ptxas's counts (tests/test_kernel_layout.py).
"""

from __future__ import annotations

from tqbench.runtime.kernel_source import KERNEL_BATCH, Spec, offset_type, unit_codes

# Apple GPUs: 128 registers a thread before spilling, less the estimate's error against ptxas (about 10%).
METAL_REGISTER_BUDGET = 112
# Registers measured by ptxas (sm_90, scripts/cuda_builds_sass.py) for the H200 defaults at batch 1, 7168x4096:
# (levels, registers).
MEASURED_CUDA_REGISTERS = ((16, 128), (8, 72), (3, 72))
_FIXED = 10  # thread and block indices, loop counters, the unit's column and group


def block_words(spec: Spec) -> int:
    """The most words one 32-code block of a row spans (3-bit: 4 of 10 codes each; ternary: 3 of 20)."""
    if spec.blocks == 1:
        return spec.unit_words
    per = spec.per_word
    return max((32 * j + 31) // per - (32 * j) // per + 1 for j in range(spec.blocks))


def registers(spec: Spec, dialect: str) -> int:
    """Estimated 32-bit registers a thread of `spec`'s kernel holds at its busiest point: the words of its rows (and
    the next unit's, when prefetched), two sums per row and row of x, each row's weight and scale offsets (two
    registers each when 64-bit), the x pointers, and x's values in flight (a float4 per row of x; ternary: a run of
    10 plus its sum, and each row's fixed-point fraction and the general codebook's second sums)."""
    rows, batch = spec.rows, spec.batch
    prefetch = spec.levels != 3 if spec.prefetch is None else spec.prefetch
    offsets = 2 if offset_type(spec, dialect) == "tq_u64" else 1
    live = rows * block_words(spec) * (2 if prefetch else 1)
    live += 2 * rows * batch + 2 * rows * offsets + 2 * batch
    if spec.levels == 3:
        live += rows * batch + rows + 11 * batch + (32 * batch if spec.xpre else 0)
    else:
        live += 4 * batch
    return live + _FIXED


def cuda_layout(levels: int, n: int) -> dict:
    """The H200's layout: keeps lanes busy on short rows (few units per row). More work per lane won there, since a
    warp's fixed costs (codebook, lane reduction, shared-memory exchange) are paid once however many units its lanes
    walk."""
    units = -(-n // unit_codes(levels))
    if unit_codes(levels) == 32:  # 2- and 4-bit: 4 words a unit, many units per row
        return {"rows": 8, "lanes": 16 if units >= 16 else 8, "tiles": 4}
    if levels == 8:  # 3-bit: 4 lanes per row tile, with the next unit's words prefetched
        return {"rows": 4, "lanes": 4 if units >= 8 else 8, "tiles": 1}
    best = min((8, 16), key=lambda l: (-(units / (l * -(-units // l))), l))  # ternary
    return {"rows": 4, "lanes": best, "tiles": 1}


def _metal_candidates(levels: int, n: int):
    """Metal's layouts in order of preference: the H200's, then fewer rows per lane, then without prefetch."""
    lay = cuda_layout(levels, n)
    least = 1 if unit_codes(levels) == 32 else 4  # 3-bit and ternary row tiles start at multiples of 4 rows
    rows = lay["rows"]
    while rows >= least:
        yield dict(lay, rows=rows)
        rows //= 2
    if levels != 3:
        yield dict(lay, rows=least, prefetch=False)


def _fits(levels: int, n: int, out: int, experts: int, batch: int, lay: dict) -> bool:
    spec = Spec(levels=levels, group=32, n=n, out=out, experts=experts, batch=batch, gather=False, **lay)
    return registers(spec, "metal") <= METAL_REGISTER_BUDGET


def choose_layout(levels: int, n: int, out: int, pairs: int = 1, batch: int = 1, backend: str = "cuda",
                  experts: int = 1) -> dict:
    """Rows per lane, lanes per row tile and warps per threadgroup (and `prefetch` where it is turned off) for a
    product of `batch` rows of x on `backend`."""
    if backend != "metal":
        return cuda_layout(levels, n)
    last = None
    for lay in _metal_candidates(levels, n):
        if _fits(levels, n, out, experts=experts, batch=batch, lay=lay):
            return lay
        last = lay
    return last  # spills: `kernel_batch` keeps launches from getting here


def kernel_batch(levels: int, n: int, out: int, experts: int = 1, backend: str = "cuda") -> int:
    """Rows of x one launch takes: KERNEL_BATCH, or on Metal the most whose layout fits the register budget."""
    if backend != "metal":
        return KERNEL_BATCH
    for batch in range(KERNEL_BATCH, 1, -1):
        if any(_fits(levels, n, out, experts=experts, batch=batch, lay=lay) for lay in _metal_candidates(levels, n)):
            return batch
    return 1

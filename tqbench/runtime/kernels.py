"""Which implementation serves a TurboQuant product: fused kernels where they exist and passed their self-check,
else the pure-MLX reference (tqbench.runtime.codebook).

The fused kernels are codebook matrix-vector products for decode and tiny batches (up to MAX_ROWS rows of x); their
source comes from tqbench.runtime.kernel_source, their layouts per backend from tqbench.runtime.kernel_layout. Here:
the kernels of each product (`make_spec`, `matmul_specs`, `gather_specs`), building a kernel once per process
(Metal: `mx.fast.metal_kernel`; CUDA: the cubin NVRTC compiled once per machine, `tqbench.cubin`, since
`mx.fast.cuda_kernel` would compile every kernel shape again in every process), launching it
(`fused_matmul`, `fused_gather`), and the dispatcher that self-checks each configuration once against the reference,
evaluates each shape's first product, and falls back to the reference with one warning where either fails.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, TextIO

import mlx.core as mx

from tqbench.cubin import cached_cubin
from tqbench.runtime import codebook as ref
from tqbench.runtime.kernel_layout import choose_layout, kernel_batch
from tqbench.runtime.kernel_source import (GROUPS, LEVELS, Spec, cuda_program, format_of, input_names, kernel_name,
                                           kernel_source)

MAX_ROWS = 8  # rows of x (decode and tiny batches) up to which the fused kernel serves a product
SELF_CHECK_TOL = 1e-4  # relative (Frobenius) error above which a kernel fails its self-check
# The self-check's case: (n, out, experts) with 3-bit rows of 90 words and ternary of 45 (misaligned) and 5.6 units;
# plain products of 1 and 3 rows; a gather of x (2, 1, 1, n) by indices (2, 3).
SELF_CHECK_SHAPE = (896, 48, 6)
SELF_CHECK_ROWS = (1, 3)
SELF_CHECK_GATHER_X = (2, 1, 1)
SELF_CHECK_INDICES = ((5, 0, 3), (1, 1, 4))

# How CUDA kernels are built: "nvrtc" (`cuda_program`, compiled once per machine) or "mlx" (`mx.fast.cuda_kernel`,
# compiled with MLX's headers in every process: kept so that benchmarks/compile_time.py measures the difference).
CUDA_BUILD = "nvrtc"


# ---------------------------------------------------------------------------------------------------------------
# Building and launching the kernels
# ---------------------------------------------------------------------------------------------------------------

def _precompiled(spec: Spec):
    """A callable with mx.fast kernels' call signature that launches the NVRTC-built cubin of `spec`."""
    launch = mx.fast.precompiled_cuda_kernel  # an MLX without it raises AttributeError: MLX builds the kernels
    name, cubin = cached_cubin(kernel_name(spec, "cuda"), lambda nm: cuda_program(spec, nm))

    def call(inputs, grid, threadgroup, output_shapes, output_dtypes):
        return launch(name=name, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
                      output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                      ensure_row_contiguous=True)

    return call


@functools.lru_cache(maxsize=256)
def _compiled(spec: Spec, dialect: str, build: str):
    if dialect == "cuda" and build == "nvrtc":
        return _precompiled(spec)
    header, body = kernel_source(spec, dialect)
    names = input_names(spec)
    if dialect == "cuda":
        return mx.fast.cuda_kernel(name=kernel_name(spec, dialect), input_names=names, output_names=["y"],
                                   source=body, header=header)
    return mx.fast.metal_kernel(name=kernel_name(spec, dialect), input_names=names, output_names=["y"],
                                source=body, header=header)


NVRTC_ERROR: str | None = None  # why NVRTC could not build a kernel in this process (then MLX builds them)


def compiled(spec: Spec, dialect: str):
    """The kernel for `spec`, built once per process (and, on CUDA, compiled once per machine)."""
    global NVRTC_ERROR
    if dialect == "cuda" and CUDA_BUILD == "nvrtc" and NVRTC_ERROR is None:
        try:
            return _compiled(spec, dialect, "nvrtc")
        except (RuntimeError, OSError, AttributeError) as e:  # no NVRTC, no driver, an MLX without precompiled kernels
            NVRTC_ERROR = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            dispatcher.warn(f"tqbench: NVRTC cannot build the CUDA kernels ({NVRTC_ERROR}); MLX builds them instead, "
                             "again in every process")
    return _compiled(spec, dialect, "mlx")


def make_spec(levels: int, group: int, n: int, out: int, experts: int, batch: int, gather: bool,
              scale_dtype: str = "float16", book_dtype: str = "float16", pairs: int = 1, xdiv: int = 0,
              backend: str = "cuda", **layout) -> Spec:
    """The kernel of one launch, in `backend`'s layout (tqbench.runtime.kernel_layout) unless `layout` says."""
    lay = choose_layout(levels, n, out, pairs=pairs, batch=batch, backend=backend, experts=experts)
    lay.update(layout)
    return Spec(levels=levels, group=group, n=n, out=out, experts=experts, batch=batch, gather=gather, xdiv=xdiv,
                scale_dtype=scale_dtype, book_dtype=book_dtype, **lay)


def dtype_name(dtype) -> str:
    """An MLX float dtype's name as a Spec spells it."""
    return {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}[dtype]


def self_check_specs(kind: str, levels: int, group: int, sdtype, bdtype, backend: str = "cuda") -> list[Spec]:
    """The kernels the self-check of a configuration launches (`Dispatcher.check`)."""
    n, out, experts = SELF_CHECK_SHAPE
    names = dtype_name(sdtype), dtype_name(bdtype)
    if kind == "matmul":
        return [spec for rows in SELF_CHECK_ROWS
                for spec in matmul_specs(rows, levels, group, n, out, *names, backend=backend)]
    shape = (len(SELF_CHECK_INDICES), len(SELF_CHECK_INDICES[0]))
    return gather_specs(SELF_CHECK_GATHER_X[-1], SELF_CHECK_GATHER_X[:-1], shape, levels=levels, group=group, n=n,
                        out=out, experts=experts, scale_dtype=names[0], book_dtype=names[1], backend=backend)


def _launch_rows(rows: int, step: int) -> list[int]:
    """The rows of x each launch takes, `step` at a time."""
    return [min(step, rows - s) for s in range(0, rows, step)]


def matmul_specs(x_rows: int, levels: int, group: int, n: int, out: int, scale_dtype: str, book_dtype: str,
                 backend: str = "cuda", **layout) -> list[Spec]:
    """The kernel of each launch `fused_matmul` makes for `x_rows` rows of x: batches of up to `kernel_batch` rows."""
    return [make_spec(levels, group, n, out=out, experts=1, batch=m, gather=False, scale_dtype=scale_dtype,
                      book_dtype=book_dtype, backend=backend, **layout)
            for m in _launch_rows(x_rows, kernel_batch(levels, n, out, 1, backend))]


def fused_matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, backend: str,
                 **layout) -> mx.array:
    """The fused kernel's x_rot (..., n) @ W.T for a few rows of x (float32 result)."""
    n = x_rot.shape[-1]
    out = weight.shape[-2]
    lead = x_rot.shape[:-1]
    x2 = x_rot.reshape(-1, n).astype(mx.float32)
    specs = matmul_specs(x2.shape[0], codebook.shape[0], n // scales.shape[-1], n=n, out=out,
                         scale_dtype=dtype_name(scales.dtype), book_dtype=dtype_name(codebook.dtype), backend=backend,
                         **layout)
    parts = []
    s = 0
    for spec in specs:
        xs = x2[s:s + spec.batch] if len(specs) > 1 else x2
        s += spec.batch
        grid, tg = spec.grid(1)
        y = compiled(spec, backend)(inputs=[xs, weight, scales, codebook], grid=grid, threadgroup=tg,
                                    output_shapes=[(1, xs.shape[0], out)], output_dtypes=[mx.float32])[0]
        parts.append(y.reshape(xs.shape[0], out))
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return y.reshape(*lead, out)


def _x_divisor(xbatch: tuple, bshape: tuple) -> int:
    """d such that the x block of the p-th product (row-major over bshape) is p // d, or 0 if there is none: x's batch
    dims must equal bshape's up to some axis and be 1 after it (SwitchGLU's x (B, L, 1) against indices (B, L, K))."""
    xb = (1,) * (len(bshape) - len(xbatch)) + tuple(xbatch)
    for s in range(len(bshape) + 1):
        if xb[:s] == bshape[:s] and all(v == 1 for v in xb[s:]):
            return max(1, math.prod(bshape[s:]))
    return 0


def gather_specs(m: int, xbatch: tuple, ishape: tuple, levels: int, group: int, n: int, out: int, experts: int,
                 scale_dtype: str, book_dtype: str, backend: str = "cuda", **layout) -> list[Spec]:
    """The kernel of each launch `fused_gather` makes for x (*xbatch, m, n) and indices of shape `ishape`."""
    bshape = tuple(mx.broadcast_shapes(tuple(xbatch), tuple(ishape)))
    npairs, xdiv = math.prod(bshape), _x_divisor(tuple(xbatch), bshape)
    return [make_spec(levels, group, n, out=out, experts=experts, batch=b, gather=True, scale_dtype=scale_dtype,
                      book_dtype=book_dtype, pairs=npairs, xdiv=xdiv, backend=backend, **layout)
            for b in _launch_rows(m, kernel_batch(levels, n, out, experts, backend))]


def fused_gather(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                 backend: str, **layout) -> mx.array:
    """gather_matmul through the fused kernel: one (x rows, expert) product per broadcast index."""
    n = x_rot.shape[-1]
    m = x_rot.shape[-2]
    experts, out = weight.shape[0], weight.shape[-2]
    xbatch = tuple(x_rot.shape[:-2])
    bshape = tuple(mx.broadcast_shapes(xbatch, tuple(indices.shape)))
    nx = math.prod(xbatch)
    npairs = math.prod(bshape)
    idx = indices.astype(mx.uint32)
    if tuple(idx.shape) != bshape:
        idx = mx.broadcast_to(idx, bshape)
    idx = idx.reshape(-1)
    if _x_divisor(xbatch, bshape):
        sel = idx
    else:
        xidx = mx.broadcast_to(mx.arange(nx, dtype=mx.uint32).reshape(xbatch), bshape).reshape(-1)
        sel = mx.stack([xidx, idx], axis=1)
    x3 = x_rot.reshape(nx, m, n).astype(mx.float32)
    specs = gather_specs(m, xbatch, tuple(indices.shape), levels=codebook.shape[0], group=n // scales.shape[-1], n=n,
                         out=out, experts=experts, scale_dtype=dtype_name(scales.dtype),
                         book_dtype=dtype_name(codebook.dtype), backend=backend, **layout)
    parts = []
    s = 0
    for spec in specs:
        xs = x3[:, s:s + spec.batch] if len(specs) > 1 else x3
        s += spec.batch
        grid, tg = spec.grid(npairs)
        y = compiled(spec, backend)(inputs=[xs, weight, scales, codebook, sel], grid=grid, threadgroup=tg,
                                    output_shapes=[(npairs, xs.shape[1], out)], output_dtypes=[mx.float32])[0]
        parts.append(y)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return y.reshape(*bshape, m, out)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch with a one-time self-check per configuration
# ---------------------------------------------------------------------------------------------------------------

def default_backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU whose backend has the fused kernels, else None."""
    try:
        if mx.default_device() != mx.gpu:
            return None
        if mx.cuda.is_available():
            return "cuda"
        if mx.metal.is_available():
            return "metal"
    except Exception:  # noqa: BLE001 - an MLX build without one of the backends
        return None
    return None


def random_case(levels: int, group: int, n: int, out: int, experts: int, key: int):
    """Random packed weights, scales and a codebook (random levels: the kernel must not assume the published ones)."""
    from tqbench.quant.turboquant import codes_per_word, pack

    k1, k2, k3 = mx.random.split(mx.random.key(key), 3)
    codes = mx.random.randint(0, levels, (experts, out, n), key=k1)
    weight = pack(codes, levels)
    scales = (mx.random.uniform(0.5, 2.0, (experts, out, n // group), key=k2)).astype(mx.float16)
    book = mx.sort(mx.random.normal((levels,), key=k3)).astype(mx.float16)
    assert weight.shape[-1] == -(-n // codes_per_word(levels))
    return weight, scales, book


def rel_error(a: mx.array, b: mx.array) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either holds a NaN)."""
    import numpy as np

    a, b = np.array(a.astype(mx.float32), np.float64), np.array(b.astype(mx.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@dataclass(kw_only=True)
class Dispatcher:
    """Chooses fused kernel or reference per call. `backend` None means detect (default_backend()); the kernels are
    pluggable (tests give stand-ins); each (kind, levels, group, dtype) is self-checked once, at first use. Every
    other shape's kernel is built and launched by MLX when its first product is evaluated: that first product is
    evaluated here, and a kernel that fails to build or launch then (a Metal compile error, a threadgroup too large for
    its registers) leaves its shape to the reference path with one warning line instead of raising."""

    backend: str | None | Callable[[], str | None] = default_backend
    matmul_kernel: Callable | None = None  # (x2d, weight, scales, codebook, backend) -> (rows, out)
    gather_kernel: Callable | None = None  # (x, weight, scales, codebook, indices, backend) -> (..., m, out)
    max_rows: int = MAX_ROWS
    stream: TextIO | None = None  # where the one warning line goes (None: sys.stderr at the time)
    checked: dict = field(default_factory=dict)  # key -> True (passed) / False (failed)
    shapes: dict = field(default_factory=dict)  # product shape -> True (its first product ran) / False (it failed)
    warnings: list = field(default_factory=list)

    def __post_init__(self):
        if self.matmul_kernel is None:
            self.matmul_kernel = fused_matmul
        if self.gather_kernel is None:
            self.gather_kernel = fused_gather

    def resolved_backend(self) -> str | None:
        """The backend whose kernels serve products now (None: the reference path)."""
        return self.backend() if callable(self.backend) else self.backend

    def _supported(self, n: int, out: int, weight: mx.array, scales: mx.array, codebook: mx.array) -> bool:
        levels = codebook.shape[0]
        if levels not in LEVELS or weight.dtype != mx.uint32 or n % 32 or scales.shape[-1] == 0:
            return False
        group = n // scales.shape[-1]
        if group not in GROUPS or group * scales.shape[-1] != n or out % 4:
            return False
        if scales.dtype not in (mx.float16, mx.bfloat16, mx.float32) or \
                codebook.dtype not in (mx.float16, mx.bfloat16, mx.float32):
            return False
        return weight.shape[-1] == -(-n // format_of(levels)[1])

    def fits_matmul(self, rows: int, n: int, weight: mx.array, scales: mx.array, codebook: mx.array) -> bool:
        """Whether a product of `rows` rows of x by this plain Linear's weights has a fused kernel (its shapes only;
        the self-check of its configuration decides too)."""
        return weight.ndim == 2 and 0 < rows <= self.max_rows and self._supported(n, weight.shape[0], weight, scales,
                                                                                  codebook)

    def fits_gather(self, m: int, indices: int, n: int, weight: mx.array, scales: mx.array,
                    codebook: mx.array) -> bool:
        """Whether a gathered product of m rows of x by `indices` experts has a fused kernel (shapes only)."""
        return (weight.ndim == 3 and m <= self.max_rows and 0 < indices < weight.shape[0]
                and indices * m <= 16 * self.max_rows and self._supported(n, weight.shape[1], weight, scales, codebook))

    def _ok(self, kind: str, backend: str, codebook: mx.array, scales: mx.array, n: int) -> bool:
        return self.check(kind, backend, levels=codebook.shape[0], group=n // scales.shape[-1], sdtype=scales.dtype,
                          bdtype=codebook.dtype)

    def check(self, kind: str, backend: str, levels: int, group: int, sdtype, bdtype) -> bool:
        """Whether the fused kernel of this configuration passed its self-check: run once, at the first ask."""
        key = (kind, backend, levels, group, str(sdtype), str(bdtype))
        if key not in self.checked:
            self.checked[key] = self._self_check(kind, backend, levels, group=group, sdtype=sdtype, bdtype=bdtype)
        return self.checked[key]

    def _self_check(self, kind: str, backend: str, levels: int, group: int, sdtype, bdtype) -> bool:
        """Kernel vs reference on a small random case whose rows are misaligned and whose last unit is partial."""
        try:
            n, out, experts = SELF_CHECK_SHAPE
            weight, scales, book = random_case(levels, group, n, out, experts, key=1234 + levels + group)
            scales, book = scales.astype(sdtype), book.astype(bdtype)
            errs = []
            # The reference runs on the CPU: a GPU's float32 matmul may use TF32 (MLX_ENABLE_TF32 defaults to 1),
            # which is itself ~1e-3 off.
            if kind == "matmul":
                for rows in SELF_CHECK_ROWS:
                    x = mx.random.normal((rows, n), key=mx.random.key(rows))
                    got = self.matmul_kernel(x, weight[2], scales[2], book, backend)
                    with mx.stream(mx.cpu):
                        want = ref.matmul(x, weight[2], scales[2], book)
                    errs.append(rel_error(got, want))
            else:
                x = mx.random.normal((*SELF_CHECK_GATHER_X, n), key=mx.random.key(7))
                idx = mx.array(SELF_CHECK_INDICES, dtype=mx.uint32)
                got = self.gather_kernel(x, weight, scales, book, idx, backend=backend)
                with mx.stream(mx.cpu):
                    want = ref.gather_matmul(x, weight, scales, book, idx)
                errs.append(rel_error(got, want))
            err = max(errs)
            if not err <= SELF_CHECK_TOL:  # NaN fails too
                return self._fail(kind, backend, levels=levels, group=group, sdtype=sdtype,
                                  why=f"relative error {err:.3g} > {SELF_CHECK_TOL}")
            return True
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return self._fail(kind, backend, levels=levels, group=group, sdtype=sdtype,
                              why=f"{type(e).__name__}: {msg[:200]}")

    def _fail(self, kind, backend, levels, group, sdtype, why) -> bool:
        line = (f"tqbench: fused TurboQuant kernel failed its self-check on {backend} ({kind}, {levels} levels, "
                f"group {group}, {str(sdtype).replace('mlx.core.', '')}: {why}); using the reference path")
        self.warn(line)
        return False

    def warn(self, line: str) -> None:
        """One line, kept in `warnings` and written to `stream` (stderr when None)."""
        self.warnings.append(line)
        print(line, file=self.stream or sys.stderr)

    def _first_use(self, key: tuple, what: str, run: Callable[[], mx.array],
                   fallback: Callable[[], mx.array]) -> mx.array:
        """`run()`; the first time for `key`, evaluated here, and on failure `fallback()` for this key from then on."""
        state = self.shapes.get(key)
        if state is None:
            try:
                y = run()
                mx.eval(y)
            except Exception as e:  # noqa: BLE001 - a kernel MLX could not build or launch: use the reference
                self.shapes[key] = False
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.warn(f"tqbench: fused TurboQuant kernel failed on first use on {key[1]} ({what}: "
                          f"{type(e).__name__}: {msg[:200]}); this shape uses the reference path")
                return fallback()
            self.shapes[key] = True
            return y
        return run() if state else fallback()

    @staticmethod
    def _what(kind: str, codebook: mx.array, scales: mx.array, n: int, out: int, rows: str) -> str:
        return (f"{kind}, {codebook.shape[0]} levels, group {n // scales.shape[-1]}, "
                f"{str(scales.dtype).replace('mlx.core.', '')}, {n} -> {out}, {rows}")

    def matmul(self, x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array) -> mx.array:
        backend = self.resolved_backend()
        n = x_rot.shape[-1]
        rows = math.prod(x_rot.shape[:-1])
        if (backend is not None and self.fits_matmul(rows, n, weight, scales, codebook)
                and self._ok("matmul", backend, codebook, scales, n)):
            key = ("matmul", backend, codebook.shape[0], scales.shape[-1], str(scales.dtype), str(codebook.dtype), n,
                   weight.shape[0], rows)
            return self._first_use(key, self._what("matmul", codebook, scales, n=n, out=weight.shape[0],
                                                   rows=f"{rows} rows of x"),
                                   lambda: self.matmul_kernel(x_rot, weight, scales, codebook, backend),
                                   lambda: ref.matmul(x_rot, weight, scales, codebook))
        return ref.matmul(x_rot, weight, scales, codebook)

    def gather_matmul(self, x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array,
                      indices: mx.array, sorted_indices: bool = False) -> mx.array:
        backend = self.resolved_backend()
        n = x_rot.shape[-1]
        if (backend is not None and x_rot.ndim >= 2
                and self.fits_gather(x_rot.shape[-2], indices.size, n, weight=weight, scales=scales, codebook=codebook)
                and self._ok("gather", backend, codebook, scales, n)):
            key = ("gather", backend, codebook.shape[0], scales.shape[-1], str(scales.dtype), str(codebook.dtype), n,
                   weight.shape[1], weight.shape[0], tuple(x_rot.shape[:-1]), tuple(indices.shape))
            what = self._what("gather", codebook, scales, n=n, out=weight.shape[1],
                              rows=f"x {tuple(x_rot.shape)}, indices {tuple(indices.shape)}")
            return self._first_use(key, what,
                                   lambda: self.gather_kernel(x_rot, weight, scales, codebook, indices,
                                                              backend=backend),
                                   lambda: ref.gather_matmul(x_rot, weight, scales, codebook=codebook, indices=indices,
                                                             sorted_indices=sorted_indices))
        return ref.gather_matmul(x_rot, weight, scales, codebook=codebook, indices=indices,
                                 sorted_indices=sorted_indices)


dispatcher = Dispatcher()  # the process's: benchmarks read its self-checks and warnings


def matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array) -> mx.array:
    return dispatcher.matmul(x_rot, weight, scales, codebook)


def gather_matmul(x_rot: mx.array, weight: mx.array, scales: mx.array, codebook: mx.array, indices: mx.array,
                  sorted_indices: bool = False) -> mx.array:
    return dispatcher.gather_matmul(x_rot, weight, scales, codebook=codebook, indices=indices,
                                    sorted_indices=sorted_indices)

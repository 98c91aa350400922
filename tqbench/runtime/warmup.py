"""What a model's first token waits for on a GPU, done where the faces can say so.

tqbench's fused kernels (tqbench.runtime.kernels): on CUDA each kernel shape is compiled by NVRTC once per machine
and kept as a cubin (tqbench.cubin). Left to the first forward pass they were built there, one by one, with nothing
on the screen (53 s for a K3-shaped model on a fresh H200). `build_kernels` builds every kernel the loaded model's
decode will launch, and the self-checks' own, right after the model loads, yielding a `KernelsCompiling` per kernel;
the dispatcher's self-checks then run. The kernels are known from the model's shapes (`decode_kernels`): each
TurboQuant Linear's product with one row of x, and each routed-expert projection's gathered product with the
router's top-k for one token (streamed layers: the same projections over their slot pools), plus the one a prompt's
routings sorted by expert need. A prompt of 2 to 9 tokens gives the Linears batch shapes of their own, built when
such a prompt first comes (longer prompts use the reference path). Metal builds the kernels inside MLX at their
first launch, and a CPU has none: nothing is built or yielded there.

MLX's own kernels: MLX's CUDA build compiles them inside the first forward pass (and keeps them in its cache
directory, tqbench.cubin.keep_mlx_kernels) with no progress to report. `mlx_warmup` says it is about to happen, once
per process on CUDA, and `mlx_warmed` how long the first token took and how many kernels MLX compiled meanwhile.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from tqbench.events import KernelsCompiling, MlxWarmedUp, MlxWarmup
from tqbench.runtime import kernels
from tqbench.runtime.kernel_source import Spec, kernel_name
from tqbench.runtime.layers import TurboQuantLinear, TurboQuantSwitchLinear

# ---- which kernels a model's decode launches ---------------------------------------------------------------------

# How mlx-lm's switch layers (SwitchGLU, SwitchMLP) hand x to each routed-expert projection. One token: x (1, 1, in)
# becomes (1, 1, 1, 1, in) for the first projections (x shared by the top-k experts), which give (1, 1, top-k, 1,
# hidden) to the last one (x per pair), with indices (1, 1, top-k). A prompt of L tokens has the same kernels (x (1, L,
# 1, 1, in), indices (1, L, top-k)) until its routings reach SORTED_FROM: then they are sorted by expert, x (P, 1, in)
# with indices (P,), and the first projections' x is per pair too.
_SHARED_X, _PAIR_X = "shared", "per pair"
_SWITCH_INPUTS = {"gate_proj": _SHARED_X, "up_proj": _SHARED_X, "down_proj": _PAIR_X, "fc1": _SHARED_X,
                  "fc2": _PAIR_X}
SORTED_FROM = 64  # routings (tokens x top-k) from which mlx-lm's switch layers sort a batch's routings by expert


def decode_kernels(model: nn.Module, dispatcher: kernels.Dispatcher | None = None, backend: str = "cuda") -> list[Spec]:
    """The fused kernels one decode step of `model` launches (each once, in module order), as the dispatcher would
    choose them by shape, and the routed experts' kernels of a prompt whose sorted routings the fused kernels serve
    (64 to 128 routings: with K3's top-16, a prompt of 4 to 8 tokens at once); whether each configuration passes
    its self-check is not asked."""
    d = dispatcher or kernels.dispatcher
    specs: dict[Spec, None] = {}
    for _, m in model.named_modules():
        if isinstance(m, TurboQuantLinear) and d.fits_matmul(1, m.input_dims, m.weight, m.scales, m.codebook):
            specs.update(dict.fromkeys(kernels.matmul_specs(1, *_product(m), backend=backend)))
    for switch, k in _routed_experts(model):
        for name, proj in switch.children().items():
            if not isinstance(proj, TurboQuantSwitchLinear) or name not in _SWITCH_INPUTS:
                continue
            sorted_ = k * -(-SORTED_FROM // k)  # the fewest routings of whole tokens that are sorted
            products = [((1, 1, 1) if _SWITCH_INPUTS[name] == _SHARED_X else (1, 1, k), (1, 1, k), k),
                        ((sorted_,), (sorted_,), sorted_)]  # (x batch shape, indices shape, routings)
            levels, group, n, out, sdtype, bdtype = _product(proj)
            for xbatch, ishape, routings in products:
                if d.fits_gather(1, routings, n, weight=proj.weight, scales=proj.scales, codebook=proj.codebook):
                    specs.update(dict.fromkeys(kernels.gather_specs(1, xbatch, ishape, levels=levels, group=group, n=n,
                                                                    out=out, experts=proj.weight.shape[0],
                                                                    scale_dtype=sdtype, book_dtype=bdtype,
                                                                    backend=backend)))
    return list(specs)


def kernels_to_build(model: nn.Module, dispatcher: kernels.Dispatcher | None = None,
                     backend: str = "cuda") -> list[Spec]:
    """The self-checks' kernels of each configuration the model's decode uses, then its decode kernels (in
    `backend`'s layouts: Metal's count is the one a Mac compiles at first launch)."""
    decode = decode_kernels(model, dispatcher, backend)
    checks = [s for c in _configurations(decode) for s in kernels.self_check_specs(*c, backend=backend)]
    return list(dict.fromkeys(checks + decode))


def _product(m: nn.Module) -> tuple:
    """(levels, group, n, out, scale dtype, codebook dtype) of a TurboQuant module's products."""
    n = m.input_dims
    return (m.codebook.shape[0], n // m.scales.shape[-1], n, m.weight.shape[-2], kernels.dtype_name(m.scales.dtype),
            kernels.dtype_name(m.codebook.dtype))


def _routed_experts(model: nn.Module) -> Iterator[tuple[nn.Module, int]]:
    """(switch layer, top-k) of every MoE block whose router tqbench knows; a streamed layer's switch layer is the
    one it runs on its slot pools."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from tqbench.runtime.routing import top_k
    from tqbench.stream.attach import StreamedExperts

    for _, block in model.named_modules():
        k = top_k(block)
        if k is None:
            continue
        switch = block["switch_mlp"]
        if isinstance(switch, StreamedExperts):
            switch = switch._hidden.inner
        if isinstance(switch, (SwitchGLU, SwitchMLP)):
            yield switch, k


def _configurations(specs: list[Spec]) -> list[tuple]:
    """The self-check keys (kind, levels, group, scale dtype, codebook dtype) of `specs`, in order."""
    keys = ((("gather" if s.gather else "matmul"), s.levels, s.group, getattr(mx, s.scale_dtype),
             getattr(mx, s.book_dtype)) for s in specs)
    return list(dict.fromkeys(keys))


# ---- building them before the first token ------------------------------------------------------------------------

def build_kernels(model: nn.Module, dispatcher: kernels.Dispatcher | None = None,
                  build: Callable[[Spec], bool] | None = None) -> Iterator[KernelsCompiling]:
    """Build the kernels `model`'s decode needs (`kernels_to_build`), yielding a KernelsCompiling after each, then
    run the self-checks of their configurations. Only where the dispatcher runs CUDA kernels built by NVRTC (else
    nothing: Metal builds its kernels at their first launch, a CPU has none). `build(spec)` builds one kernel and
    says whether it came from a cache (the default: tqbench.cubin's cubin for this GPU)."""
    d = dispatcher or kernels.dispatcher
    if d.resolved_backend() != "cuda" or (build is None and kernels.CUDA_BUILD != "nvrtc"):
        return
    build = build or _build_cubin
    specs = kernels_to_build(model, d)
    t0 = time.perf_counter()
    compiled = 0
    for done, spec in enumerate(specs, 1):
        cached = build(spec)
        compiled += not cached
        yield KernelsCompiling(done=done, total=len(specs), name=kernel_name(spec, "cuda"), cached=cached,
                               compiled=compiled, elapsed_s=time.perf_counter() - t0)
    for kind, levels, group, sdtype, bdtype in _configurations(specs):
        d.check(kind, "cuda", levels=levels, group=group, sdtype=sdtype, bdtype=bdtype)


def _build_cubin(spec: Spec) -> bool:
    from tqbench.cubin import STATS

    before = STATS.compiled
    kernels.compiled(spec, "cuda")
    return STATS.compiled == before


# ---- MLX's own kernels -------------------------------------------------------------------------------------------

_warmed = False  # this process ran its first forward pass on CUDA
_generated = False  # this process ran a generation


def first_generation() -> bool:
    """True for the process's first generation only, on every backend: its first forward passes compile MLX's
    kernels and trace tqbench's compiled graphs, so its prompt's time is a warm-up, not a speed."""
    global _generated
    first, _generated = not _generated, True
    return first


def mlx_warmup() -> MlxWarmup | None:
    """An MlxWarmup before the process's first forward pass on CUDA; None otherwise (and on any other backend)."""
    global _warmed
    if _warmed or kernels.default_backend() != "cuda":
        return None
    _warmed = True
    held = _mlx_cached()
    return MlxWarmup(first_run=held == 0, cached=held)


def mlx_warmed(warmup: MlxWarmup, seconds: float) -> MlxWarmedUp:
    return MlxWarmedUp(seconds=seconds, compiled=max(0, _mlx_cached() - warmup.cached))


def _mlx_cached() -> int:
    """Kernels in MLX's CUDA kernel cache directory (one .ptx file each; tqbench sets where: keep_mlx_kernels)."""
    where = os.environ.get("MLX_PTX_CACHE_DIR")
    try:
        return sum(1 for _ in Path(where).glob("*.ptx")) if where else 0
    except OSError:
        return 0

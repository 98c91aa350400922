"""Tensor parallel (`--parallel tensor`): every rank holds a slice of every layer, and the ranks sum their partial
products at the end of each attention and MLP block.

The family decides which projection is sliced how: mlx-lm's `model.shard(group)` calls MLX's `shard_linear` and
`shard_inplace` (mlx.nn.layers.distributed) with "all-to-sharded" (each rank keeps a slice of the output rows) or
"sharded-to-all" (each rank keeps a slice of the input columns, and the outputs are summed across ranks). Those
know MLX's Linear and quantized layers only, so while the family's `shard` runs, `shard` here puts a dispatch in
their place: TurboQuant modules are sliced by `sliced`, every other module goes on to MLX's own function.

A TurboQuant module's input columns are packed codes, per-group scales and a blockwise rotation of the input, so a
column slice is only exact where its edges fall on a rotation block, a scale group and a packed word; anything else
is refused, naming the module. Routed experts stay resident: the streamer reads whole experts, and a rank would
need a slice of each (`refuse_streaming`)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed

from tqbench.distributed.world import Pipeline
from tqbench.errors import TqbenchError
from tqbench.quant.turboquant import codes_per_word

PARALLEL = ("pipeline", "tensor")
SHARDINGS = ("all-to-sharded", "sharded-to-all")


def turboquant(module) -> bool:
    """tqbench.runtime.layers' modules, known as the loader knows them (a codebook; a concatenation of such parts)
    without importing the runtime, which imports this package."""
    if not isinstance(module, nn.Module):
        return False
    parts = module.get("parts")
    return "codebook" in module or (isinstance(parts, list) and bool(parts) and all(map(turboquant, parts)))


def _concat(module) -> bool:
    return "parts" in module and "codebook" not in module


class SliceError(TqbenchError):
    """A module that cannot be split across the ranks as the family asks."""


@dataclass(frozen=True, kw_only=True)
class Shards(Pipeline):
    """This rank's place when the model is sharded: every layer (start 0, end the layer count), a slice of each.
    A Pipeline for what the engine asks of one (its rank and size, the layers whose experts it learns, the
    counters it gathers after a reply)."""


def refuse_streaming() -> TqbenchError:
    return TqbenchError("--parallel tensor keeps the routed experts resident: each rank needs a slice of every "
                        "expert and the streamer reads whole ones; give --cache-budget-gb off (a model that fits "
                        "in the ranks' memory together), or use --parallel pipeline, which streams")


def shard(group, model: nn.Module) -> Shards:
    """Slice every layer of `model` across `group` with the family's own `shard(group)`, TurboQuant modules
    included. Before any weight is evaluated: each rank reads the whole tensors once, and keeps its slices. Raises
    SliceError (one line naming the module) when a projection cannot be split, TqbenchError for a family mlx-lm
    cannot shard."""
    if not hasattr(model, "shard"):
        raise TqbenchError(f"this model's family has no tensor-parallel shard in mlx-lm: use --parallel pipeline to "
                           f"run it across {group.size()} ranks")
    names = {id(m): name for name, m in model.named_modules()}
    with _dispatch(group, names):
        model.shard(group)
    return Shards(rank=group.rank(), size=group.size(), start=0, end=len(model.layers))


# ---- the dispatch around the family's shard ----------------------------------------------------------------------

@contextlib.contextmanager
def _dispatch(group, names: dict[int, str]) -> Iterator[None]:
    """MLX's shard_linear / shard_inplace, wherever mlx-lm's model modules bound them, replaced for the duration
    by ones that also take TurboQuant modules (and name the module when MLX's own refuses one)."""
    originals = {"shard_linear": mlx_distributed.shard_linear, "shard_inplace": mlx_distributed.shard_inplace}
    ours = {"shard_linear": _shard_linear(originals["shard_linear"], group, names),
            "shard_inplace": _shard_inplace(originals["shard_inplace"], group, names)}
    patched = []
    for mod in [mlx_distributed] + [m for n, m in list(sys.modules.items()) if n.startswith("mlx_lm.models.")]:
        for attr, fn in originals.items():
            if getattr(mod, attr, None) is fn:
                setattr(mod, attr, ours[attr])
                patched.append((mod, attr, fn))
    try:
        yield
    finally:
        for mod, attr, fn in patched:
            setattr(mod, attr, fn)


def _shard_linear(original, default, names):
    def shard_linear(module, sharding, *, segments=1, group=None):
        g = group or default
        name = names.get(id(module), type(module).__name__)
        if turboquant(module):
            m = sliced(module, sharding, g.rank(), size=g.size(), segments=segments, name=name)
            return ShardedToAll(m, g) if sharding == "sharded-to-all" else m
        with _named(name):
            return original(module, sharding, segments=segments, group=g)

    return shard_linear


def _shard_inplace(original, default, names):
    def shard_inplace(module, sharding, *, segments=1, group=None):
        g = group or default
        name = names.get(id(module), type(module).__name__)
        if turboquant(module):
            _take(module, sliced(module, sharding, g.rank(), size=g.size(), segments=segments, name=name))
            return None
        with _named(name):
            return original(module, sharding, segments=segments, group=g)

    return shard_inplace


@contextlib.contextmanager
def _named(name: str) -> Iterator[None]:
    """MLX's ValueError for a layer it cannot split (or mx.split's), as one line naming the module."""
    try:
        yield
    except ValueError as e:
        raise SliceError(f"{name}: {' '.join(str(e).split())}") from None


def _take(module: nn.Module, new: nn.Module) -> None:
    """`module` becomes `new` in place (the family keeps its reference): its parameters, and its widths."""
    if _concat(module):
        module.parts = new.parts
        return
    if "bias" in module and "bias" not in new:
        module.pop("bias")
    module.update(dict(new.items()))
    module.input_dims, module.output_dims = new.input_dims, new.output_dims


class ShardedToAll(nn.Module):
    """A TurboQuant module whose input columns are sliced across the group: each rank's partial product, in
    float32, summed across the ranks (MLX's ShardedToAllLinear for TurboQuant). The bias is on rank 0's slice."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def __call__(self, x: mx.array, *args) -> mx.array:
        y = self.inner(x.astype(mx.float32), *args)
        return mx.distributed.all_sum(y, group=self.group).astype(x.dtype)


# ---- slicing, with explicit rank and size ----------------------------------------------------------------------

def sliced(module: nn.Module, sharding: str, rank: int, size: int, segments=1, name: str = "") -> nn.Module:
    """Rank `rank` of `size`'s slice of a TurboQuant module, as a new module of its kind: "all-to-sharded" keeps
    the output rows MLX's own split gives this rank (of each of `segments`), "sharded-to-all" its contiguous input
    columns (their outputs sum to the whole module's)."""
    if sharding not in SHARDINGS:
        raise SliceError(f"{name}: sharding {sharding!r}: MLX knows {' and '.join(SHARDINGS)}")
    if _concat(module):
        if sharding == "sharded-to-all":
            return type(module)([slice_inputs(p, rank, size, f"{name}.parts.{i}") for i, p in enumerate(module.parts)])
        return _concat_rows(module, rank, size, segments, name)
    if sharding == "sharded-to-all":
        return slice_inputs(module, rank, size, name)
    return slice_rows(module, row_ranges(module.output_dims, segments, rank, size, name), name)


def row_ranges(rows: int, segments, rank: int, size: int, name: str = "") -> list[tuple[int, int]]:
    """The output rows [lo, hi) rank `rank` keeps of `rows`, as MLX's `_shard` splits them: into `segments` (a
    count, or split points: row indices, or fractions of `rows`), each of them into `size` equal pieces."""
    if isinstance(segments, int):
        if rows % segments:
            raise SliceError(f"{name}: output width {rows} does not split into {segments} segments")
        points = [rows * i // segments for i in range(1, segments)]
    else:
        points = [int(s * rows) if isinstance(s, float) else int(s) for s in segments]
    edges = [0, *points, rows]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        if (hi - lo) % size:
            raise SliceError(f"{name}: output width {hi - lo} does not split into {size} equal slices")
        step = (hi - lo) // size
        out.append((lo + rank * step, lo + (rank + 1) * step))
    return out


def slice_rows(module, ranges: list[tuple[int, int]], name: str = ""):
    """A TurboQuant Linear or SwitchLinear keeping only the output rows in `ranges` (in order): weight and scales
    rows and bias; the input side (signs, codebook) is the whole module's."""
    def take(a: mx.array, axis: int) -> mx.array:
        parts = [mx.take(a, mx.arange(lo, hi), axis=axis) for lo, hi in ranges]
        return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis))

    out = sum(hi - lo for lo, hi in ranges)
    new = _like(module, module.input_dims, out)
    new.update({"weight": take(module.weight, -2), "scales": take(module.scales, -2), "codebook": module.codebook,
                "signs": module.signs})
    if "bias" in module:
        new.bias = take(module.bias, -1)
    return new


def slice_inputs(module, rank: int, size: int, name: str = ""):
    """A TurboQuant Linear or SwitchLinear keeping input columns [rank * n / size, (rank + 1) * n / size): their
    signs, scale groups and packed words. Its product with those columns of an input is this rank's share of the
    whole product; the bias stays on rank 0. Raises SliceError when an edge would cut a rotation block, a scale
    group or a packed word."""
    n, levels = module.input_dims, module.codebook.shape[0]
    per_word = codes_per_word(levels)
    width = n // size
    cut = f"{name}: input width {n} in {size} slices of {width if n % size == 0 else n / size:g}"
    if n % size:
        raise SliceError(f"{cut}: not a whole number of columns")
    if module.block is not None and width % module.block:
        raise SliceError(f"{cut} cuts a rotation block of {module.block}")
    if width % module.group_size:
        raise SliceError(f"{cut} cuts a scale group of {module.group_size}")
    if width % per_word:
        raise SliceError(f"{cut} cuts a packed word of {per_word} codes")
    new = _like(module, width, module.output_dims, bias="bias" in module and rank == 0)
    lo, groups, words = rank * width, width // module.group_size, width // per_word
    new.update({"weight": mx.contiguous(module.weight[..., rank * words:(rank + 1) * words]),
                "scales": mx.contiguous(module.scales[..., rank * groups:(rank + 1) * groups]),
                "codebook": module.codebook, "signs": mx.contiguous(module.signs[lo:lo + width])})
    if "bias" in new:
        new.bias = module.bias
    return new


def _concat_rows(module, rank: int, size: int, segments, name: str):
    """The concatenation's output rows this rank keeps, each taken from the part that computes it."""
    spans, start = [], 0
    for p in module.parts:
        spans.append((start, start + p.output_dims))
        start += p.output_dims
    parts = []
    for lo, hi in row_ranges(start, segments, rank, size, name):
        for i, (plo, phi) in enumerate(spans):
            a, b = max(lo, plo), min(hi, phi)
            if a < b:
                parts.append(slice_rows(module.parts[i], [(a - plo, b - plo)], f"{name}.parts.{i}"))
    return type(module)(parts)


def _like(module, input_dims: int, output_dims: int, bias: bool | None = None):
    """An empty TurboQuant module of `module`'s kind, codebook and group size, with these widths."""
    bias = "bias" in module if bias is None else bias
    levels = module.codebook.shape[0]
    if hasattr(module, "num_experts"):  # TurboQuantSwitchLinear
        return type(module)(input_dims, output_dims, num_experts=module.num_experts, levels=levels,
                            group_size=module.group_size, block=module.block, bias=bias)
    return type(module)(input_dims, output_dims, levels=levels, group_size=module.group_size, block=module.block,
                        bias=bias)

"""How planned output tensors are laid out in files: order, units that never split, and shards.

Two layouts:
- `streaming` (the default): each routed expert's tensors (gate, up, down: codes and scales) are stored back to back
  as per-expert tensors `<moe>.experts.E.<proj>.<param>`, so a runtime reads one expert with one read. Per-layer
  expert tensors that every expert shares (TurboQuant `codebook`, `signs`) stay resident and come first.
- `stacked`: the mlx-lm layout, one `<moe>.switch_mlp.<proj>_proj.<param>` tensor per layer and projection with a
  leading expert axis (an expert is then 6 ranges). This is the layout the published K3 shard count (186) describes.
A unit is what is never split across shards: one tensor, or one expert's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, TypeVar

from tqbench.source.naming import Role
from tqbench.source.shard import DTYPE_SIZES

if TYPE_CHECKING:
    from tqbench.recipe.plan import ModulePlan

LAYOUTS = ("streaming", "stacked")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    streamed: bool = False  # a routed-expert page tensor, read from disk per expert

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bytes": self.nbytes,
                "streamed": self.streamed}


@dataclass(frozen=True, slots=True)
class Piece:
    """One output tensor in file order and what produces it: `module`'s output `param`, for one expert or all."""

    out: OutTensor
    module: ModulePlan
    param: str  # weight, scales, biases, codebook, signs, bias, or the source tensor's name for copies
    expert: int | None = None  # per-expert piece of a routed-expert module


@dataclass(frozen=True, slots=True)
class Unit:
    pieces: tuple[Piece, ...]
    layer: int | None = None
    expert: int | None = None  # set for one expert's pieces (streaming layout)

    @property
    def nbytes(self) -> int:
        return sum(p.out.nbytes for p in self.pieces)


def _param(module: ModulePlan, out: OutTensor) -> str:
    """The output's parameter name within its module (copied tensors keep their source name)."""
    prefix = module.name + "."
    return out.name[len(prefix):] if out.name.startswith(prefix) else out.name


def expert_module_name(module: ModulePlan, expert: int | str) -> str:
    """`<moe>.experts.E.<proj>`: the source's per-expert name (`experts.E.w1`), or `<proj>_proj` for stacked sources."""
    s = module.source
    if s.per_expert:
        src = s.template[0].name.module
        i = src.rfind(".experts.")
        return f"{src[:i]}.experts.{expert}.{src[i + len('.experts.'):].partition('.')[2]}"
    moe = module.name.rpartition(".switch_mlp.")[0] or module.name.rpartition(".experts")[0]
    return f"{moe}.experts.{expert}.{s.tname.projection}_proj"


def _groups(modules: Iterable[ModulePlan], layout: str) -> Iterator[list[ModulePlan]]:
    """Modules in file order, grouped: one layer's routed-expert modules together (streaming layout), any other
    module alone."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    run: list[ModulePlan] = []
    for m in modules:
        if layout == "streaming" and m.role is Role.ROUTED_EXPERT and m.source.experts:
            if run and run[0].source.tname.layer != m.source.tname.layer:
                yield run
                run = []
            run.append(m)
            continue
        if run:
            yield run
            run = []
        yield [m]
    if run:
        yield run


def _is_run(group: list[ModulePlan]) -> bool:
    return any(o.streamed for o in group[0].outputs) and group[0].role is Role.ROUTED_EXPERT


def file_units(modules: Iterable[ModulePlan], layout: str = "streaming") -> list[Unit]:
    units: list[Unit] = []
    for group in _groups(modules, layout):
        layer = group[0].source.tname.layer
        if layout != "streaming" or not _is_run(group):
            units.extend(Unit((Piece(o, m, _param(m, o)),), layer) for m in group for o in m.outputs)
            continue
        # Per-layer tensors every expert shares come first, then each expert's tensors back to back.
        units.extend(Unit((Piece(o, m, _param(m, o)),), layer) for m in group for o in m.outputs if not o.streamed)
        for e in range(max(m.source.experts for m in group)):
            pieces = []
            for m in group:
                for o in m.outputs:
                    if o.streamed:
                        param = _param(m, o)
                        out = OutTensor(f"{expert_module_name(m, e)}.{param}", o.dtype, o.shape[1:], True)
                        pieces.append(Piece(out, m, param, e))
            units.append(Unit(tuple(pieces), layer, e))
    return units


def unit_sizes(modules: Iterable[ModulePlan], layout: str = "streaming") -> Iterator[int]:
    """The byte sizes of file_units(modules, layout), without building them (K3 has 82,432 expert units)."""
    for group in _groups(modules, layout):
        experts = {m.source.experts for m in group}
        if layout != "streaming" or not _is_run(group) or len(experts) != 1:
            yield from (u.nbytes for u in file_units(group, layout))  # small, or ragged layers: the exact units
            continue
        yield from (o.nbytes for m in group for o in m.outputs if not o.streamed)
        yield from [sum(o.nbytes // o.shape[0] for m in group for o in m.outputs if o.streamed)] * experts.pop()


def count_shards(sizes: Iterable[int], shard_size: int) -> int:
    """How many shards assign_shards makes of units of these sizes."""
    shards, used = 0, 0
    for n in sizes:
        if shards == 0 or (used and used + n > shard_size):
            shards += 1
            used = 0
        used += n
    return shards


def assign_shards(units: Iterable[T], shard_size: int) -> list[list[T]]:
    """Greedy split in order of anything with `nbytes` (units, tensor specs): a new shard when the next one would
    pass `shard_size` (a larger one gets a shard of its own)."""
    shards: list[list[T]] = []
    used = 0
    for u in units:
        if not shards or (used and used + u.nbytes > shard_size):
            shards.append([])
            used = 0
        shards[-1].append(u)
        used += u.nbytes
    return shards


def shard_file(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"

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
from typing import TYPE_CHECKING, Any, Iterable

from tqbench.source.naming import Role
from tqbench.source.shard import DTYPE_SIZES

if TYPE_CHECKING:
    from tqbench.recipe.plan import ModulePlan

LAYOUTS = ("streaming", "stacked")


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


def expert_module_name(module: ModulePlan, expert: int) -> str:
    """`<moe>.experts.E.<proj>`: the source's per-expert name (`experts.E.w1`), or `<proj>_proj` for stacked sources."""
    s = module.source
    if s.per_expert:
        src = s.template[0].name.module
        i = src.rfind(".experts.")
        return f"{src[:i]}.experts.{expert}.{src[i + len('.experts.'):].partition('.')[2]}"
    moe = module.name.rpartition(".switch_mlp.")[0] or module.name.rpartition(".experts")[0]
    return f"{moe}.experts.{expert}.{s.tname.projection}_proj"


def file_units(modules: Iterable[ModulePlan], layout: str = "streaming") -> list[Unit]:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    units: list[Unit] = []
    run: list[ModulePlan] = []  # one layer's routed-expert modules

    def flush() -> None:
        if not run:
            return
        layer = run[0].source.tname.layer
        shared = [Piece(o, m, _param(m, o)) for m in run for o in m.outputs if not o.streamed]
        units.extend(Unit((p,), layer) for p in shared)
        for e in range(max(m.source.experts for m in run)):
            pieces = []
            for m in run:
                for o in m.outputs:
                    if o.streamed:
                        param = _param(m, o)
                        out = OutTensor(f"{expert_module_name(m, e)}.{param}", o.dtype, o.shape[1:], True)
                        pieces.append(Piece(out, m, param, e))
            units.append(Unit(tuple(pieces), layer, e))
        run.clear()

    for m in modules:
        streamable = layout == "streaming" and m.role is Role.ROUTED_EXPERT and m.source.experts
        if streamable and (not run or run[0].source.tname.layer == m.source.tname.layer):
            run.append(m)
            continue
        flush()
        if streamable:
            run.append(m)
        else:
            units.extend(Unit((Piece(o, m, _param(m, o)),), m.source.tname.layer) for o in m.outputs)
    flush()
    return units


def unit_sizes(modules: Iterable[ModulePlan], layout: str = "streaming") -> Iterable[int]:
    """The byte sizes of file_units(modules, layout), without building them (K3 has 82,432 expert units)."""
    run: list[ModulePlan] = []

    def flush() -> Iterable[int]:
        if run:
            yield from (o.nbytes for m in run for o in m.outputs if not o.streamed)
            experts = {m.source.experts for m in run}
            if len(experts) != 1:  # ragged layers: fall back to the exact units
                yield from (u.nbytes for u in file_units(run, layout))
            else:
                yield from [sum(o.nbytes // o.shape[0] for m in run for o in m.outputs if o.streamed)] * experts.pop()
            run.clear()

    for m in modules:
        streamable = layout == "streaming" and m.role is Role.ROUTED_EXPERT and m.source.experts
        if streamable and (not run or run[0].source.tname.layer == m.source.tname.layer):
            run.append(m)
            continue
        yield from flush()
        if streamable:
            run.append(m)
        else:
            yield from (o.nbytes for o in m.outputs)
    yield from flush()


def count_shards(sizes: Iterable[int], shard_size: int) -> int:
    """How many shards assign_shards makes of units of these sizes."""
    shards, used = 0, 0
    for n in sizes:
        if shards == 0 or (used and used + n > shard_size):
            shards += 1
            used = 0
        used += n
    return shards


def assign_shards(units: Iterable[Unit], shard_size: int) -> list[list[Unit]]:
    """Greedy split in order: a new shard when the next unit would pass `shard_size` (a larger unit gets a shard)."""
    shards: list[list[Unit]] = []
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

"""How planned output tensors are laid out in files: order, units that never split, and shards.

Two layouts:
- `streaming` (the default): each routed expert's tensors (gate, up, down: codes and scales) are stored back to back
  as per-expert tensors `<moe>.experts.E.<proj>.<param>`, so a runtime reads one expert with one read. Per-layer
  expert tensors that every expert shares (TurboQuant `codebook`, `signs`) stay resident and come first.
- `stacked`: the mlx-lm layout, one `<moe>.switch_mlp.<proj>_proj.<param>` tensor per layer and projection with a
  leading expert axis (an expert is then 6 ranges). This is the layout the published K3 shard count (186) describes.
A unit is what is never split across shards: one tensor, or one expert's tensors.

The modules laid out are any objects with the `OutputModule` attributes (the recipe's ModulePlan is one): this
package sits below the recipe and never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Iterator, Protocol, TypeVar

from tqbench.shards.header import TensorSpec

LAYOUTS = ("streaming", "stacked")
T = TypeVar("T")


class OutputModule(Protocol):
    """What the layout needs of one planned output module."""

    name: str
    outputs: tuple[TensorSpec, ...]  # stacked routed-expert outputs have a leading expert axis and `streamed`

    @property
    def layer(self) -> int | None: ...

    @property
    def experts(self) -> int: ...  # routed experts stacked in this module (0: not routed experts)

    def expert_name(self, expert: int | str) -> str: ...  # `<moe>.experts.E.<proj>`


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One output tensor in file order and what produces it: `module`'s output `param`, for one expert or all."""

    out: TensorSpec
    module: Any  # an OutputModule
    param: str  # weight, scales, biases, codebook, signs, bias, or the source tensor's name for copies
    expert: int | None = None  # per-expert piece of a routed-expert module


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    pieces: tuple[Piece, ...]
    layer: int | None = None
    expert: int | None = None  # set for one expert's pieces (streaming layout)

    @property
    def nbytes(self) -> int:
        return sum(p.out.nbytes for p in self.pieces)


def _param(module: OutputModule, out: TensorSpec) -> str:
    """The output's parameter name within its module (copied tensors keep their source name)."""
    prefix = module.name + "."
    return out.name[len(prefix):] if out.name.startswith(prefix) else out.name


def _groups(modules: Iterable[OutputModule], layout: str) -> Iterator[list[OutputModule]]:
    """Modules in file order, grouped: one layer's routed-expert modules together (streaming layout), any other
    module alone."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    run: list[OutputModule] = []
    for m in modules:
        if layout == "streaming" and m.experts:
            if run and run[0].layer != m.layer:
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


def _is_run(group: list[OutputModule]) -> bool:
    return bool(group[0].experts) and any(o.streamed for o in group[0].outputs)


def iter_units(modules: Iterable[OutputModule], layout: str = "streaming") -> Iterator[Unit]:
    """The units in file order, built one at a time (K3 has 82,432 expert units: a conversion never holds them all)."""
    for group in _groups(modules, layout):
        layer = group[0].layer
        if layout != "streaming" or not _is_run(group):
            yield from (Unit(pieces=(Piece(out=o, module=m, param=_param(m, o)),),
                             layer=layer) for m in group for o in m.outputs)
            continue
        # Per-layer tensors every expert shares come first, then each expert's tensors back to back.
        yield from (Unit(pieces=(Piece(out=o, module=m, param=_param(m, o)),),
                         layer=layer) for m in group for o in m.outputs if not o.streamed)
        for e in range(max(m.experts for m in group)):
            pieces = []
            for m in group:
                for o in m.outputs:
                    if o.streamed:
                        param = _param(m, o)
                        out = TensorSpec(name=f"{m.expert_name(e)}.{param}", dtype=o.dtype, shape=o.shape[1:],
                                         streamed=True)
                        pieces.append(Piece(out=out, module=m, param=param, expert=e))
            yield Unit(pieces=tuple(pieces), layer=layer, expert=e)


def file_units(modules: Iterable[OutputModule], layout: str = "streaming") -> list[Unit]:
    return list(iter_units(modules, layout))


def unit_sizes(modules: Iterable[OutputModule], layout: str = "streaming") -> Iterator[int]:
    """The byte sizes of file_units(modules, layout), without building them (K3 has 82,432 expert units)."""
    for group in _groups(modules, layout):
        experts = {m.experts for m in group}
        if layout != "streaming" or not _is_run(group) or len(experts) != 1:
            yield from (u.nbytes for u in file_units(group, layout))  # small, or ragged layers: the exact units
            continue
        yield from (o.nbytes for m in group for o in m.outputs if not o.streamed)
        yield from [sum(o.nbytes // o.shape[0] for m in group for o in m.outputs if o.streamed)] * experts.pop()


def count_shards(sizes: Iterable[int], shard_size: int) -> int:
    """How many shards assign_shards makes of units of these sizes."""
    return len(shard_counts(sizes, shard_size))


def shard_counts(sizes: Iterable[int], shard_size: int) -> list[int]:
    """Units per shard of assign_shards, from the units' sizes alone."""
    counts: list[int] = []
    used = 0
    for n in sizes:
        if not counts or (used and used + n > shard_size):
            counts.append(0)
            used = 0
        counts[-1] += 1
        used += n
    return counts


def split(units: Iterable[T], counts: Iterable[int]) -> Iterator[list[T]]:
    """Consecutive lists of `counts` items each: one shard's units at a time."""
    return (list(chunk) for chunk in chunks(units, counts))


def chunks(units: Iterable[T], counts: Iterable[int]) -> Iterator[Iterator[T]]:
    """Consecutive runs of `counts` items each, as iterators over one stream (consume each before the next: nothing
    is held, however many items a run has)."""
    it = iter(units)
    for n in counts:
        chunk = islice(it, n)
        yield chunk
        for _ in chunk:  # whatever the caller left unread
            pass


def assign_shards(units: Iterable[T], shard_size: int) -> list[list[T]]:
    """Greedy split in order of anything with `nbytes` (units, tensor specs): a new shard when the next one would
    pass `shard_size` (a larger one gets a shard of its own). The rule is shard_counts'."""
    units = list(units)
    return list(split(units, shard_counts((u.nbytes for u in units), shard_size)))

"""Per-layer totals of a conversion, counted from the engine's UnitConverted events (no Textual: counted on a worker
thread from every event, while the screen shows copies at most ~10 times a second).

Units (one tensor, or one routed expert) are counted against the layout's: those in shards an earlier run finished are
done already. Bytes and errors are this run's: the engine reports them per unit only for what it converts now. A unit's
error is its worst quantized module's relative error; a layer's mean and max are over its units that have one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence


@dataclass
class LayerStats:
    layer: int | None  # None: tensors outside the layers (embeddings, final norm, head)
    units: int  # units of this layer in the layout
    done: int = 0  # units done, earlier runs included
    bytes_in: int = 0  # source bytes read in this run
    bytes_out: int = 0  # bytes written in this run
    errors: int = 0  # units of this run with a relative error
    error_sum: float = 0.0
    error_max: float | None = None

    @property
    def error_mean(self) -> float | None:
        return self.error_sum / self.errors if self.errors else None

    def add(self, unit) -> None:
        """Count one tqbench.events.UnitConverted."""
        self.done += 1
        self.bytes_in += unit.bytes_in
        self.bytes_out += unit.bytes_out
        if unit.rel_error is not None:
            self.errors += 1
            self.error_sum += unit.rel_error
            self.error_max = unit.rel_error if self.error_max is None else max(self.error_max, unit.rel_error)


class Tally:
    """Per-layer LayerStats in the layout's order of first appearance."""

    def __init__(self, shards: Sequence[Sequence], finished: Sequence[bool]) -> None:
        """`shards`: the layout's units per output shard (tqbench.convert.Layout.shards); `finished`: per shard,
        whether an earlier run finished it."""
        self.layers: dict[int | None, LayerStats] = {}
        for units, done in zip(shards, finished):
            for u in units:
                stats = self.layers.get(u.layer)
                if stats is None:
                    stats = self.layers[u.layer] = LayerStats(u.layer, 0)
                stats.units += 1
                stats.done += bool(done)

    def add(self, unit) -> None:
        stats = self.layers.get(unit.layer)
        if stats is None:  # not in the layout given (never expected): still counted
            stats = self.layers[unit.layer] = LayerStats(unit.layer, 0)
        stats.add(unit)

    def snapshot(self) -> tuple[LayerStats, ...]:
        return tuple(replace(s) for s in self.layers.values())

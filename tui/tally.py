"""Per-layer totals of a conversion, counted from the engine's UnitConverted events (no Textual: counted on a worker
thread from every event, while the screen shows copies at most ~10 times a second).

Units (one tensor, or one routed expert) are counted against the layout's: those in shards an earlier run finished are
done already. Bytes are this run's (the engine reports them per unit only for what it converts now). Errors cover
every run: a resumed run's are seeded from ConvertStarted.resumed_errors (per layer, what the journal recorded for the
finished shards), then this run's units are added. A unit's error is its worst quantized module's relative error; a
layer's mean and max are over its units that have one, earlier runs' included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from tqbench.events import LayerErrors, UnitConverted


@dataclass(kw_only=True)
class LayerStats:
    layer: int | None  # None: tensors outside the layers (embeddings, final norm, head)
    units: int  # units of this layer in the layout
    done: int = 0  # units done, earlier runs included
    bytes_in: int = 0  # source bytes read in this run
    bytes_out: int = 0  # bytes written in this run
    errors: int = 0  # units with a relative error, earlier runs included
    error_sum: float = 0.0
    error_max: float | None = None

    @property
    def error_mean(self) -> float | None:
        return self.error_sum / self.errors if self.errors else None

    def add(self, unit: UnitConverted) -> None:
        """Count one tqbench.events.UnitConverted."""
        self.done += 1
        self.bytes_in += unit.bytes_in
        self.bytes_out += unit.bytes_out
        if unit.rel_error is not None:
            self.errors += 1
            self.error_sum += unit.rel_error
            self.error_max = unit.rel_error if self.error_max is None else max(self.error_max, unit.rel_error)

    def add_errors(self, earlier: LayerErrors) -> None:
        """Count the unit errors earlier runs recorded for this layer (their units are done already)."""
        if earlier.count:
            self.errors += earlier.count
            self.error_sum += earlier.total
            self.error_max = earlier.worst if self.error_max is None else max(self.error_max, earlier.worst)


class Tally:
    """Per-layer LayerStats in the layout's order of first appearance."""

    def __init__(self, layer_units: Sequence[Sequence[tuple[int | None, int]]], finished: Sequence[bool]) -> None:
        """`layer_units`: per output shard, (layer, units of that layer) in file order (tqbench.convert.Layout
        .layer_units); `finished`: per shard, whether an earlier run finished it."""
        self.layers: dict[int | None, LayerStats] = {}
        for counts, done in zip(layer_units, finished):
            for layer, n in counts:
                stats = self.layers.get(layer)
                if stats is None:
                    stats = self.layers[layer] = LayerStats(layer=layer, units=0)
                stats.units += n
                stats.done += n if done else 0

    def _stats(self, layer: int | None) -> LayerStats:
        stats = self.layers.get(layer)
        if stats is None:  # not in the layout given (never expected): still counted
            stats = self.layers[layer] = LayerStats(layer=layer, units=0)
        return stats

    def add(self, unit: UnitConverted) -> None:
        self._stats(unit.layer).add(unit)

    def seed(self, earlier: Sequence[LayerErrors]) -> None:
        """Start from the errors earlier runs recorded (tqbench.events.ConvertStarted.resumed_errors), once per run,
        before its first unit."""
        for e in earlier:
            self._stats(e.layer).add_errors(e)

    def snapshot(self) -> tuple[LayerStats, ...]:
        return tuple(replace(s) for s in self.layers.values())

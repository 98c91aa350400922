"""Swapping a loaded model's routed experts for streamed ones, before their stacked arrays are ever evaluated."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tqbench.layout.names import mlx_module_path
from tqbench.stream.store import ExpertStore, StoreError
from tqbench.stream.streamer import Streamer


class _Hidden:
    """Holds objects out of the module tree (parameters(), update(), eval never see them)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class StreamedExperts(nn.Module):
    """Takes the place of a MoE layer's SwitchGLU: the same SwitchGLU, called on slots the streamer filled."""

    def __init__(self, layer: int, inner: nn.Module, streamer: Streamer):
        super().__init__()
        self.layer = layer
        self._hidden = _Hidden(inner=inner, streamer=streamer)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        h = self._hidden
        return h.streamer.run(self.layer, h.inner, x, indices)


def attach(model: nn.Module, streamer: Streamer) -> list[str]:
    """Replace every streamed layer's `switch_mlp` with StreamedExperts whose projections read the streamer's pools.
    Returns the replaced module paths. Raises StoreError when a layer's module is not in the model."""
    modules = dict(model.named_modules())
    store: ExpertStore = streamer.store
    new = []
    for n, lay in sorted(store.layers.items()):
        candidates = (mlx_module_path(f"{lay.module}.switch_mlp"), f"{lay.module}.switch_mlp")
        path = next((p for p in candidates if p in modules), None)
        if path is None:
            raise StoreError(f"layer {n}: the model has no {candidates[0]} to stream", store.root)
        inner = modules[path]
        pool = streamer.pool_of[n]
        for part in lay.parts:
            proj = getattr(inner, part.projection, None)
            if proj is None or part.param not in proj:
                raise StoreError(f"layer {n}: {path}.{part.projection} has no {part.param!r} to stream", store.root)
            setattr(proj, part.param, pool.arrays[(part.projection, part.param)])
        new.append((path, StreamedExperts(n, inner, streamer)))
    model.update_modules(_tree(new))
    return [p for p, _ in new]


def _tree(pairs: list[tuple[str, nn.Module]]) -> dict:
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)

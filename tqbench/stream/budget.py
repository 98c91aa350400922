"""The expert cache's byte budget: given (`--cache-budget-gb N`) or `auto`, computed as `tqbench plan` computes it:
the machine's GPU working-set limit minus the resident (non-expert) bytes minus the runtime + KV reserve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqbench.recipe.fit import RESERVE, machine


@dataclass(frozen=True)
class ModelBytes:
    total: int  # the safetensors files
    experts: int  # every routed expert's bytes
    one_expert: int  # the largest expert

    @property
    def resident(self) -> int:
        return self.total - self.experts


def model_bytes(path: str | Path, store: Any = None) -> ModelBytes:
    """From tqbench's expert map, else from a stacked layout's headers (tqbench.stream.ExpertStore.open); `store`:
    the model's ExpertStore when the caller has it open."""
    from tqbench.stream.store import ExpertStore

    if store is None:
        store = ExpertStore.open(Path(path))
        store.close()
    total = sum((store.root / f).stat().st_size for f in store.files)
    layers = store.layers.values()
    return ModelBytes(total, sum(lay.nbytes * lay.experts for lay in layers), max(lay.nbytes for lay in layers))


def auto_budget(path: str | Path, gpu_limit: int | None = None, store: Any = None) -> int:
    """limit - resident bytes - reserve, at most every expert's bytes (a cache larger than the model is pointless)."""
    mb = model_bytes(path, store)
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return max(0, min(limit - mb.resident - RESERVE, mb.experts + 16 * mb.one_expert))


def needs_streaming(path: str | Path, gpu_limit: int | None = None, store: Any = None) -> bool:
    """Whether the whole model plus the reserve exceeds the GPU working-set limit (then it must stream)."""
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return model_bytes(path, store).total + RESERVE > limit

"""The expert cache's byte budget: given (`--cache-budget-gb N`) or `auto`, computed as `tqbench plan` computes it:
the machine's GPU working-set limit minus the resident (non-expert) bytes minus the runtime + KV reserve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqbench.layout.expert_map import ExpertMap
from tqbench.recipe.fit import RESERVE, machine


@dataclass(frozen=True)
class ModelBytes:
    total: int  # the safetensors files
    experts: int  # every routed expert's bytes
    one_expert: int  # the largest expert

    @property
    def resident(self) -> int:
        return self.total - self.experts


def model_bytes(path: str | Path) -> ModelBytes:
    root = Path(path)
    em = ExpertMap.load(root)
    total = sum((root / f).stat().st_size for f in em.files)
    experts = sum(lay.length * lay.experts for lay in em.layers.values())
    return ModelBytes(total, experts, max((lay.length for lay in em.layers.values()), default=0))


def auto_budget(path: str | Path, gpu_limit: int | None = None) -> int:
    """limit - resident bytes - reserve, at most every expert's bytes (a cache larger than the model is pointless)."""
    mb = model_bytes(path)
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return max(0, min(limit - mb.resident - RESERVE, mb.experts + 16 * mb.one_expert))


def needs_streaming(path: str | Path, gpu_limit: int | None = None) -> bool:
    """Whether the whole model plus the reserve exceeds the GPU working-set limit (then it must stream)."""
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return model_bytes(path).total + RESERVE > limit

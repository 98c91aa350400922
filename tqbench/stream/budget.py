"""The expert cache's byte budget: given (`--cache-budget-gb N`) or `auto`, computed as `tqbench plan` computes it:
the machine's GPU working-set limit minus the resident (non-expert) bytes minus the runtime + KV reserve. And the
host-RAM tier's (`--host-cache-gb N|auto`): auto is the memory free now minus a reserve, on CUDA only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqbench.machine import machine
from tqbench.recipe.fit import RESERVE


@dataclass(frozen=True, kw_only=True)
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
    return ModelBytes(total=total, experts=sum(lay.nbytes * lay.experts for lay in layers),
                      one_expert=max(lay.nbytes for lay in layers))


def auto_budget(path: str | Path, gpu_limit: int | None = None, store: Any = None) -> int:
    """limit - resident bytes - reserve, at most every expert's bytes (a cache larger than the model is pointless)."""
    mb = model_bytes(path, store)
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return max(0, min(limit - mb.resident - RESERVE, mb.experts + 16 * mb.one_expert))


HOST_RESERVE = 8 * 10**9  # auto leaves this much of the free memory (or a tenth of RAM, if more) to everything else


@dataclass(frozen=True, kw_only=True)
class HostTierPlan:
    nbytes: int  # 0: no host tier
    why: str  # "asked", "asked on unified memory", "auto", "off", "unified memory" (auto there: one tier), "nothing
    # left" (the GPU budget holds every expert), "no room" (auto: the free memory is below the reserve)


def host_tier_plan(asked: str | int, path: str | Path, gpu_budget: int, store: Any = None,
                   unified: bool | None = None, available: int | None = None) -> HostTierPlan:
    """The host tier's bytes for `asked` (`auto`, `off` or bytes: tqbench.chat.request.parse_host_cache). A size is
    taken as asked, also on unified memory (a second copy in the same RAM: the faces say so); auto, on CUDA: the
    memory available now minus the reserve, at most the experts the GPU budget leaves out, so it never pushes the
    machine into swap."""
    if asked == "off":
        return HostTierPlan(nbytes=0, why="off")
    if unified is None:
        from tqbench.managed import on_cuda

        unified = not on_cuda()
    if asked != "auto":
        return HostTierPlan(nbytes=int(asked), why="asked on unified memory" if unified else "asked")
    if unified:
        return HostTierPlan(nbytes=0, why="unified memory")
    from tqbench.machine import physical_memory

    mb = model_bytes(path, store)
    left = mb.experts - gpu_budget
    if left < mb.one_expert:
        return HostTierPlan(nbytes=0, why="nothing left")
    free = (available if available is not None else available_memory()) - max(HOST_RESERVE, physical_memory() // 10)
    if free < mb.one_expert:
        return HostTierPlan(nbytes=0, why="no room")
    return HostTierPlan(nbytes=min(free, left + mb.one_expert), why="auto")


def available_memory() -> int:
    """Bytes the OS can give now without swapping (Linux: MemAvailable; elsewhere half of physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    from tqbench.machine import physical_memory

    return physical_memory() // 2


def needs_streaming(path: str | Path, gpu_limit: int | None = None, store: Any = None) -> bool:
    """Whether the whole model plus the reserve exceeds the GPU working-set limit (then it must stream)."""
    limit = gpu_limit if gpu_limit is not None else machine().gpu_limit_bytes
    return model_bytes(path, store).total + RESERVE > limit

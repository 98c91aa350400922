"""The records a chat's events carry and its calls return (all frozen, plain values; `to_dict()` where a face prints
JSON). The events themselves are in tqbench.chat.events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # named only: importing them loads MLX
    from tqbench.events import ReplyDone
    from tqbench.machine import DiskSpeed


@dataclass(frozen=True, kw_only=True)
class StreamSetup:
    """How a streamed model's routed experts run: the cache the budget bought, the readers, this disk's speed."""

    budget_bytes: int
    slots: int
    slot_bytes: int
    staging_bytes: int
    workers: int
    policy: str
    fanout: bool
    page_cache: str  # "on" or "off" as decided ("auto" resolved by the streamer)
    lookahead: bool
    reads_in_flight: int
    disk: DiskSpeed | None  # the disk holding the model: measured once per disk (tqbench.recipe.fit), None unknown
    layers: tuple[tuple[int, int], ...]  # (MoE layer, routed experts) of every streamed layer
    why: str  # why the experts stream: "asked" or "does not fit"
    host_budget_bytes: int = 0  # the host-RAM tier under the cache (0: none)
    host_slots: int = 0
    host_why: str = "off"  # tqbench.stream.budget.HostTierPlan.why
    cache_routing: float = 0.0  # decode favours cached experts within this margin (0: off); the output changes
    layer_major_tokens: int = 0  # long prompts run layer by layer, each expert read once per this many tokens (0: no)

    @property
    def disk_bytes_per_s(self) -> float | None:
        return self.disk.bytes_per_s if self.disk else None

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "slots": self.slots, "slot_bytes": self.slot_bytes,
                "staging_bytes": self.staging_bytes, "workers": self.workers, "policy": self.policy,
                "fanout": self.fanout, "page_cache": self.page_cache, "lookahead": self.lookahead,
                "reads_in_flight": self.reads_in_flight, "host_budget_bytes": self.host_budget_bytes,
                "host_slots": self.host_slots, "host_why": self.host_why, "cache_routing": self.cache_routing,
                "why": self.why, "layer_major_tokens": self.layer_major_tokens, **disk_fields(self.disk)}


@dataclass(frozen=True, kw_only=True)
class ProfileInfo:
    """What opening the model decided about the hot-expert profile (tqbench.profile.choose)."""

    source: str  # "file", "learned", "shipped" or "none"
    where: str  # the file, the store, or "cold" / "" for none
    fingerprint: str
    routings: int  # of the profile started from (0: none)
    pinned: int  # experts pinned and preloaded from it (streaming only)
    preload_s: float
    learning: bool  # this session adds its routings to the learned profile

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "where": self.where, "fingerprint": self.fingerprint,
                "routings": self.routings, "pinned": self.pinned, "preload_s": round(self.preload_s, 3),
                "learning": self.learning}


@dataclass(frozen=True, kw_only=True)
class ConversationStatus:
    turns: int  # replies since the last reset
    tokens: int  # tokens the conversation's cache holds
    last: ReplyDone | None


@dataclass(frozen=True, kw_only=True)
class ProfileExport:
    file: str
    routings: float
    sessions: int
    pins: int


def disk_fields(disk: DiskSpeed | None) -> dict[str, Any]:
    return {"disk_bytes_per_s": disk.bytes_per_s if disk else None, "disk_source": disk.source if disk else None}

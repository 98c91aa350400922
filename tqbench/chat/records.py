"""The typed records a chat hands its faces (all frozen, plain values; `to_dict()` where a face prints JSON)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqbench.distributed.world import RankStats

if TYPE_CHECKING:  # named only: importing them loads MLX
    from tqbench.recipe.fit import DiskSpeed
    from tqbench.runtime.chat import ReplyDone, Sampling
    from tqbench.stream.stats import StreamStats


@dataclass(frozen=True)
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

    @property
    def disk_bytes_per_s(self) -> float | None:
        return self.disk.bytes_per_s if self.disk else None

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "slots": self.slots, "slot_bytes": self.slot_bytes,
                "staging_bytes": self.staging_bytes, "workers": self.workers, "policy": self.policy,
                "fanout": self.fanout, "page_cache": self.page_cache, "lookahead": self.lookahead,
                "reads_in_flight": self.reads_in_flight, "host_budget_bytes": self.host_budget_bytes,
                "host_slots": self.host_slots, "host_why": self.host_why, "cache_routing": self.cache_routing,
                **disk_fields(self.disk)}


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class ModelLoaded:
    path: str
    model_type: str
    turboquant_modules: int
    weight_bytes: int  # the resident parameters as held in memory
    chat_template: bool  # False: a base model, turns are plain text
    sampling: Sampling  # defaults from generation_config.json and the user's options
    seconds: float
    stream: StreamSetup | None = None  # None: the experts are resident
    experts_native: int = 0  # routed experts per token as trained (0: not a MoE model we route)
    experts_active: int = 0  # as run (--max-active-experts; 0: not changed)
    profile: ProfileInfo | None = None  # None: no routed experts to profile

    @property
    def fewer_experts(self) -> bool:
        """Routing to fewer experts than the model was trained with."""
        return bool(self.experts_active) and self.experts_active != self.experts_native

    @property
    def far_fewer_experts(self) -> bool:
        """More than a 2x cut of the experts per token: answers get worse (both faces warn)."""
        return bool(self.experts_active) and self.experts_native > 2 * self.experts_active


@dataclass(frozen=True)
class StreamReport:
    """Streaming totals and per-layer figures after a reply, with this disk's measured read bandwidth and the
    bandwidth the page-ins got (bytes read on the critical path over the time waited for them)."""

    stats: StreamStats  # a copy: the streamer's own keeps counting
    disk: DiskSpeed | None
    profile: ProfileInfo | None
    learned_routings: int | None = None  # this session's routings added to the learned profile; None: not learning
    ranks: tuple[RankStats, ...] = ()  # every pipeline rank's, after the last reply (one process: none)

    @classmethod
    def snapshot(cls, stats: StreamStats, disk: DiskSpeed | None, profile: ProfileInfo | None,
                 learned_routings: int | None = None, ranks: tuple[RankStats, ...] = ()) -> StreamReport:
        return cls(copy.deepcopy(stats), disk, profile, learned_routings, ranks)

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate()

    @property
    def disk_bytes_per_s_on_misses(self) -> float | None:
        s = self.stats
        return s.critical_bytes / s.stall_s if s.stall_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """`--stats-json`'s document."""
        d = self.stats.to_dict()
        on_misses = d["critical_bytes"] / d["stall_s"] if d["stall_s"] > 0 else None  # as the document rounds it
        return {**d, **disk_fields(self.disk), "disk_bytes_per_s_on_misses": on_misses,
                "profile": self.profile.to_dict() if self.profile else None, "learned_routings": self.learned_routings,
                **({"ranks": [r.to_dict() for r in self.ranks]} if self.ranks else {})}


@dataclass(frozen=True)
class ConversationStatus:
    turns: int  # replies since the last reset
    tokens: int  # tokens the conversation's cache holds
    last: ReplyDone | None


@dataclass(frozen=True)
class ProfileExport:
    file: str
    routings: float
    sessions: int
    pins: int


def disk_fields(disk: DiskSpeed | None) -> dict[str, Any]:
    return {"disk_bytes_per_s": disk.bytes_per_s if disk else None, "disk_source": disk.source if disk else None}


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made, parsed by mlx-lm's tool parser for the model's format."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass(frozen=True)
class CompletionDelta:
    """A completion's new text after one token, split as the model's markers say: the answer, its reasoning, and the
    tool calls that closed with this token. All may be empty (text held back: it may be a marker or a stop string)."""

    token: int
    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class CompletionDone:
    """A completion's end: the whole answer split as its deltas were, why it ended (OpenAI's finish_reason: "stop",
    "length", "tool_calls", or "cancelled" when the caller stopped it) and the reply's figures."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    reply: ReplyDone

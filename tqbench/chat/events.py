"""Every event a chat's jobs yield, and the closed union each kind of job yields: a face takes them from here and
dispatches on one `match` (tqbench.chat.session.ChatSession's jobs are typed with these unions).

- `open`: `OpenEvent`: the demo's conversion first when no model is named and none was converted (ConvertStarted,
  UnitConverted, ...), ModelChosen, StreamPlan, KernelsCompiling (CUDA), ModelLoaded;
- `reply`: `ReplyEvent`: ReplyStarted, PageIn (streaming, one per MoE layer of each forward pass), MlxWarmup and
  MlxWarmedUp (the process's first forward pass on CUDA), PrefillProgress (the prompt's chunks), TokenOut,
  ReplyDone;
- `complete` (a server's request): `CompletionEvent`: as a reply, with CompletionDelta and CompletionDone for the
  tokens and the end, then StreamReport (streaming);
- `follow` (a rank other than 0): ReplyDone per turn.

The chat's own events are defined here; those made below the chat (by the streamer, the generation loop, the warm-up)
are defined in tqbench.events and named here again, so that every chat event has one import.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tqbench.chat.records import ProfileInfo, StreamSetup, disk_fields
from tqbench.events import (CompletionDelta, CompletionDone, ConvertEvent, ConvertFinished, ConvertStarted,
                            KernelsCompiling, MlxWarmedUp, MlxWarmup, ModelChosen, PageIn, PrefillProgress, ReplyDone,
                            ReplyStarted, ShardWritten, SourceProgress, SourceRemoved, TokenLogprob, TokenOut, ToolCall,
                            TopLogprob, UnitConverted)

if TYPE_CHECKING:  # named only: importing them loads MLX
    from tqbench.distributed.world import RankStats
    from tqbench.machine import DiskSpeed
    from tqbench.runtime.conversation import Sampling
    from tqbench.stream.stats import StreamStats
    from tqbench.stream.store import ExpertStore
    from tqbench.stream.streamer import StreamConfig

__all__ = ["ChatEvent", "CompletionDelta", "CompletionDone", "CompletionEvent", "ConvertEvent", "ConvertFinished",
           "ConvertStarted", "KernelsCompiling", "MlxWarmedUp", "MlxWarmup", "ModelChosen", "ModelLoaded", "OpenEvent",
           "PageIn", "PrefillProgress", "ReplyDone", "ReplyEvent", "ReplyStarted", "ShardWritten", "SourceProgress",
           "SourceRemoved",
           "StreamPlan", "StreamReport", "TokenLogprob", "TokenOut", "ToolCall", "TopLogprob", "UnitConverted"]


@dataclass(frozen=True, kw_only=True)
class StreamPlan:
    """What `open` will run, decided from the request and the model's files: `config` None keeps the experts
    resident. `reason`: "off" (asked), "fits", "no routed experts", "asked" or "does not fit"."""

    config: StreamConfig | None
    reason: str
    host_why: str = "off"  # why the host-RAM tier has the size it has (tqbench.stream.budget.HostTierPlan.why)
    # the routed experts' layout the plan read (closed; None: none read): loading streams from it, never reads it again
    store: ExpertStore | None = field(default=None, repr=False, compare=False)

    @property
    def note(self) -> str | None:
        """A line for the user when the engine chose to stream unasked."""
        if self.reason == "does not fit":
            return "the model does not fit in memory: streaming its experts from disk (cache budget auto)"
        return None


@dataclass(frozen=True, kw_only=True)
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

    @property
    def routing_changed(self) -> bool:
        """Routed otherwise than the model was trained to: fewer experts, or cache-aware routing on."""
        return self.fewer_experts or bool(self.stream is not None and self.stream.cache_routing)

    def to_dict(self) -> dict[str, Any]:
        """`chat --json`'s first record: what runs."""
        return {"event": "loaded", "path": self.path, "model_type": self.model_type,
                "turboquant_modules": self.turboquant_modules, "weight_bytes": self.weight_bytes,
                "chat_template": self.chat_template, "sampling": asdict(self.sampling),
                "seconds": round(self.seconds, 3), "experts_native": self.experts_native,
                "experts_active": self.experts_active, "routing_changed": self.routing_changed,
                "stream": self.stream.to_dict() if self.stream is not None else None,
                "profile": self.profile.to_dict() if self.profile is not None else None}


@dataclass(frozen=True, kw_only=True)
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
        return cls(stats=copy.deepcopy(stats), disk=disk, profile=profile, learned_routings=learned_routings,
                   ranks=ranks)

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


OpenEvent = ConvertEvent | ModelChosen | StreamPlan | KernelsCompiling | ModelLoaded
ReplyEvent = ReplyStarted | PageIn | MlxWarmup | MlxWarmedUp | PrefillProgress | TokenOut | ReplyDone
CompletionEvent = (ReplyStarted | PageIn | MlxWarmup | MlxWarmedUp | PrefillProgress | CompletionDelta
                   | CompletionDone | StreamReport)
ChatEvent = OpenEvent | ReplyEvent | CompletionEvent

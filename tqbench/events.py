"""Events the engine yields to its faces. All are frozen dataclasses holding plain values (no lazy MLX arrays).

The CLI renders them with rich; the TUI's thread workers post them as Textual messages. This module holds the
opening and conversion events; the others live beside what yields them: a chat's in tqbench.runtime.models
(ModelChosen), tqbench.chat.session (StreamPlan), tqbench.chat.records (ModelLoaded and the summaries),
tqbench.runtime.chat (ReplyStarted, TokenOut, ReplyDone) and tqbench.stream.stats (PageIn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShardScanned:
    """One shard header read while opening a checkpoint."""

    index: int  # 1-based
    total: int
    file: str
    tensors: int
    fetched_bytes: int = 0  # from the hub so far, opening a hub checkpoint (0: read from disk or cache)


@dataclass(frozen=True)
class CheckpointOpened:
    """Opening finished; `checkpoint` is a tqbench.source.Checkpoint (immutable)."""

    checkpoint: Any


@dataclass(frozen=True)
class LayerErrors:
    """Relative errors of one layer's converted units: `count` units with an error, their sum and maximum (a unit's
    error is its worst quantized module's)."""

    layer: int | None  # None: tensors outside the layers
    count: int
    total: float
    worst: float


@dataclass(frozen=True)
class ConvertStarted:
    source: str
    dest: str
    recipe: str
    shards: int
    units: int
    bytes_in: int  # source bytes the conversion reads
    bytes_out: int  # bytes of the shard files it writes: tensors + headers (the ShardWritten sizes add up to it)
    tensor_bytes: int  # of which tensor data: exactly `tqbench plan`'s total
    resumed_shards: int  # shards already finished by an earlier run
    resumed_bytes_in: int
    resumed_errors: tuple[LayerErrors, ...] = ()  # per layer, what the earlier runs' finished shards recorded


@dataclass(frozen=True)
class UnitConverted:
    """One tensor, or one routed expert (all its projections), converted. Rate and ETA cover this run."""

    name: str  # the first output tensor of the unit
    layer: int | None
    expert: int | None
    bytes_in: int
    bytes_out: int
    rel_error: float | None  # worst relative error among the unit's quantized modules
    done_in: int  # source bytes done, earlier runs included
    total_in: int
    elapsed: float  # seconds in this run
    rate: float  # source bytes per second in this run
    eta: float | None  # seconds left


@dataclass(frozen=True)
class SourceProgress:
    """A conversion streaming its source from the hub: shards downloading ahead of the conversion, and the source
    bytes tqbench holds on disk (downloaded, not yet removed)."""

    file: str  # the shard downloading now ("" when none is)
    downloaded: int  # bytes downloaded in this run, all shards
    to_download: int  # bytes this run downloads, all shards
    rate: float  # download bytes per second in this run
    on_disk: int  # source bytes tqbench downloaded that are on disk now
    waiting: bool  # the conversion is waiting for this download

    @property
    def eta(self) -> float | None:
        return (self.to_download - self.downloaded) / self.rate if self.rate > 0 else None

    @property
    def now(self) -> str:
        """What the downloads are doing, in words every face shows."""
        if self.file:
            return self.file + (" (the conversion waits for it)" if self.waiting else "")
        if self.downloaded >= self.to_download:
            return "all downloaded"
        return "next download waits until a converted shard is removed"


@dataclass(frozen=True)
class SourceRemoved:
    """A downloaded source shard deleted: every tensor it holds is converted and written durably."""

    file: str
    bytes: int
    on_disk: int  # source bytes tqbench downloaded that are still on disk


@dataclass(frozen=True)
class ShardWritten:
    index: int  # 1-based
    total: int
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ConvertFinished:
    dest: str
    seconds: float
    bytes_in: int
    bytes_out: int  # shard files: tensors + headers
    shards: int
    mean_rel_error: float | None
    max_rel_error: float | None

"""Events the engine yields to its faces. All are frozen dataclasses holding plain values (no lazy MLX arrays).

The CLI renders them with rich; the TUI's thread workers post them as Textual messages. Later features (conversion,
streaming, chat) add their events here so every face reads one vocabulary.
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


@dataclass(frozen=True)
class CheckpointOpened:
    """Opening finished; `checkpoint` is a tqbench.source.Checkpoint (immutable)."""

    checkpoint: Any

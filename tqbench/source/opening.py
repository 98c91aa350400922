"""Opening a checkpoint from what a user typed: a directory, or a hub repository `owner/name[@revision]`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tqbench.events import CheckpointOpened, ShardScanned
from tqbench.source.checkpoint import Checkpoint, scan_directory
from tqbench.source.hub.ref import hub_ref


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's config and headers. Raises CheckpointError (one line, naming the file) on bad input."""
    for event in scan_checkpoint(path):
        if isinstance(event, CheckpointOpened):
            return event.checkpoint
    raise AssertionError("scan_checkpoint ended without a checkpoint")


def scan_checkpoint(path: str | Path) -> Iterator[ShardScanned | CheckpointOpened]:
    """Like open_checkpoint, yielding a ShardScanned event per shard and finally CheckpointOpened. A path that names
    no local file and reads as `owner/name[@revision]` is a hub repository: its headers come by range requests."""
    ref = hub_ref(path)
    if ref is None:
        return scan_directory(path)
    from tqbench.source.hub.scan import scan_hub

    return scan_hub(ref)

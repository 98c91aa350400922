"""The disk a conversion straight from the hub needs: the output, plus at most `WINDOW` source shards at once (each
is removed once converted), checked against free space before anything is downloaded."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqbench import units
from tqbench.errors import TqbenchError
from tqbench.source.hub.client import HubFile, Snapshot, cached_file, hf_cache
from tqbench.source.checkpoint import Checkpoint

WINDOW = 2  # downloaded source shards on disk at once: the one being converted and the next


def snapshot_of(ckpt: Checkpoint) -> Snapshot:
    """The hub commit a checkpoint was opened from, listing its shards."""
    o = ckpt.origin
    return Snapshot(repo_id=o.repo_id, revision=o.revision, commit=o.commit, endpoint=o.endpoint,
                    files=tuple(HubFile(name=s.file, size=s.file_size) for s in ckpt.shards))


def _to_fetch(ckpt: Checkpoint) -> list[int]:
    """Sizes of the shards not in the Hugging Face cache yet, largest first."""
    snap = snapshot_of(ckpt)
    return sorted((s.file_size for s in ckpt.shards if cached_file(snap, s.file) is None), reverse=True)


@dataclass(frozen=True, kw_only=True)
class HubDisk:
    """What `plan` says about converting a hub checkpoint: the source shards on disk at once, and the room there."""

    window: int  # downloaded source bytes on disk at once, at most (the WINDOW largest shards not yet cached)
    free: int  # free bytes where they download (the Hugging Face cache's filesystem)
    cache_dir: str


def hub_disk(ckpt: Checkpoint) -> HubDisk:
    cache = hf_cache()
    return HubDisk(window=sum(_to_fetch(ckpt)[:WINDOW]), free=shutil.disk_usage(_existing(cache)).free,
                   cache_dir=str(cache))


@dataclass(frozen=True, kw_only=True)
class DiskNeed:
    """Free space a conversion from the hub needs before it starts."""

    output: int  # the output's bytes still to write
    source: int  # downloaded source bytes on disk at once, at most: the `WINDOW` largest shards still to fetch
    output_dir: str
    cache_dir: str
    same_disk: bool  # output and Hugging Face cache share a filesystem

    @property
    def total(self) -> int:
        return self.output + self.source


def disk_need(ckpt: Checkpoint, output_bytes: int, output_dir: Path, cache_dir: Path, keep_source: bool) -> DiskNeed:
    sizes = _to_fetch(ckpt)
    source = sum(sizes if keep_source else sizes[:WINDOW])
    out, cache = _existing(output_dir), _existing(cache_dir)
    return DiskNeed(output=output_bytes, source=source, output_dir=str(output_dir), cache_dir=str(cache_dir),
                    same_disk=os.stat(out).st_dev == os.stat(cache).st_dev)


def check_free(need: DiskNeed) -> None:
    """Refuse, in one line, a conversion the disk cannot hold."""
    out_free = shutil.disk_usage(_existing(Path(need.output_dir))).free
    if need.same_disk:
        if out_free < need.total:
            raise TqbenchError(f"needs {units.size(need.total)} free (output {units.size(need.output)} + source "
                               f"shards {units.size(need.source)} at once), {units.size(out_free)} free",
                               need.output_dir)
        return
    if out_free < need.output:
        raise TqbenchError(f"needs {units.size(need.output)} free for the output, {units.size(out_free)} free",
                           need.output_dir)
    cache_free = shutil.disk_usage(_existing(Path(need.cache_dir))).free
    if cache_free < need.source:
        raise TqbenchError(f"needs {units.size(need.source)} free for source shards at once, "
                           f"{units.size(cache_free)} free", need.cache_dir)


def _existing(path: Path) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p



"""Opening a hub checkpoint as tqbench opens a directory: the same Checkpoint, read from the commit's config and
shard headers without a byte of tensor data. Shards already in the Hugging Face cache are read from disk.

The shard list comes from the repository's file listing when that is one complete `NNNNN-of-MMMMM` series (K3's
index names 497k tensors, 59 MB, to say only which of those files holds each: the headers say it too); otherwise
the index is downloaded and read as for a directory."""

from __future__ import annotations

import re
from typing import Iterator

from tqbench.events import CheckpointOpened, ShardScanned
from tqbench.source.hub.client import HubError, Snapshot, cached_file, download, resolve
from tqbench.source.hub.headers import file_head, remote_headers
from tqbench.source.hub.ref import HubRef
from tqbench.errors import CheckpointError
from tqbench.shards.header import INDEX_FILE, ShardHeader, parse_header, read_header
from tqbench.source.checkpoint import HubOrigin, MissingShard, assemble
from tqbench.source.config import read_config
from tqbench.source.index import read_index

_SERIES = re.compile(r"(?P<stem>.+)-(?P<n>\d+)-of-(?P<total>\d+)\.safetensors")


def scan_hub(ref: HubRef) -> Iterator[ShardScanned | CheckpointOpened]:
    try:
        snap = resolve(ref)
    except HubError as e:  # the name may be a mistyped directory too: say both
        raise HubError(f"no such directory; as a hub repository: {e.message}", e.path) from None
    fetched = [0]

    def small(name: str):
        """A small file of the commit, from the Hugging Face cache or downloaded into it (counted)."""
        path = cached_file(snap, name)
        if path is None:
            path = download(snap, name)
            fetched[0] += path.stat().st_size
        return path

    if snap.size("config.json") is None:
        raise CheckpointError("no config.json: not a model repository", snap.where())
    root = small("config.json").parent
    config = read_config(root)
    files = series(snap)
    index_total = None
    if files is not None and snap.size(INDEX_FILE):
        index_total = _index_total(snap, fetched)
    if files is None:
        if snap.size(INDEX_FILE) is not None:
            small(INDEX_FILE)
            index = read_index(root)
            files, index_total = sorted(index.files), index.total_size
        else:
            files = sorted(f.name for f in snap.files if f.name.endswith(".safetensors") and "/" not in f.name)
        if not files:
            raise CheckpointError("no *.safetensors files: not a model checkpoint", snap.where())
    counts = {"cached": 0, "local": 0}

    def headers() -> Iterator[ShardHeader | MissingShard]:
        local = {f: p for f in files if (p := cached_file(snap, f)) is not None}
        remote = remote_headers(snap, [f for f in files if f not in local])
        for f in files:
            if f in local:
                counts["local"] += 1
                yield read_header(local[f], f)
                continue
            h = next(remote)
            counts["cached"] += h.fetched == 0
            fetched[0] += h.fetched
            yield parse_header(h.raw, h.size, root / f, f, snap.where(f))

    def origin() -> HubOrigin:
        return HubOrigin(repo_id=snap.repo_id, revision=snap.revision, commit=snap.commit, endpoint=snap.endpoint,
                         fetched_bytes=fetched[0], headers_cached=counts["cached"], shards_local=counts["local"])

    yield from assemble(root, config, headers(), count=len(files), index_total_size=index_total, origin=origin,
                        fetched=lambda: fetched[0], where=snap.where())


_TOTAL = re.compile(rb'"total_size"\s*:\s*(\d+)')
_INDEX_HEAD = 4096  # an index's metadata comes before its weight_map: its first few KB


def _index_total(snap: Snapshot, fetched: list[int]) -> int | None:
    """`metadata.total_size` of the index, from its first few KB (what a directory's report shows; the rest of it,
    the weight_map, is not needed)."""
    head = file_head(snap, INDEX_FILE, min(_INDEX_HEAD, snap.size(INDEX_FILE)))
    fetched[0] += head.fetched
    m = _TOTAL.search(head.raw.split(b'"weight_map"', 1)[0])
    return int(m[1]) if m else None


def series(snap: Snapshot) -> list[str] | None:
    """The top-level shard files when they are exactly one complete `stem-NNNNN-of-MMMMM.safetensors` series and
    nothing else; None otherwise."""
    names = [f.name for f in snap.files if f.name.endswith(".safetensors")]
    found = [m for n in names if (m := _SERIES.fullmatch(n)) and "/" not in n]
    if not found or len(found) != len(names):
        return None
    stems, totals = {m["stem"] for m in found}, {int(m["total"]) for m in found}
    numbers = sorted(int(m["n"]) for m in found)
    if len(stems) != 1 or len(totals) != 1 or numbers != list(range(1, totals.pop() + 1)):
        return None
    return sorted(names)

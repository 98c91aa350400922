"""Shard headers of a hub checkpoint, read with two range requests each (the 8-byte length, then the JSON) and kept
in tqbench's cache by commit: a commit never changes, so a header fetched once is never fetched again.

Requests run on helper threads (bytes only, no MLX); the cache is touched on the caller's thread alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

from tqbench.source.hub.client import Snapshot, read_range
from tqbench.paths import cache_dir
from tqbench.shards.header import header_size

WORKERS = 8  # requests in flight: the hub answers each in one round trip, so latency, not bandwidth, bounds this


@dataclass(frozen=True, kw_only=True)
class RemoteHeader:
    file: str
    size: int  # the file's size, as the hub lists it
    raw: bytes  # the JSON header (after the 8-byte length)
    fetched: int  # bytes this call fetched for it (0: from the cache)


def _key(snap: Snapshot, file: str) -> str:
    return f"{snap.endpoint}|{snap.repo_id}|{snap.commit}|{file}"


def remote_headers(snap: Snapshot, files: Iterable[str]) -> Iterator[RemoteHeader]:
    """Each file's header, in the order given: from the cache, else from the hub (then cached)."""
    from diskcache import Cache

    files = list(files)
    with Cache(str(cache_dir() / "hub-headers")) as cache:
        missing = [f for f in files if _key(snap, f) not in cache]
        with ThreadPoolExecutor(min(WORKERS, len(missing)) or 1, thread_name_prefix="tqbench-hub") as pool:
            pending = {f: pool.submit(_fetch, snap, f) for f in missing}
            try:
                for f in files:
                    raw = cache.get(_key(snap, f)) if f not in pending else None  # one at a time: K3's are 75 MB
                    if raw is not None:
                        yield RemoteHeader(file=f, size=snap.size(f) or 0, raw=raw, fetched=0)
                        continue
                    # fetched ahead, or (rarely) evicted from the cache since it was looked up: fetched now
                    header = pending.pop(f).result() if f in pending else _fetch(snap, f)
                    cache.set(_key(snap, f), header.raw)
                    yield header
            finally:
                for p in pending.values():
                    p.cancel()


def file_head(snap: Snapshot, file: str, nbytes: int) -> RemoteHeader:
    """The first `nbytes` of a file (an index's metadata), cached as headers are."""
    from diskcache import Cache

    with Cache(str(cache_dir() / "hub-headers")) as cache:
        key = _key(snap, file) + f"|head{nbytes}"
        if (raw := cache.get(key)) is not None:
            return RemoteHeader(file=file, size=snap.size(file) or 0, raw=raw, fetched=0)
        raw = read_range(snap, file, 0, nbytes)
        cache.set(key, raw)
        return RemoteHeader(file=file, size=snap.size(file) or 0, raw=raw, fetched=len(raw))


def _fetch(snap: Snapshot, file: str) -> RemoteHeader:
    size = snap.size(file) or 0
    n = header_size(read_range(snap, file, 0, 8) if size >= 8 else b"", size, snap.where(file))
    return RemoteHeader(file=file, size=size, raw=read_range(snap, file, 8, 8 + n), fetched=8 + n)

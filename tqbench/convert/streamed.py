"""The hub's side of a conversion that streams its source: which source shards each unit reads, the order to
download them in, when each may go, and the disk the whole job needs.

A shard is removed once the last unit reading it is converted *and written durably* (the caller marks the output
shard being written first), so a rerun after kill -9 never needs a removed shard again. A conversion from the hub
resumes only from the commit it started with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqbench.convert.journal import Journal
from tqbench.convert.produce import Producer, shared_expert_piece
from tqbench.errors import ConvertError
from tqbench.events import SourceProgress, SourceRemoved
from tqbench.recipe.recipe import Recipe
from tqbench.source.hub.client import Snapshot, cached_file, download, hf_cache, resolve
from tqbench.source.hub.disk import check_free, disk_need, snapshot_of
from tqbench.source.hub.fetch import WINDOW, ShardFetcher
from tqbench.source.hub.ref import HubRef
from tqbench.layout.shard_units import Unit
from tqbench.shards.header import INDEX_FILE
from tqbench.source.checkpoint import Checkpoint

COMPANION_MAX_BYTES = 64 * 2**20  # the files that travel with a converted model (tokenizer, templates) are small
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def moved(ckpt: Checkpoint, journal: Journal | None) -> str | None:
    """Why a conversion from the hub cannot resume from `ckpt`: it started from another commit of the repository (the
    revision moved since). None when it can."""
    was = journal.origin if journal is not None else None
    o = ckpt.origin
    if o is None or not was or was.get("repo") != o.repo_id or was.get("commit") == o.commit:
        return None
    return (f"this conversion started from {o.repo_id}@{str(was.get('commit'))[:12]}, but {o.revision} is now "
            f"{o.commit[:12]}: finish it with --hf-path {o.repo_id}@{was.get('commit')}, or start over with --force")


def check_revision(ckpt: Checkpoint, dst: Path, force: bool) -> None:
    """A conversion from the hub resumes only from the commit it started with."""
    why = None if force else moved(ckpt, Journal.load(dst) if dst.is_dir() else None)
    if why:
        raise ConvertError(why, dst)


def prepare(ckpt: Checkpoint, dest: Path, journal: Journal, to_write: int, keep_source: bool) -> None:
    """Before a conversion from the hub reads a shard: its origin noted in the journal, the disk checked (output
    still `to_write` bytes, plus the source shards at once), and the small files that travel with the model
    downloaded."""
    o = ckpt.origin
    journal.origin = {"repo": o.repo_id, "revision": o.revision, "commit": o.commit}
    check_free(disk_need(ckpt, to_write, dest, hf_cache(), keep_source))
    fetch_companions(resolve(HubRef(repo_id=o.repo_id, revision=o.commit)))


def fetch_companions(listing: Snapshot) -> int:
    """Download the small files that travel with the converted model (what a directory's conversion copies: not
    weights, not hidden, at most 64 MiB). Returns the bytes downloaded."""
    fetched = 0
    for f in listing.files:
        if ("/" in f.name or f.name.startswith(".") or f.name.endswith(_WEIGHTS) or f.size > COMPANION_MAX_BYTES
                or f.name == INDEX_FILE or cached_file(listing, f.name) is not None):
            continue
        fetched += download(listing, f.name).stat().st_size
    return fetched


def unit_shards(producer: Producer, unit: Unit) -> set[str]:
    """The source shards a unit reads."""
    return {e.shard for p in unit.pieces if not shared_expert_piece(p)
            for e in producer.source_parts(p.module, p.expert).values()}


def open_feed(ckpt: Checkpoint, recipe: Recipe, journal: Journal, units: Iterable[Unit], keep_source: bool) -> HubFeed:
    """The feed of this run's `units` (the units it converts, in order), their shards as `recipe` reads them."""
    planner = Producer(ckpt, recipe, None)
    return HubFeed(ckpt, journal, units, lambda u: unit_shards(planner, u), keep_source)


class HubFeed:
    """Gates the conversion's units on their shards being downloaded and says which shards each unit finishes."""

    def __init__(self, ckpt: Checkpoint, journal: Journal, units: Iterable[Unit],
                 shards_of: Callable[[Unit], set[str]], keep_source: bool):
        self.root, self.keep = ckpt.path, keep_source
        self.snap = snapshot_of(ckpt)
        self.shards_of = shards_of
        order: list[str] = []
        last: dict[str, int] = {}
        for j, u in enumerate(units):
            for s in shards_of(u):
                if s not in last:
                    order.append(s)
                last[s] = j
        self.finishing: dict[int, list[str]] = {}
        for s, j in last.items():
            self.finishing.setdefault(j, []).append(s)
        on_disk = {s for s in order if cached_file(self.snap, s) is not None}
        ours = set(journal.downloaded) | {s for s in order if s not in on_disk}
        journal.downloaded = sorted(ours)
        journal.save()  # before the first download: a shard tqbench fetched is known as its own whatever happens
        self.leftover = [s for s in journal.downloaded if s not in last and (self.root / s).exists()]
        self.fetcher = ShardFetcher(self.snap, order, ours, on_disk, len(order) if keep_source else WINDOW)

    def gate(self, items: Iterable[tuple[Unit, int]]) -> Iterator[tuple[Unit, int] | SourceProgress]:
        """The items, each once its shards are on disk; progress events while waiting for a download."""
        for item in items:
            need = self.shards_of(item[0])
            if not self.fetcher.on_disk(need):
                # Said before it is asked for: a reader running ahead (pipeline._read_ahead) first hands out the
                # units it holds, so a shard is asked for out of turn (past the two on disk) only once the conversion
                # has reached the unit that needs it, not when the reader looks ahead at it.
                yield self.fetcher.progress()
            while (waiting := self.fetcher.wait(need)) is not None:
                yield waiting
            yield item

    def finished(self, j: int) -> list[str]:
        """The shards whose last unit is the j-th (counted from 0 over this run's units)."""
        return self.finishing.pop(j, [])

    def converted(self, j: int, make_durable: Callable[[], None], close: Callable[[str], None]
                  ) -> Iterator[SourceRemoved]:
        """After the j-th unit of this run: the shards it was the last to read go (unless the source is kept), once
        `make_durable` has made the output written so far durable and `close` has closed the reader's file of each."""
        gone = self.finished(j)
        if gone and not self.keep:  # the units that read them durable first, then they go
            make_durable()
            for f in gone:
                close(f)
            yield from self.remove(gone)

    def eta(self, converting: float | None) -> float | None:
        """One ETA: the later of converting (`converting` seconds) and downloading what is left."""
        d = self.progress()
        if d.downloaded < d.to_download:
            return max(converting, d.eta) if converting is not None and d.eta is not None else None
        return converting

    def remove(self, files: Iterable[str]) -> Iterator[SourceRemoved]:
        """Remove these shards if tqbench downloaded them (unless the source is kept). Call only once the units that
        read them are durable."""
        if self.keep:
            return
        for f in files:
            if (event := self.fetcher.remove(f, self.root / f)) is not None:
                yield event

    def progress(self) -> SourceProgress:
        return self.fetcher.progress()

    def close(self) -> None:
        self.fetcher.close()


"""One output shard of a conversion: its units produced in order on this thread (MLX), streamed into
`<shard>.partial` with each unit's error counted, then closed, renamed and recorded (size, sha256, errors) in the
journal. A shard an earlier run left part-written, marked durable before its source went, is continued from its mark.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from tqbench.convert.journal import JOURNAL, Journal
from tqbench.convert.produce import Produced, Producer
from tqbench.errors import ConvertError
from tqbench.events import ShardWritten, UnitConverted
from tqbench.layout.shard_units import Unit
from tqbench.recipe.recipe import Recipe
from tqbench.source.reader import ShardReader
from tqbench.shards import ShardWriter, TensorSpec
from tqbench.shards.writer import ResumeError, WriterMark
from tqbench.testhooks import kill_point

if TYPE_CHECKING:
    from tqbench.convert.streamed import HubFeed


def shard_metadata(recipe: Recipe) -> dict[str, str]:
    return {"format": "mlx", "tqbench_recipe": recipe.name}


@dataclass(frozen=True, kw_only=True)
class Partial:
    """An output shard an earlier run left part-written, durable up to `mark` (its source was removed after)."""

    index: int
    mark: WriterMark
    units: int
    bytes_in: int
    errors: dict[str, list[float]]
    layers: dict[str, list[float]]


def read_partial(journal: Journal, dst: Path, files: tuple[str, ...], resumed: list[bool]) -> Partial | None:
    p = journal.partial
    if not p or p.get("file") not in files or resumed[files.index(p["file"])]:
        return None
    try:
        mark = WriterMark.from_dict(p["mark"])
        part = dst / (p["file"] + ".partial")
        if not part.is_file() or part.stat().st_size < mark.nbytes:
            return None
        return Partial(index=files.index(p["file"]), mark=mark, units=int(p["units"]), bytes_in=int(p["bytes_in"]),
                       errors=dict(p["errors"]), layers=dict(p["layers"]))
    except (KeyError, TypeError, ValueError):
        return None


class Progress:
    """Source bytes converted so far against the whole job's, for each unit's rate and ETA: `clock` (seconds) is read
    once now, once per unit, and where download progress may be shown (`due`)."""

    def __init__(self, total_in: int, done_in: int, clock: Callable[[], float]):
        self.total_in = total_in
        self.done_in = done_in  # by earlier runs too
        self.run_in = 0  # by this run
        self.clock = clock
        self.started = clock()
        self.shown = self.started  # when download progress was last shown

    def add(self, unit_in: int) -> tuple[float, float, float | None]:
        """One more unit converted: (seconds since the start, bytes per second, seconds left or None)."""
        self.run_in += unit_in
        self.done_in += unit_in
        elapsed = self.clock() - self.started
        rate = self.run_in / elapsed if elapsed > 0 else 0.0
        eta = (self.total_in - self.done_in) / rate if rate > 0 else None
        return elapsed, rate, eta

    def shown_now(self) -> None:
        self.shown = self.clock()

    def due(self) -> bool:
        """Half a second or more since download progress was last shown: it is shown now."""
        if self.clock() - self.shown < 0.5:
            return False
        self.shown_now()
        return True


class OutputShard:
    """One output shard being written: its writer, the units written so far, the source bytes they read, their
    errors (per module: [count, sum, max]; per layer: [units, sum, max] of each unit's worst)."""

    def __init__(self, file: str, writer: ShardWriter, cont: Partial | None):
        self.file = file
        self.writer = writer
        self.errors: dict[str, list[float]] = cont.errors if cont else {}
        self.layers: dict[str, list[float]] = cont.layers if cont else {}
        self.units, self.bytes_in = (cont.units, cont.bytes_in) if cont else (0, 0)

    def write(self, unit: Unit, unit_in: int, produced: Iterable[Produced]) -> float | None:
        """Write one unit's tensors; returns its worst relative error (None: no error measured)."""
        worst = None
        for r in produced:
            self.writer.write(r.piece.out.name, r.data)
            if r.rel_error is not None and r.source_bytes:
                _add(self.errors.setdefault(r.piece.module.name, [0, 0.0, 0.0]), r.rel_error)
                worst = max(worst or 0.0, r.rel_error)
        if worst is not None:
            _add(self.layers.setdefault("" if unit.layer is None else str(unit.layer), [0, 0.0, 0.0]), worst)
        self.units += 1
        self.bytes_in += unit_in
        return worst

    def mark(self) -> dict[str, Any]:
        """The journal's record of this shard so far (`Journal.partial`): a rerun continues it from here."""
        return {"file": self.file, "mark": self.writer.mark().to_dict(), "units": self.units,
                "bytes_in": self.bytes_in, "errors": self.errors, "layers": self.layers}


class ShardRun:
    """Writes one run's output shards, one at a time: what they share is the destination, the recipe, the journal,
    the producer and its reader, the progress and, for a source on the hub, the feed of its downloads."""

    def __init__(self, dst: Path, recipe: Recipe, journal: Journal, producer: Producer, reader: ShardReader,
                 progress: Progress, feed: HubFeed | None, shards: int):
        self.dst = dst
        self.recipe = recipe
        self.journal = journal
        self.producer = producer
        self.reader = reader
        self.progress = progress
        self.feed = feed
        self.shards = shards  # in the whole conversion
        self.ran = 0  # units converted in this run

    def write(self, i: int, file: str, header: Iterable[Unit], head: int, count: int, items: Iterator[Any],
              cont: Partial | None) -> Iterator[Any]:
        """Shard `i` (`file`: `count` units, `header` the units its header lists, `head` its header's bytes) from the
        next units of `items` (the events between them handed on), continued from `cont` if an earlier run marked
        it. Yields UnitConverted per unit, then ShardWritten once it is recorded in the journal."""
        shard = OutputShard(file, open_writer(self.dst / file, (p.out for u in header for p in u.pieces), self.recipe,
                                              head, cont.mark if cont else None), cont)
        writer = shard.writer
        try:
            for item in _take(items, count - shard.units):
                if isinstance(item, tuple):
                    yield from self._unit(shard, *item)
                else:  # a download the next units wait for
                    yield item
            writer.close()
        except BaseException as e:
            writer.abort(keep_marked=True)
            raise_if_no_room(e, self.dst, file)
            raise
        try:
            self.journal.record(file, writer.nbytes, writer.sha256, shard.errors, shard.layers)
        except OSError as e:
            raise_if_no_room(e, self.dst, JOURNAL)
            raise
        yield ShardWritten(index=i + 1, total=self.shards, file=file, bytes=writer.nbytes, sha256=writer.sha256)

    def _unit(self, shard: OutputShard, u: Unit, unit_in: int) -> Iterator[Any]:
        worst = shard.write(u, unit_in, self.producer.produce(u))
        elapsed, rate, eta = self.progress.add(unit_in)
        if self.feed is not None:
            eta = self.feed.eta(eta)
        yield UnitConverted(name=u.pieces[0].out.name, layer=u.layer, expert=u.expert, bytes_in=unit_in,
                            bytes_out=u.nbytes, rel_error=worst, done_in=self.progress.done_in,
                            total_in=self.progress.total_in, elapsed=elapsed, rate=rate, eta=eta)
        kill_point("unit")
        if self.feed is None:
            return
        ran, self.ran = self.ran, self.ran + 1
        yield from self.feed.converted(ran, lambda: self._mark(shard), self.reader.close_shard)
        if self.progress.due():
            yield self.feed.progress()

    def _mark(self, shard: OutputShard) -> None:
        """Make what `shard` holds so far durable, so a rerun never needs the source shards about to go."""
        self.journal.partial = shard.mark()
        self.journal.save()
        kill_point("mark")


def open_writer(path: Path, specs: Iterable[TensorSpec], recipe: Recipe, head: int,
                resume: WriterMark | None = None) -> ShardWriter:
    try:
        # hashing and writing run on the writer's thread while MLX produces the next tensors
        return ShardWriter(path, specs, shard_metadata(recipe), head, background=True, resume=resume)
    except ResumeError as e:
        raise ConvertError(f"cannot continue the part-written shard ({e}); delete {path.name}.partial and rerun",
                           path.parent) from None
    except OSError as e:
        raise_if_no_room(e, path.parent, path.name)
        raise


def raise_if_no_room(e: BaseException, dst: Path, what: str) -> None:
    """A full disk (or quota, or file-size limit) becomes one clear, resumable error."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise ConvertError(f"no room to write {what} ({e.strerror}): free space and rerun the same command to "
                           "resume", dst) from None


def _take(items: Iterator[Any], n: int) -> Iterator[Any]:
    """The next `n` units of `items`, with the events that come between them."""
    while n > 0:
        item = next(items)
        n -= isinstance(item, tuple)
        yield item


def _add(agg: list[float], error: float) -> None:
    agg[0] += 1
    agg[1] += error
    agg[2] = max(agg[2], error)

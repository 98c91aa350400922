"""The streaming conversion: source checkpoint + recipe -> converted shards, one unit (a tensor, or one routed
expert) in memory at a time, resumable after a crash, byte-identical in any run.

Order of work: plan (exactly `tqbench plan`'s numbers), split into units and shards, then per shard: produce each
unit on this thread (MLX), stream it into `<shard>.partial`, rename, record size + sha256 in the journal. The final
step writes the expert map, config, tokenizer files and report, and last of all the index: a directory with
`model.safetensors.index.json` is complete, one without it is resumable.
"""


from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, deque
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import mlx.core as mx

from tqbench.atomic import temp_target, write_bytes, write_json
from tqbench.convert.calibration import STATS, CalibrationRequest, PassStatistics
from tqbench.convert.journal import JOURNAL, Journal
from tqbench.convert.produce import Producer, rotated, shared_expert_piece
from tqbench.convert.shard import Partial, Progress, ShardRun, raise_if_no_room, read_partial, shard_metadata
from tqbench.convert.streamed import HubFeed, check_revision, moved, open_feed, prepare
from tqbench.cubin import keep_mlx_kernels
from tqbench.errors import CheckpointError, ConvertError
from tqbench.events import ConvertFinished, ConvertStarted, LayerErrors
from tqbench.layout import expert_map
from tqbench.layout.quantization import ModuleQuant, quantization_block
from tqbench.layout.names import EXPERT_MAP, INDEX_FILE, REPORT, SHARD_NAME, shard_file
from tqbench.layout.shard_units import Unit, chunks, iter_units, shard_counts, split, unit_sizes
from tqbench.recipe.plan import SHARD_SIZE, Plan, group_sources, make_plan
from tqbench.quant import turboquant as tq
from tqbench.recipe.recipe import Format, Recipe
from tqbench.source.checkpoint import Checkpoint
from tqbench.source.opening import open_checkpoint
from tqbench.source.reader import ShardReader
from tqbench.shards import TensorSpec
from tqbench.shards.writer import header_length
from tqbench.testhooks import kill_point
from tqbench.writable import check_output_dir

# Source files that are not weights and travel with the model (tokenizer, chat template, generation settings).
_COPY_MAX_BYTES = 64 * 2**20
PREFETCH_WORKERS = 2  # threads reading the next units' source bytes (they never touch MLX)
# Source bytes read ahead of the unit being converted, into an MLX-owned arena of this size (half of it ahead: the
# unit being converted holds its regions meanwhile). 0: one unit ahead, read as bytes and copied into MLX memory.
READ_AHEAD = 128 * 2**20


def default_read_ahead() -> int:
    """READ_AHEAD on a GPU, where it paid (an H200: 1.4-1.5x, the copy into managed memory and the read waits gone);
    0 on the CPU, where the copy is a memcpy, the conversion is compute-bound and the arena measured no faster while
    adding its size to the process's memory."""
    return READ_AHEAD if mx.default_device().type == mx.gpu else 0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Everything decided before a byte is written: the plan, how many units each shard holds, the fingerprints.

    Units are not kept: `shards()` builds them again, one shard at a time, so bookkeeping memory stays flat however
    many tensors the model has (K3: 497k source tensors, 82k expert units)."""

    ckpt: Checkpoint
    plan: Plan
    counts: tuple[int, ...]  # units per shard
    files: tuple[str, ...]
    shard_in: tuple[int, ...]  # source bytes each shard reads
    layer_units: tuple[tuple[tuple[int | None, int], ...], ...]  # per shard: (layer, units of it) in file order
    header_lengths: tuple[int, ...]  # per shard: its header's bytes (where its data starts)
    source_fp: str
    plan_fp: str
    file_bytes: int  # what the shard files hold: plan.total_bytes of tensors + their headers
    calibration: str = ""  # a calibrated recipe's text digest (in plan_fp)

    @property
    def units(self) -> int:
        return sum(self.counts)

    def shards(self) -> Iterator[list[Unit]]:
        """Each shard's units, in order, built when asked for."""
        return split(iter_units(self.plan.modules, "streaming"), self.counts)

    def streamed(self) -> Iterator[Iterator[Unit]]:
        """Like `shards()`, without holding even one shard's units (each iterator is consumed before the next)."""
        return chunks(iter_units(self.plan.modules, "streaming"), self.counts)


def layout(source: str | Path | Checkpoint, recipe: Recipe, shard_size: int = SHARD_SIZE,
           calibration: str = "") -> Layout:
    """`calibration`: the digest of a calibrated recipe's texts (CalibrationRequest.digest), part of the plan
    fingerprint: the same recipe calibrated on other texts writes other bytes."""
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    if ckpt.missing:
        raise CheckpointError(f"incomplete checkpoint: {len(ckpt.missing)} shard(s) missing "
                              f"({ckpt.missing[0].file}); finish the download first", ckpt.path)
    plan = make_plan(group_sources(ckpt), recipe, shard_size, "streaming")
    counts = shard_counts(unit_sizes(plan.modules, "streaming"), shard_size)
    files = tuple(shard_file(i, len(counts)) for i in range(len(counts)))
    # searched TurboQuant scales write other bytes under the same name as the RMS rule's before them
    rule = "|scales=search" if plan.recipe.uses_turboquant and plan.recipe.scales == "search" else ""
    rule += f"|cal={calibration}" if plan.recipe.calibrate else ""
    h = hashlib.sha256(f"{plan.recipe.name}{rule}|{plan.shard_size}|{plan.layout}\n".encode())
    heads, shard_in, layer_units = [], [], []
    units = with_source_bytes(iter_units(plan.modules, "streaming"))
    for i, shard in enumerate(chunks(units, counts)):
        size_in, layers = 0, Counter()

        def specs() -> Iterator[TensorSpec]:
            nonlocal size_in
            for u, n in shard:
                size_in += n
                layers[u.layer] += 1
                for p in u.pieces:
                    h.update(f"{i}|{p.out.name}|{p.out.dtype}|{p.out.shape}\n".encode())
                    yield p.out

        heads.append(header_length(specs(), shard_metadata(recipe)))
        shard_in.append(size_in)
        layer_units.append(tuple(layers.items()))
    return Layout(ckpt=ckpt, plan=plan, counts=tuple(counts), files=files, shard_in=tuple(shard_in),
                  layer_units=tuple(layer_units), header_lengths=tuple(heads), source_fp=source_fingerprint(ckpt),
                  plan_fp=h.hexdigest(), file_bytes=plan.total_bytes + sum(heads), calibration=calibration)


@dataclass(frozen=True, kw_only=True)
class DestinationStatus:
    state: str  # "new" (absent or empty), "resumable", "complete", "conflict" (a conversion of another recipe or
    # source: --force replaces it), "foreign" (files that are no tqbench conversion: never replaced)
    done_shards: int
    total_shards: int
    detail: str  # one line for the user
    finished: tuple[bool, ...] = ()  # per output shard: finished by an earlier run


def _conflict(journal: Journal | None, recipe: Recipe) -> str:
    if journal is None:
        return "is not empty and holds no tqbench conversion"
    if journal.recipe == recipe.name:
        return f"holds a {recipe.name} conversion of another source, shard size or scale rule"
    return f"holds a conversion of another recipe or source ({journal.recipe})"


def destination_status(lay: Layout, dest: str | Path) -> DestinationStatus:
    """What converting into `dest` would do: start, resume (how far), nothing, or need --force."""
    dst, n = Path(dest), len(lay.files)
    if not dst.exists() or (dst.is_dir() and not any(dst.iterdir())):
        return DestinationStatus(state="new", done_shards=0, total_shards=n, detail="new output", finished=(False,) * n)
    journal = Journal.load(dst) if dst.is_dir() else None
    if not is_conversion(dst):
        return DestinationStatus(state="foreign", done_shards=0, total_shards=n,
                                 detail="is not empty and holds no tqbench conversion", finished=(False,) * n)
    if why := moved(lay.ckpt, journal):
        return DestinationStatus(state="conflict", done_shards=0, total_shards=n, detail=why, finished=(False,) * n)
    if journal is None or journal.source != lay.source_fp or journal.plan != lay.plan_fp:
        return DestinationStatus(state="conflict", done_shards=0, total_shards=n,
                                 detail=_conflict(journal, lay.plan.recipe), finished=(False,) * n)
    finished = tuple(journal.finished(dst, f) for f in lay.files)
    done = sum(finished)
    if done == n and (dst / INDEX_FILE).is_file():
        return DestinationStatus(state="complete", done_shards=done, total_shards=n,
                                 detail="already converted with this recipe", finished=finished)
    return DestinationStatus(state="resumable", done_shards=done, total_shards=n,
                             detail=f"interrupted: {done} of {n} shards done", finished=finished)


def convert(source: str | Path | Checkpoint | Layout, dest: str | Path, recipe: Recipe,
            shard_size: int = SHARD_SIZE, force: bool = False,
            producer_class: type[Producer] = Producer, read_ahead: int | None = None,
            keep_source: bool = False, calibration: CalibrationRequest | None = None,
            keep_statistics: bool = False) -> Iterator[Any]:
    """Convert, yielding ConvertStarted, UnitConverted per unit, ShardWritten per shard, ConvertFinished.
    `source` may be an opened Checkpoint or a Layout computed for this recipe and shard size (faces that checked
    the destination have one). `producer_class` computes each unit's tensors (a benchmark may substitute one that
    writes synthetic expert codes). `read_ahead`: see READ_AHEAD (None: `default_read_ahead()`; the output is the
    same for any value). Closing the generator stops cleanly: the shard being written is dropped and the output
    resumes later. An output directory that cannot be made or written into is refused first (one line).

    A source on the hub (`Checkpoint.origin`) is streamed: its shards download as the units reading them come up
    (SourceProgress events), and each downloaded shard is removed once converted unless `keep_source`
    (SourceRemoved events; tqbench.convert.streamed). A calibrated recipe (`cal`) runs its calibration pass over
    `calibration`'s texts (default: the demo's held-out texts; tqbench.convert.calibration) as the shards need its
    codes (CalibrationProgress events among the units', Calibrated after the last); it is refused for a source on
    the hub. `keep_statistics` saves the statistics in the output (STATS)."""
    check_output_dir(Path(dest))  # before planning or reading a byte
    t0 = time.monotonic()
    keep_mlx_kernels()
    request = (calibration or CalibrationRequest()) if recipe.calibrate else None
    lay = _layout_for(source, recipe, shard_size, request.digest() if request else "")  # a bad text fails here
    ckpt, plan, files = lay.ckpt, lay.plan, lay.files
    dst = Path(dest)
    if any(m.choice.format is Format.TURBOQUANT for m in plan.modules):
        tq.quantizer_kernel()  # a bad TQBENCH_QUANTIZER fails here, before the destination is touched
    if request is not None and ckpt.origin is not None:
        raise ConvertError("calibrated rounding (cal) runs the source model, which needs every source shard on disk "
                           "at once, and a conversion from the hub holds two: download the repository and convert "
                           "from its directory", ckpt.name)
    if ckpt.origin is not None:
        check_revision(ckpt, dst, force)
    journal = _prepare_dest(ckpt.path, dst, recipe, source_fp=lay.source_fp, plan_fp=lay.plan_fp, force=force)
    total_in = sum(lay.shard_in)
    resumed = [journal.finished(dst, f) for f in files]
    if ckpt.origin is not None:
        written = sum(journal.shards[f]["bytes"] for f, r in zip(files, resumed) if r)
        prepare(ckpt, dst, journal, lay.file_bytes - written, keep_source)
    # The calibration pass runs as the shards still to write need its codes (a finished conversion rerun: none).
    keep = dst / STATS if keep_statistics else None
    stats = PassStatistics(ckpt.path, plan, request, keep=keep) if request and not all(resumed) else None
    partial = read_partial(journal, dst, files, resumed)
    done_in = sum(b for b, r in zip(lay.shard_in, resumed) if r) + (partial.bytes_in if partial else 0)
    yield ConvertStarted(source=ckpt.name, dest=str(dst), recipe=recipe.name, shards=len(files), units=lay.units,
                         bytes_in=total_in, bytes_out=lay.file_bytes, tensor_bytes=plan.total_bytes,
                         resumed_shards=sum(resumed), resumed_bytes_in=done_in,
                         resumed_errors=_resumed_errors(journal, [f for f, r in zip(files, resumed) if r]))

    feed = None
    if ckpt.origin is not None:
        units = _remaining(chunks(iter_units(plan.modules, "streaming"), lay.counts), resumed, partial)
        feed = open_feed(ckpt, recipe, journal, units, keep_source)
    progress = Progress(total_in, done_in, time.monotonic)
    try:
        for ev in _write_shards(lay, dst, recipe, journal=journal, resumed=resumed, partial=partial, feed=feed,
                                progress=progress, producer_class=producer_class, calibration=stats,
                                read_ahead=default_read_ahead() if read_ahead is None else read_ahead):
            if stats is not None:
                yield from stats.events()  # the calibration's progress while the unit was made
            yield ev
        if stats is not None:
            yield from stats.finish()
    finally:
        if feed is not None:
            feed.close()

    errors = _combined_errors(journal, files)
    report = _report(ckpt, plan, lay.source_fp, errors, time.monotonic() - t0)
    try:
        _finish(lay, dst, report, journal)
    except OSError as e:
        raise_if_no_room(e, dst, "the final files")
        raise
    if not keep_statistics:
        (dst / STATS).unlink(missing_ok=True)  # left by an earlier version's interrupted run
    count, total = sum(a[0] for a in errors.values()), sum(a[1] for a in errors.values())
    yield ConvertFinished(dest=str(dst), seconds=time.monotonic() - t0, bytes_in=total_in, bytes_out=lay.file_bytes,
                          shards=len(files), mean_rel_error=total / count if count else None,
                          max_rel_error=max((a[2] for a in errors.values()), default=None))


def _layout_for(source: str | Path | Checkpoint | Layout, recipe: Recipe, shard_size: int,
                calibration: str) -> Layout:
    if not isinstance(source, Layout):
        return layout(source, recipe, shard_size, calibration)
    if source.calibration != calibration:  # a face's layout, computed without the calibration texts' digest
        return layout(source.ckpt, recipe, shard_size, calibration)
    if source.plan.recipe != recipe or source.plan.shard_size != shard_size:
        raise ValueError("the layout was computed for another recipe or shard size")
    return source


def _write_shards(lay: Layout, dst: Path, recipe: Recipe, journal: Journal, resumed: list[bool],
                  partial: Partial | None, feed: HubFeed | None, progress: Progress,
                  producer_class: type[Producer], read_ahead: int, calibration: Any = None) -> Iterator[Any]:
    """This run's shards, in order. Two passes over the units, neither holding a shard's: one gives each shard's
    header, the other the units to convert, each with its source bytes, their reads started ahead while MLX works."""
    plan = lay.plan
    headers = chunks(iter_units(plan.modules, "streaming"), lay.counts)
    shards = chunks(with_source_bytes(iter_units(plan.modules, "streaming")), lay.counts)
    decoded = sum(m.source.source_bytes for m in plan.modules if m.choice.format in (Format.TURBOQUANT, Format.AFFINE))
    stage = min(read_ahead, decoded, progress.total_in - progress.done_in)  # the arena holds only what is decoded
    with ShardReader(lay.ckpt.path, workers=PREFETCH_WORKERS, stage_bytes=stage) as reader:
        producer = producer_class(lay.ckpt, recipe, reader)
        producer.calibration = calibration
        items = _remaining(shards, resumed, partial)
        if feed is not None:
            yield from feed.remove(feed.leftover)  # fully converted by a run that stopped before removing them
            items = feed.gate(items)
        pending = _read_ahead(items, lambda unit, after: producer.prefetch(unit, after), stage // 2)
        progress.shown_now()
        run = ShardRun(dst, recipe, journal, producer=producer, reader=reader, progress=progress, feed=feed,
                       shards=len(lay.files))
        for i, (file, header) in enumerate(zip(lay.files, headers)):
            if not resumed[i]:
                cont = partial if partial and partial.index == i else None
                yield from run.write(i, file, header, head=lay.header_lengths[i], count=lay.counts[i], items=pending,
                                     cont=cont)


def _remaining(stream: Iterator[Iterator[Any]], resumed: list[bool], partial: Partial | None) -> Iterator[Any]:
    """This run's part of a per-shard stream: unfinished shards, past the units a partial shard holds."""
    for i, (shard, r) in enumerate(zip(stream, resumed)):
        if not r:
            yield from islice(shard, partial.units if partial and partial.index == i else 0, None)


# --- destination checks ----------------------------------------------------------------------------------------------


def _prepare_dest(src: Path, dst: Path, recipe: Recipe, source_fp: str, plan_fp: str, force: bool) -> Journal:
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ConvertError("the output directory must not be the source or inside it", dst)
    journal = Journal.load(dst) if dst.is_dir() else None
    same = journal is not None and journal.source == source_fp and journal.plan == plan_fp
    ours = is_conversion(dst)
    if dst.is_dir() and any(dst.iterdir()) and not same:
        if not ours:  # --force or not: tqbench replaces only what it wrote
            raise ConvertError("is not empty and holds no tqbench conversion; choose another output directory "
                               "(tqbench never deletes files it did not write)", dst)
        if not force:
            raise ConvertError(f"{_conflict(journal, recipe)}; use --force to replace it", dst)
        remove_conversion(dst)
    if same and (dst / INDEX_FILE).is_file() and force:
        remove_conversion(dst)  # --force on a finished identical conversion: redo it
        same = False
    dst.mkdir(parents=True, exist_ok=True)
    if same:
        (dst / INDEX_FILE).unlink(missing_ok=True)  # reopened: complete again only when the final step ends
        return journal
    journal = Journal(path=dst / JOURNAL, source=source_fp, plan=plan_fp, recipe=recipe.name)
    journal.save()
    return journal


def is_conversion(dst: Path) -> bool:
    """`dst` holds a tqbench conversion (finished or not): its journal, or an index that says tqbench wrote it."""
    if (dst / JOURNAL).is_file():
        return True
    try:
        index = json.loads((dst / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and (index.get("metadata") or {}).get("format") == "tqbench"


def remove_conversion(dst: Path) -> None:
    """Delete what a tqbench conversion wrote into `dst` and nothing else: its shards (named by the journal or the
    index, or by tqbench's shard naming), unfinished `.partial` files, the files of the final step and the files
    copied from the source (listed in the journal). Files a user put there stay."""
    names = {JOURNAL, INDEX_FILE, EXPERT_MAP, REPORT, STATS, "config.json"}
    journal = Journal.load(dst)
    if journal is not None:
        names |= set(journal.shards) | set(journal.copied)
    try:
        index = json.loads((dst / INDEX_FILE).read_text())
        names |= set((index.get("weight_map") or {}).values())
    except (OSError, ValueError, AttributeError):
        pass
    for f in dst.iterdir():
        if f.is_file() and (f.name in names or SHARD_NAME.fullmatch(f.name.removesuffix('.partial'))
                            or (f.name.endswith(".partial") and f.name[:-len(".partial")] in names)
                            or temp_target(f.name) in names):
            f.unlink()


# --- fingerprints and accounting -------------------------------------------------------------------------------------


def source_fingerprint(ckpt: Checkpoint) -> str:
    """sha256 of config.json and every tensor's header entry: changes when the source changes."""
    h = hashlib.sha256((ckpt.path / "config.json").read_bytes())
    for t in sorted(ckpt.tensors, key=lambda t: t.entry.name):
        e = t.entry
        h.update(f"{e.name}|{e.dtype}|{e.shape}|{e.shard}|{e.offset}|{e.nbytes}\n".encode())
    return h.hexdigest()


def with_source_bytes(units: Iterable[Unit]) -> Iterator[tuple[Unit, int]]:
    """Each unit with the source bytes it reads: a module's whole source at the first unit it appears in, one
    expert's share for per-expert units. A module's pieces are consecutive in file order, so comparing with the
    previous piece's (module, expert) is enough (no set of everything seen)."""
    last: tuple[int, int | None] | None = None
    for u in units:
        n = 0
        for p in u.pieces:
            key = (id(p.module), p.expert)
            if key != last and not shared_expert_piece(p):
                last = key
                s = p.module.source
                n += s.source_bytes // s.experts if p.expert is not None else s.source_bytes
        yield u, n


def _read_ahead(units: Iterator[tuple[Unit, int] | Any], prefetch: Callable[[Unit, Unit | None], None],
                budget: int) -> Iterator[tuple[Unit, int] | Any]:
    """The (unit, source bytes) in order; before one is handed out, the reads of the units after it are started:
    at least the next unit's, more while the source bytes beyond the unit handed out stay within `budget`. Anything
    else in `units` (an event: the next unit waits for a download) is handed on once the units before it are."""
    window: deque[tuple[Unit, int]] = deque()  # units whose reads have started, not handed out yet
    ahead, last = 0, None  # the window's source bytes; the unit prefetched last
    peek = next(units, None)
    while True:
        while peek is not None and (len(window) < 2 or not isinstance(peek, tuple)
                                    or ahead - window[0][1] + peek[1] <= budget):
            if not isinstance(peek, tuple):
                if window:
                    break  # hand out the units that are ready first
                yield peek
                peek = next(units, None)
                continue
            prefetch(peek[0], last)
            last = peek[0]
            window.append(peek)
            ahead += peek[1]
            peek = next(units, None)
        if not window:
            if peek is None:
                return
            continue
        item = window.popleft()
        ahead -= item[1]
        yield item


def _resumed_errors(journal: Journal, files: list[str]) -> tuple[LayerErrors, ...]:
    """Per layer, the unit errors that earlier runs recorded for the finished shards `files`."""
    out: dict[str, list[float]] = {}
    for f in files:
        for layer, (n, total, worst) in journal.shards[f].get("layers", {}).items():
            agg = out.setdefault(layer, [0, 0.0, 0.0])
            agg[0] += n
            agg[1] += total
            agg[2] = max(agg[2], worst)
    return tuple(LayerErrors(layer=int(k) if k else None, count=int(n), total=total,
                             worst=worst) for k, (n, total, worst) in out.items())


def _combined_errors(journal: Journal, files: list[str]) -> dict[str, list[float]]:
    """Per-module [count, sum, max] over all shards, combined in shard order (the same in any run or resume)."""
    out: dict[str, list[float]] = {}
    for f in files:
        for module, (n, total, worst) in journal.shards[f]["errors"].items():
            agg = out.setdefault(module, [0, 0.0, 0.0])
            agg[0] += n
            agg[1] += total
            agg[2] = max(agg[2], worst)
    return out


# --- the final step --------------------------------------------------------------------------------------------------


def _finish(lay: Layout, dst: Path, report: dict[str, Any], journal: Journal) -> None:
    ckpt, plan = lay.ckpt, lay.plan
    write_json(dst / EXPERT_MAP, expert_map.build(lay.streamed(), lay.files, lay.header_lengths))
    kill_point("final")
    write_json(dst / "config.json", converted_config(ckpt, plan))
    kill_point("final")
    copied = [f for f in sorted(ckpt.path.iterdir()) if f.is_file() and _travels(f)]
    journal.copied = [f.name for f in copied]  # recorded first: a --force later removes exactly these
    journal.save()
    for f in copied:
        write_bytes(dst / f.name, f.read_bytes())
    write_json(dst / REPORT, report)
    kill_point("final")
    # Last: the index, written as it is built (K3: 497k names). Its presence marks the directory complete.
    metadata = {"total_size": plan.total_bytes, "format": "tqbench", "recipe": plan.recipe.name}
    names = ((p.out.name, file) for file, s in zip(lay.files, lay.streamed()) for u in s for p in u.pieces)
    write_index(dst / INDEX_FILE, metadata, names)


def write_index(path: Path, metadata: dict[str, Any], weight_map: Iterable[tuple[str, str]]) -> None:
    """`model.safetensors.index.json` (as json.dumps(indent=2) would write it), streamed into place atomically."""
    def chunks() -> Iterator[bytes]:
        meta = json.dumps({"metadata": metadata}, indent=2)
        yield (meta[:-2] + ',\n  "weight_map": {').encode()
        first = True
        for name, file in weight_map:
            yield f'{"" if first else ","}\n    {json.dumps(name)}: {json.dumps(file)}'.encode()
            first = False
        yield b"\n  }\n}\n" if not first else b"}\n}\n"

    write_bytes(path, chunks())


def _travels(f: Path) -> bool:
    skip = {"config.json", INDEX_FILE, JOURNAL, EXPERT_MAP, REPORT}
    return (f.name not in skip and not f.name.endswith((".safetensors", ".partial", ".bin", ".pt", ".pth"))
            and not f.name.startswith(".") and f.stat().st_size <= _COPY_MAX_BYTES)


def converted_config(ckpt: Checkpoint, plan: Plan) -> dict[str, Any]:
    """The source config with its source quantization block replaced by tqbench's (tqbench.layout.quantization)."""
    config = json.loads((ckpt.path / "config.json").read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    modules, expert_names = {}, {}
    for m in plan.modules:
        c = m.choice
        if c.format is Format.TURBOQUANT:
            n = m.source.shape[1]
            modules[m.name] = ModuleQuant(format="turboquant", bits=None if c.ternary else c.bits, ternary=c.ternary,
                                          group_size=c.group_size,
                                          rotation=tq.rotation_record(n, rotated(plan.recipe, n)),
                                          scales=plan.recipe.scales, calibrated=plan.recipe.calibrate)
        elif c.format is Format.AFFINE:
            modules[m.name] = ModuleQuant(format="affine", bits=c.bits, ternary=False, group_size=c.group_size)
        elif c.format is Format.MXFP4:
            modules[m.name] = ModuleQuant(format="mxfp4", bits=4, ternary=False, group_size=32)
        else:
            continue
        if m.experts:  # the per-expert tensors, `<moe>.experts.*.<proj>`, share it
            expert_names[m.name] = m.expert_name("*")
    config["quantization"] = quantization_block(plan.recipe.to_dict(), modules, expert_names)
    return config


def _report(ckpt: Checkpoint, plan: Plan, source_fp: str, errors: dict[str, list[float]],
            seconds: float) -> dict[str, Any]:
    """Deterministic except `timings`: per module its choice, bytes and relative error (mean and max over experts)."""
    rows = []
    for m in plan.modules:
        n, total, worst = errors.get(m.name, (0, 0.0, 0.0))
        rows.append({"module": m.name, "role": m.role.value, "choice": m.choice.label, "bytes": m.bytes,
                     "experts": m.source.experts or None, "rel_error_mean": total / n if n else None,
                     "rel_error_max": worst if n else None})
    return {"recipe": plan.recipe.to_dict(), "source": ckpt.name, "source_fingerprint": source_fp,
            "bytes": {"total": plan.total_bytes, "resident": plan.resident_bytes, "streamed": plan.streamed_bytes},
            "modules": rows, "timings": {"seconds": round(seconds, 3)}}


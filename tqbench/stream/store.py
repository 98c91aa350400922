"""Where each routed expert's bytes are on disk, and reading them into a buffer: bytes only, no MLX (worker threads
call `read`; os.pread/preadv release the GIL).

- tqbench's streaming layout: one contiguous range per expert (`expert_map.json`), so one read per expert.
- Stacked layouts (TurboQuant-MLX, mlx-community): each projection's `weight`/`scales`/`biases` is a tensor with a
  leading expert axis, so an expert is one slice per tensor; reads of experts adjacent in the file coalesce.
Either way an expert becomes one buffer of `nbytes`, laid out as `parts` say, which the streamer turns into the
projection arrays of one cache slot.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tqbench.errors import TqbenchError
from tqbench.shards.header import DTYPE_SIZES

# Per-expert projection names of the sources we know -> mlx-lm's SwitchGLU projections.
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
               "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
NP_DTYPES = {"U32": np.uint32, "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "U8": np.uint8}


class StoreError(TqbenchError):
    """The expert files changed or vanished under a running session, or a layout cannot be streamed."""


@dataclass(frozen=True, kw_only=True)
class Part:
    """One array of an expert: `projection.param` (e.g. gate_proj.weight), where it lies in the expert's buffer."""

    projection: str
    param: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]  # one expert's
    offset: int  # in the expert's buffer
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Extent:
    """Bytes of one expert in a file: `length` bytes at `offset` go to `into` in the expert's buffer."""

    file: int
    offset: int
    length: int
    into: int


@dataclass(frozen=True, kw_only=True)
class LayerLayout:
    layer: int
    module: str  # the source's MoE module (`...layers.3.block_sparse_moe`)
    experts: int
    nbytes: int  # one expert's buffer
    parts: tuple[Part, ...]
    extents: tuple[tuple[Extent, ...], ...]  # per expert

    @property
    def signature(self) -> tuple:
        """Layers with equal signatures can share one slot pool."""
        return tuple((p.projection, p.param, p.dtype, p.shape) for p in self.parts)


ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of this


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), as O_DIRECT reads need."""
    import mmap

    size = -(-nbytes // ALIGN) * ALIGN
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


class ExpertStore:
    """Reads experts into caller-provided buffers. File descriptors are opened once and kept; a file that shrank or
    vanished raises StoreError naming it.

    `direct`: bypass the page cache (O_DIRECT on Linux: an aligned superset of each expert's range is read into an
    aligned buffer and the expert starts `shift` bytes in; F_NOCACHE on macOS). Only single-range experts (tqbench's
    layout) read directly; a filesystem that refuses O_DIRECT falls back to buffered reads (`direct` becomes False)."""

    def __init__(self, root: Path, files: Sequence[str], layers: dict[int, LayerLayout]):
        self.root = Path(root)
        self.files = tuple(files)
        self.layers = layers
        self.direct = False
        self._fds: dict[int, int] = {}
        self._sizes = {}
        for i, f in enumerate(self.files):
            try:
                self._sizes[i] = (self.root / f).stat().st_size
            except OSError as e:
                raise StoreError(f"cannot open an expert file: {e.strerror}", self.root / f) from None

    def only(self, keep) -> ExpertStore:
        """The same files with the layers `keep(layer)` accepts (a pipeline rank's)."""
        return ExpertStore(self.root, self.files, {n: lay for n, lay in self.layers.items() if keep(n)})

    @classmethod
    def from_expert_map(cls, root: Path) -> ExpertStore:
        from tqbench.layout.expert_map import ExpertMap

        em = ExpertMap.load(root)
        layers = {}
        for n, lay in em.layers.items():
            parts = []
            for key, t in lay.tensors.items():
                proj, _, param = key.rpartition(".")
                if proj not in PROJECTIONS:
                    raise StoreError(f"layer {n}: expert tensor {key!r} is no gate/up/down projection", root)
                parts.append(Part(projection=PROJECTIONS[proj], param=param, dtype=t.dtype, shape=t.shape,
                                  offset=t.offset, nbytes=t.nbytes))
            extents = tuple((Extent(file=fi, offset=off, length=lay.length, into=0),) for fi, off in lay.locations)
            layers[n] = LayerLayout(layer=n, module=lay.prefix.rpartition(".experts")[0], experts=lay.experts,
                                    nbytes=lay.length, parts=tuple(parts), extents=extents)
        return cls(root, em.files, layers)

    @classmethod
    def from_stacked(cls, root: Path) -> ExpertStore:
        """A stacked layout (TurboQuant-MLX, mlx-community): each `<moe>.switch_mlp.<proj>.<param>` with a leading
        expert axis gives every expert one slice (weight, scales, biases; a TurboQuant module's codebook and signs
        are per layer and stay resident). An expert is one extent per such tensor."""
        import re

        from tqbench.shards.header import read_header

        root = Path(root)
        files = sorted(p.name for p in root.glob("*.safetensors"))
        pattern = re.compile(r"^(?P<moe>.+\.layers\.(?P<layer>\d+)\.[^.]+)\.switch_mlp\.(?P<proj>gate_proj|up_proj|"
                             r"down_proj)\.(?P<param>weight|scales|biases)$")
        found: dict[int, list] = {}
        for fi, f in enumerate(files):
            for t in read_header(root / f, f).tensors:
                m = pattern.match(t.name)
                if m and len(t.shape) >= 2:
                    found.setdefault(int(m["layer"]), []).append((m, fi, t))
        if not found:
            raise StoreError("no stacked routed-expert tensors (`<moe>.switch_mlp.<proj>.weight` with a leading expert "
                             "axis) and no expert_map.json: nothing to stream", root)
        layers = {}
        for n, items in sorted(found.items()):
            items.sort(key=lambda x: (x[0]["proj"], x[0]["param"]))
            experts = {t.shape[0] for _, _, t in items}
            if len(experts) != 1:
                raise StoreError(f"layer {n}: stacked expert tensors disagree on the number of experts {sorted(experts)}",
                                 root)
            (e_count,) = experts
            parts, offset = [], 0
            for m, fi, t in items:
                one = t.nbytes // e_count
                parts.append(Part(projection=m["proj"], param=m["param"], dtype=t.dtype, shape=tuple(t.shape[1:]),
                                  offset=offset, nbytes=one))
                offset += one
            extents = tuple(tuple(Extent(file=fi, offset=t.offset + e * (t.nbytes // e_count),
                                         length=t.nbytes // e_count, into=part.offset)
                                  for (m, fi, t), part in zip(items, parts)) for e in range(e_count))
            layers[n] = LayerLayout(layer=n, module=items[0][0]["moe"], experts=e_count, nbytes=offset,
                                    parts=tuple(parts), extents=extents)
        return cls(root, files, layers)

    @classmethod
    def from_per_expert(cls, root: Path) -> ExpertStore:
        """A source checkpoint as published (Kimi K3, DeepSeek, Qwen): every expert's projections are tensors of their
        own (`<moe>.experts.E.w1.weight_packed`, `.weight_scale`, or a plain `.weight`), which mlx-lm stacks into
        `switch_mlp` at load. An mxfp4 `weight_packed` (uint8, two values a byte) is the same bytes as MLX's uint32
        mxfp4 weight; its `weight_scale` is MLX's `scales`. An expert is one extent per tensor. Experts stored in a
        format MLX converts at load (fp8 with block scales) cannot stream as stored: StoreError."""
        import re

        from tqbench.shards.header import read_header
        from tqbench.source.checkpoint import shard_files
        from tqbench.source.index import read_index

        root = Path(root)
        files = shard_files(root, read_index(root))
        pattern = re.compile(r"^(?P<moe>.+\.layers\.(?P<layer>\d+)\.[^.]+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\."
                             r"(?P<param>weight_packed|weight_scale|weight|weight_scale_inv)$")
        params = {"weight_packed": "weight", "weight_scale": "scales", "weight": "weight"}
        found: dict[int, dict[int, list]] = {}
        for fi, f in enumerate(files):
            for t in read_header(root / f, f).tensors:
                m = pattern.match(t.name)
                if not m or m["proj"] not in PROJECTIONS:
                    continue
                if m["param"] == "weight_scale_inv":
                    raise StoreError(f"{t.name}: fp8 experts with block scales cannot stream as stored (MLX converts "
                                     "them at load): convert the checkpoint first", root)
                found.setdefault(int(m["layer"]), {}).setdefault(int(m["e"]), []).append((m, fi, t))
        if not found:
            raise StoreError("no routed-expert tensors (per expert, stacked, or tqbench's expert_map.json): nothing "
                             "to stream", root)
        layers = {}
        for n, experts in sorted(found.items()):
            if sorted(experts) != list(range(len(experts))):
                raise StoreError(f"layer {n}: experts are not numbered 0..{len(experts) - 1}", root)
            parts, shapes = [], []
            for m, _, t in sorted(experts[0], key=lambda x: (PROJECTIONS[x[0]["proj"]], params[x[0]["param"]])):
                param = params[m["param"]]
                dtype, shape = t.dtype, tuple(t.shape)
                if m["param"] == "weight_packed":  # MLX's view of the same bytes
                    dtype, shape = "U32", (*shape[:-1], shape[-1] * DTYPE_SIZES[t.dtype] // 4)
                offset = parts[-1].offset + parts[-1].nbytes if parts else 0
                parts.append(Part(projection=PROJECTIONS[m["proj"]], param=param, dtype=dtype, shape=shape,
                                  offset=offset, nbytes=t.nbytes))
                shapes.append((m["proj"], m["param"], t.dtype, tuple(t.shape)))
            extents = []
            for e in range(len(experts)):
                tensors = {(m["proj"], m["param"]): (fi, t) for m, fi, t in experts[e]}
                row = []
                for (proj, param, dtype, shape), part in zip(shapes, parts):
                    fi, t = tensors.get((proj, param), (None, None))
                    if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                        raise StoreError(f"layer {n}: expert {e}'s {proj}.{param} differs from expert 0's", root)
                    row.append(Extent(file=fi, offset=t.offset, length=t.nbytes, into=part.offset))
                extents.append(tuple(row))
            moe = experts[0][0][0]["moe"]
            layers[n] = LayerLayout(layer=n, module=moe, experts=len(experts),
                                    nbytes=parts[-1].offset + parts[-1].nbytes, parts=tuple(parts),
                                    extents=tuple(extents))
        return cls(root, files, layers)

    @classmethod
    def open(cls, root: Path) -> ExpertStore:
        """tqbench's layout when `expert_map.json` is there, else a stacked layout, else per-expert source tensors."""
        from tqbench.layout.names import EXPERT_MAP

        root = Path(root)
        if (root / EXPERT_MAP).is_file():
            return cls.from_expert_map(root)
        try:
            return cls.from_stacked(root)
        except StoreError:
            return cls.from_per_expert(root)

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
            try:
                fd = self._fds[i] = os.open(self.root / self.files[i], flags)
            except OSError as e:
                raise StoreError(f"cannot open an expert file: {e.strerror}", self.root / self.files[i]) from None
            if self.direct and sys.platform == "darwin":
                import fcntl

                fcntl.fcntl(fd, 48, 1)  # F_NOCACHE
        return fd

    def set_direct(self, on: bool) -> bool:
        """Bypass the page cache from now on, if every layer is single-range and the filesystem allows it."""
        on = on and all(len(x) == 1 for lay in self.layers.values() for x in lay.extents[:1])
        if on and sys.platform.startswith("linux"):
            try:  # probe: tmpfs and some network filesystems refuse O_DIRECT
                fd = os.open(self.root / self.files[0], os.O_RDONLY | os.O_DIRECT)
                try:
                    os.preadv(fd, [memoryview(aligned_buffer(ALIGN))], 0)
                finally:
                    os.close(fd)
            except OSError:
                on = False
        self.close()
        self.direct = on
        return on

    def buffer_bytes(self, layer: int) -> int:
        """Staging bytes one expert of `layer` needs (direct reads need an aligned superset)."""
        n = self.layers[layer].nbytes
        return n + 2 * ALIGN if self.direct else n

    def shift(self, layer: int, expert: int) -> int:
        """Where the expert's bytes start in its staging buffer (0, or its offset's distance past an aligned page)."""
        return self.layers[layer].extents[expert][0].offset % ALIGN if self.direct else 0

    def direct_pieces(self, layer: int, expert: int, pieces: int) -> list[tuple[int, int, int, int, int]]:
        """The aligned superset of a single-range expert cut into up to `pieces` aligned reads:
        (file, offset, into, length, needed), `needed` the bytes of that read the expert must get (EOF may cut the
        superset's tail)."""
        (x,) = self.layers[layer].extents[expert]
        start = x.offset // ALIGN * ALIGN
        end = -(-(x.offset + x.length) // ALIGN) * ALIGN
        step = -(-(end - start) // pieces)
        step = -(-step // ALIGN) * ALIGN
        out = []
        for a in range(start, end, step):
            n = min(step, end - a)
            needed = max(0, min(a + n, x.offset + x.length) - a)
            out.append((x.file, a, a - start, n, needed))
        return out

    def read_direct(self, layer: int, expert: int, buf: np.ndarray, pieces: list | None = None) -> int:
        """O_DIRECT reads of (pieces of) the aligned superset of a single-range expert into the aligned `buf`."""
        for file, offset, into, length, needed in pieces or self.direct_pieces(layer, expert, 1):
            got = os.preadv(self._fd(file), [memoryview(buf)[into:into + length]], offset)
            if got < needed:
                path = self.root / self.files[file]
                raise StoreError(f"expert {expert} of layer {layer}: read {got} of {needed} bytes at offset {offset} "
                                 f"(the file has {_size(path)} bytes: it changed under the session)", path)
        return len(pieces) if pieces else 1

    def read(self, layer: int, expert: int, buf: np.ndarray, parts: Sequence[int] | None = None) -> int:
        """Fill `buf` (uint8, at least the expert's nbytes) with expert `expert` of `layer`; returns the number of
        reads. `parts` (indices into the layout's extents) reads only those extents (fan-out splits one expert's read
        into several such calls)."""
        lay = self.layers[layer]
        extents = lay.extents[expert] if parts is None else [lay.extents[expert][i] for i in parts]
        view = memoryview(buf)
        for x in extents:
            fd = self._fd(x.file)
            got = os.preadv(fd, [view[x.into:x.into + x.length]], x.offset)
            if got != x.length:
                path = self.root / self.files[x.file]
                size = _size(path)
                raise StoreError(f"expert {expert} of layer {layer}: read {got} of {x.length} bytes at offset "
                                 f"{x.offset} (the file has {size} bytes: it changed under the session)", path)
        return len(extents)

    def read_run(self, layer: int, experts: Sequence[int], bufs: Sequence[np.ndarray]) -> int:
        """Read consecutive experts, one buffer each: for each of an expert's extents, the experts' ranges that follow
        one another in the file are one scatter read (`preadv` into the buffers in turn). In a stacked layout a run
        of r adjacent experts costs one read per tensor instead of r. Returns the number of reads."""
        lay = self.layers[layer]
        reads = 0
        for i in range(len(lay.extents[experts[0]])):
            xs = [lay.extents[e][i] for e in experts]
            chained = all(b.file == a.file and b.offset == a.offset + a.length for a, b in zip(xs, xs[1:]))
            groups = [list(zip(xs, bufs))] if chained else [[(x, buf)] for x, buf in zip(xs, bufs)]
            for group in groups:
                first = group[0][0]
                views = [memoryview(buf)[x.into:x.into + x.length] for x, buf in group]
                want = sum(x.length for x, _ in group)
                got = os.preadv(self._fd(first.file), views, first.offset)
                reads += 1
                if got != want:
                    path = self.root / self.files[first.file]
                    raise StoreError(f"experts {experts[0]}-{experts[-1]} of layer {layer}: read {got} of {want} bytes "
                                     f"at offset {first.offset} (the file has {_size(path)} bytes: it changed under the "
                                     "session)", path)
        return reads

    def split(self, layer: int, expert: int, pieces: int) -> list[list[tuple[int, int, int]]]:
        """The expert's extents cut into up to `pieces` byte ranges of similar size, for parallel reads (fan-out):
        lists of (file, offset, into, length)."""
        out = []
        for x in self.layers[layer].extents[expert]:
            step = -(-x.length // pieces)
            step = -(-step // 4096) * 4096  # page-aligned pieces
            for a in range(0, x.length, step):
                n = min(step, x.length - a)
                out.append([(x.file, x.offset + a, x.into + a, n)])
        return out

    def read_range(self, file: int, offset: int, buf: np.ndarray, into: int, length: int) -> None:
        got = os.preadv(self._fd(file), [memoryview(buf)[into:into + length]], offset)
        if got != length:
            path = self.root / self.files[file]
            raise StoreError(f"read {got} of {length} bytes at offset {offset} (the file has {_size(path)} bytes: it "
                             "changed under the session)", path)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _size(path: Path) -> str:
    try:
        return str(path.stat().st_size)
    except OSError:
        return "no"


def part_array(buf: np.ndarray, part: Part) -> np.ndarray:
    """A numpy view of one part of an expert's buffer, in the dtype MLX should receive (bf16 as its raw uint16)."""
    n = part.nbytes // DTYPE_SIZES[part.dtype]
    return buf[part.offset:part.offset + part.nbytes].view(NP_DTYPES[part.dtype])[:n].reshape(part.shape)

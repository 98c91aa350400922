"""`expert_map.json`: where each routed expert of a converted checkpoint lives, so a runtime reads it with one pread.

Per MoE layer: the files, one (file index, absolute offset) per expert, the expert's length in bytes, and the
sub-ranges of its tensors (name after `<prefix>.E.`, offset within the expert, bytes, dtype, shape), the same for
every expert of the layer. Written by the conversion (`build`), read by runtimes (`ExpertMap.load`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tqbench.errors import CheckpointError
from tqbench.layout.names import EXPERT_MAP
from tqbench.layout.shard_units import Unit
from tqbench.shards.header import DTYPE_SIZES


def build(shards: Iterable[Iterable[Unit]], files: Sequence[str], header_lengths: Sequence[int]) -> dict[str, Any]:
    """The map of a streaming layout: `shards` are the units per file, in order (read once); `header_lengths` the
    byte length of each file's header (its data region starts there)."""
    layers: dict[str, dict[str, Any]] = {}
    for fi, (s, offset) in enumerate(zip(shards, header_lengths)):
        for u in s:
            if u.expert is not None:
                layer = layers.setdefault(str(u.layer), {"experts": [], "tensors": None, "length": u.nbytes})
                if layer["tensors"] is None:
                    rel, tensors = 0, {}
                    for p in u.pieces:
                        key = p.out.name.split(f".experts.{u.expert}.", 1)[1]
                        tensors[key] = {"offset": rel, "bytes": p.out.nbytes, "dtype": p.out.dtype,
                                        "shape": list(p.out.shape)}
                        rel += p.out.nbytes
                    layer["tensors"] = tensors
                    layer["prefix"] = u.pieces[0].out.name.split(f".experts.{u.expert}.", 1)[0] + ".experts"
                layer["experts"].append([fi, offset])
            offset += u.nbytes
    return {"layout": "streaming", "files": list(files), "layers": layers}


@dataclass(frozen=True, kw_only=True)
class TensorRange:
    offset: int  # within the expert's bytes
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class LayerExperts:
    layer: int
    prefix: str  # `<moe>.experts`: expert E's tensors are `<prefix>.E.<name>`
    length: int  # bytes of one expert
    tensors: dict[str, TensorRange]  # by name after `<prefix>.E.`, e.g. `w1.weight`
    locations: tuple[tuple[int, int], ...]  # per expert: (file index, absolute offset)

    @property
    def experts(self) -> int:
        return len(self.locations)


@dataclass(frozen=True, kw_only=True)
class ExpertMap:
    root: Path
    files: tuple[str, ...]
    layers: dict[int, LayerExperts]

    @classmethod
    def load(cls, directory: str | Path) -> ExpertMap:
        """Read and validate `expert_map.json`; raises CheckpointError naming the file and what is wrong."""
        root = Path(directory)
        path = root / EXPERT_MAP
        try:
            doc = json.loads(path.read_text())
        except OSError as e:
            raise CheckpointError(f"cannot read the expert map: {e.strerror}", path) from None
        except ValueError as e:
            raise CheckpointError(f"invalid JSON ({e})", path) from None
        if not isinstance(doc, dict):
            raise CheckpointError("malformed expert map: not a JSON object", path)
        files, layers_doc = doc.get("files"), doc.get("layers")
        if not isinstance(files, list) or not files or not all(_inside(root, f) for f in files):
            raise CheckpointError('malformed expert map: "files" is not a list of file names in its directory', path)
        if not isinstance(layers_doc, dict):
            raise CheckpointError('malformed expert map: "layers" is not an object of layers', path)
        sizes = [_size(root / f) for f in files]
        layers = {}
        for key, d in layers_doc.items():
            layer = _layer(path, key, d)
            _check_layer(path, layer, files, sizes)
            layers[layer.layer] = layer
        return cls(root=root, files=tuple(files), layers=layers)

    def locate(self, layer: int, expert: int) -> tuple[Path, int, int]:
        """(file path, absolute offset, length) of one expert's bytes."""
        lay = self.layers[layer]
        fi, offset = lay.locations[expert]
        return self.root / self.files[fi], offset, lay.length

    def tensor_names(self, layer: int, expert: int) -> Iterable[str]:
        lay = self.layers[layer]
        return (f"{lay.prefix}.{expert}.{k}" for k in lay.tensors)


def _layer(path: Path, key: str, d: Any) -> LayerExperts:
    """One layer's entry, checked field by field (a wrong one is named, never a KeyError)."""
    def wrong(what: str) -> CheckpointError:
        return CheckpointError(f"malformed expert map: layer {key}: {what}", path)

    if not (isinstance(key, str) and key.isdigit()) or not isinstance(d, dict):
        raise CheckpointError(f"malformed expert map: layer {key!r} is not a layer number with an object", path)
    prefix, length, tensors, experts = d.get("prefix"), d.get("length"), d.get("tensors"), d.get("experts")
    if not isinstance(prefix, str) or not prefix.endswith(".experts"):
        raise wrong(f'"prefix" {prefix!r} is not a module name ending in .experts')
    if not _count(length):
        raise wrong(f'"length" {length!r} is not a byte count')
    if not isinstance(tensors, dict) or not tensors:
        raise wrong('"tensors" is not an object of tensor ranges')
    ranges = {}
    for name, t in tensors.items():
        t = t if isinstance(t, dict) else {}
        offset, nbytes, dtype, shape = t.get("offset"), t.get("bytes"), t.get("dtype"), t.get("shape")
        if not (_count(offset) and _count(nbytes) and dtype in DTYPE_SIZES and isinstance(shape, list)
                and all(_count(n) for n in shape)):
            raise wrong(f"tensor {name!r} is not {{offset, bytes, dtype, shape}}: {t!r}"[:300])
        if math.prod(shape) * DTYPE_SIZES[dtype] != nbytes:
            raise wrong(f"tensor {name!r}: {nbytes} bytes, but shape {shape} x {dtype} needs "
                        f"{math.prod(shape) * DTYPE_SIZES[dtype]}")
        ranges[name] = TensorRange(offset=offset, nbytes=nbytes, dtype=dtype, shape=tuple(shape))
    if not isinstance(experts, list) or not all(isinstance(x, list) and len(x) == 2 and all(map(_count, x))
                                                 for x in experts):
        raise wrong('"experts" is not a list of [file index, offset] pairs')
    return LayerExperts(layer=int(key), prefix=prefix, length=length, tensors=ranges,
                        locations=tuple((f, o) for f, o in experts))


def _check_layer(path: Path, layer: LayerExperts, files: list[str], sizes: list[int]) -> None:
    end = 0
    for name, t in sorted(layer.tensors.items(), key=lambda kv: kv[1].offset):
        if t.offset < end or t.offset + t.nbytes > layer.length:
            raise CheckpointError(f"layer {layer.layer}: tensor {name!r} lies outside its expert's bytes", path)
        end = t.offset + t.nbytes
    for e, (fi, offset) in enumerate(layer.locations):
        if not 0 <= fi < len(files):
            raise CheckpointError(f"layer {layer.layer}: expert {e} points to file {fi} (the map names "
                                  f"{len(files)})", path)
        if offset + layer.length > sizes[fi]:
            raise CheckpointError(f"layer {layer.layer}: expert {e}'s bytes [{offset}, {offset + layer.length}) run "
                                  f"past the end of {files[fi]} ({sizes[fi]} bytes)", path)


def _count(x: Any) -> bool:
    """A whole number >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _inside(root: Path, file: Any) -> bool:
    return isinstance(file, str) and bool(file) and (root / file).resolve().parent == root.resolve()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"cannot read an expert file: {e.strerror}", path) from None

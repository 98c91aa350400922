"""`expert_map.json`: where each routed expert of a converted checkpoint lives, so a runtime reads it with one pread.

Per MoE layer: the files, one (file index, absolute offset) per expert, the expert's length in bytes, and the
sub-ranges of its tensors (name after `<prefix>.E.`, offset within the expert, bytes, dtype, shape), the same for
every expert of the layer. Written by the conversion (`build`), read by runtimes (`ExpertMap.load`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tqbench.errors import CheckpointError
from tqbench.layout.names import EXPERT_MAP
from tqbench.layout.units import Unit


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


@dataclass(frozen=True)
class TensorRange:
    offset: int  # within the expert's bytes
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerExperts:
    layer: int
    prefix: str  # `<moe>.experts`: expert E's tensors are `<prefix>.E.<name>`
    length: int  # bytes of one expert
    tensors: dict[str, TensorRange]  # by name after `<prefix>.E.`, e.g. `w1.weight`
    locations: tuple[tuple[int, int], ...]  # per expert: (file index, absolute offset)

    @property
    def experts(self) -> int:
        return len(self.locations)


@dataclass(frozen=True)
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
        try:
            files = tuple(str(f) for f in doc["files"])
            layers = {}
            for key, d in doc["layers"].items():
                tensors = {k: TensorRange(int(t["offset"]), int(t["bytes"]), str(t["dtype"]), tuple(t["shape"]))
                           for k, t in d["tensors"].items()}
                locations = tuple((int(f), int(o)) for f, o in d["experts"])
                layer = LayerExperts(int(key), str(d["prefix"]), int(d["length"]), tensors, locations)
                _check_layer(path, layer, files)
                layers[layer.layer] = layer
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"malformed expert map ({type(e).__name__}: {e})", path) from None
        return cls(root, files, layers)

    def locate(self, layer: int, expert: int) -> tuple[Path, int, int]:
        """(file path, absolute offset, length) of one expert's bytes."""
        lay = self.layers[layer]
        fi, offset = lay.locations[expert]
        return self.root / self.files[fi], offset, lay.length

    def tensor_names(self, layer: int, expert: int) -> Iterable[str]:
        lay = self.layers[layer]
        return (f"{lay.prefix}.{expert}.{k}" for k in lay.tensors)


def _check_layer(path: Path, layer: LayerExperts, files: tuple[str, ...]) -> None:
    end = 0
    for name, t in sorted(layer.tensors.items(), key=lambda kv: kv[1].offset):
        if t.offset < end or t.offset + t.nbytes > layer.length:
            raise CheckpointError(f"layer {layer.layer}: tensor {name!r} lies outside its expert's bytes", path)
        end = t.offset + t.nbytes
    for e, (fi, offset) in enumerate(layer.locations):
        if not 0 <= fi < len(files) or offset < 0:
            raise CheckpointError(f"layer {layer.layer}: expert {e} points to file {fi} offset {offset}", path)

"""`model.safetensors.index.json`: which shard holds each tensor, read without holding a name -> file map.

K3's index names 497k tensors; parsed into a dict it costs hundreds of MB for a moment, only to check that each shard
holds what the index says. Here the weight_map is scanned string by string and kept as, per shard file, the tensor
count and a checksum of the names (a sum of their hashes). A shard whose header gives the same pair matches; anything
else, and the names of missing shards, are looked up by scanning the index again for that file (rare, and exact).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from json.decoder import scanstring
from pathlib import Path
from typing import Iterable, Iterator

from tqbench.errors import CheckpointError
from tqbench.shards.header import INDEX_FILE
from tqbench.shards.jsonscan import members

_WEIGHT_MAP = re.compile(r'"weight_map"\s*:\s*\{')
_MASK = (1 << 64) - 1


def _digest(names: Iterable[str]) -> tuple[int, int]:
    count = total = 0
    for n in names:
        count += 1
        total = (total + hash(n)) & _MASK
    return count, total


@dataclass(frozen=True, kw_only=True)
class ShardIndex:
    path: Path
    files: dict[str, tuple[int, int]]  # shard file -> (tensor count, checksum of the names)
    total_size: int | None  # what metadata.total_size states

    def matches(self, file: str, names: Iterable[str]) -> bool:
        """`names` are exactly the tensors the index puts in `file`."""
        return _digest(names) == self.files.get(file)

    def names(self, file: str) -> list[str]:
        """The tensors the index puts in `file`, in index order."""
        return [n for n, f in _pairs(self.path.read_text(), self.path) if f == file]

    def missing_in(self, file: str, have: set[str]) -> str | None:
        """The first tensor the index puts in `file` that is not in `have`, or None."""
        return next((n for n in self.names(file) if n not in have), None)


def read_index(root: Path) -> ShardIndex | None:
    """The checkpoint's index, or None when it has none. Raises CheckpointError naming the file on bad input."""
    path = root / INDEX_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"invalid JSON ({e})", path) from None
    names: dict[str, list[int]] = {}
    for name, file in _pairs(text, path):
        entry = names.setdefault(file, [0, 0])
        entry[0] += 1
        entry[1] = (entry[1] + hash(name)) & _MASK
    base = root.resolve()
    for file in names:
        if Path(file).is_absolute() or (root / file).resolve().parent != base:
            raise CheckpointError(f"shard path {file!r} points outside the checkpoint directory", path)
    total = _metadata(text).get("total_size")
    return ShardIndex(path=path, files={f: (c, d) for f, (c, d) in names.items()},
                      total_size=int(total) if isinstance(total, (int, float)) else None)


def _pairs(text: str, path: Path) -> Iterator[tuple[str, str]]:
    """(tensor, shard file) of the weight_map, in order, one member at a time. Anything unexpected is handed to the
    json module, whose error (or a well-formed but wrong weight_map) gives the one-line message."""
    m = _WEIGHT_MAP.search(text)
    if m is None:
        _refuse(text, path)
    try:
        for name, file in members(text, m.end() - 1):
            if not isinstance(file, str):
                _refuse(text, path)
            yield name, file
    except ValueError:  # json.JSONDecodeError is one
        _refuse(text, path)


def _metadata(text: str) -> dict:
    """The index's `metadata` object (the document without its weight_map, parsed by json: small)."""
    m = _WEIGHT_MAP.search(text)
    depth, pos = 1, m.end()
    while depth:  # skip the weight_map object: strings are scanned whole, so braces inside names don't count
        c = text[pos]
        if c == '"':
            _, pos = scanstring(text, pos + 1)
            continue
        depth += {"{": 1, "}": -1}.get(c, 0)
        pos += 1
    doc = json.loads(text[:m.start()] + '"weight_map": {}' + text[pos:])
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    return meta if isinstance(meta, dict) else {}


def _refuse(text: str, path: Path) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"invalid JSON ({e})", path) from None
    raise CheckpointError("no weight_map object of tensor -> shard file", path)

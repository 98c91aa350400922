"""Safetensors shard headers: read and validate them without touching tensor data; the one tensor record.

Layout of a shard: 8-byte little-endian header length N, N bytes of JSON, then the data region. Each tensor entry
gives its dtype, shape and `data_offsets` [begin, end) relative to the start of the data region.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqbench.errors import CheckpointError
from tqbench.shards.jsonscan import members

# Bytes per element of every dtype the safetensors format names (sub-byte types are not used by checkpoints we read).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

INDEX_FILE = "model.safetensors.index.json"  # which shard holds each tensor, for a checkpoint of several

_DTYPES = {d: d for d in DTYPE_SIZES}  # the one string object of each dtype name (not one per tensor)

# safetensors itself refuses headers above 100 MB; a K3 shard header is well under 1 MB.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One tensor: the one record used for what a shard header says, what a conversion plans to write and what a
    writer streams. `shard` and `offset` say where it lies once in a file (`offset` absolute within the file);
    `streamed` marks a routed-expert page tensor of a converted layout, read from disk per expert."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str = ""  # file name, relative to the checkpoint directory ("" until placed)
    offset: int = 0
    streamed: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bytes": self.nbytes,
                "streamed": self.streamed}


@dataclass(frozen=True, kw_only=True)
class ShardHeader:
    """One shard's header as read from its file, every tensor entry validated (a checkpoint keeps a summary of it:
    tqbench.source.checkpoint.ShardSummary)."""

    file: str
    path: Path
    file_size: int
    data_start: int  # 8 + header length
    metadata: dict[str, str]
    tensors: tuple[TensorSpec, ...]


def read_header(path: Path, name: str | None = None) -> ShardHeader:
    """Read and validate one shard's header. Raises CheckpointError naming the file and the problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"cannot open shard: {e.strerror}", path) from None
    try:
        n = header_size(os.pread(fd, 8, 0), size, path)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    return parse_header(raw, size, path, name or path.name)


def header_size(prefix: bytes, size: int, where: str | Path) -> int:
    """The JSON header's length from a shard's first 8 bytes, checked against the file's size."""
    if size < 8 or len(prefix) < 8:
        raise CheckpointError(f"truncated: {size} bytes, too short for a safetensors header", where)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit", where)
    if 8 + n > size:
        raise CheckpointError(f"header length {n} runs past the end of the file ({size} bytes)", where)
    return n


def parse_header(raw: bytes, size: int, path: Path, name: str, where: str | None = None) -> ShardHeader:
    """Validate a shard's JSON header (the bytes after its length prefix) for a file of `size` bytes. `path` is where
    the shard is (or will be); errors name `where` (default: `path`)."""
    where = where or path
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"header is not valid JSON ({e})", where) from None
    data_start = 8 + len(raw)
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape (experts share theirs)
    metadata: dict = {}
    tensors = []
    for key, value in _items(text, where):
        if key == "__metadata__":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise CheckpointError("__metadata__ is not a JSON object of strings", where)
            metadata = value
        else:
            tensors.append(_entry(where, name, key, value=value, data_start=data_start, shapes=shapes))
    _check_bounds(where, tensors, size)
    tensors.sort(key=lambda t: t.offset)
    return ShardHeader(file=name, path=Path(path), file_size=size, data_start=data_start, metadata=metadata,
                       tensors=tuple(tensors))


def _items(text: str, path: Path) -> Iterator[tuple[str, object]]:
    """The header's (key, value) pairs, one entry decoded at a time (a shard of 3,000 tensors never becomes a dict
    of 3,000 dicts); anything malformed gets json's one-line error."""
    try:
        yield from members(text, whole=True)
    except ValueError:  # json.JSONDecodeError is one
        _refuse(text, path)


def _refuse(text: str, path: Path) -> None:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"header is not valid JSON ({e})", path) from None
    if not isinstance(doc, dict):
        raise CheckpointError("header is not a JSON object", path)
    raise CheckpointError("header is not a JSON object of tensor entries", path)


def _entry(path: Path, shard: str, key: str, value: object, data_start: int,
           shapes: dict[tuple[int, ...], tuple[int, ...]]) -> TensorSpec:
    if not isinstance(value, dict):
        raise CheckpointError(f"tensor {key!r}: entry is not a JSON object", path)
    dtype = value.get("dtype")
    shape = value.get("shape")
    offsets = value.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"tensor {key!r}: unknown dtype {dtype!r}", path)
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"tensor {key!r}: shape {shape!r} is not a list of non-negative integers", path)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(f"tensor {key!r}: data_offsets {offsets!r} are not [begin, end]", path)
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if nbytes != expected:
        raise CheckpointError(
            f"tensor {key!r}: {nbytes} bytes in the file but shape {shape} x {dtype} needs {expected}", path
        )
    shape = tuple(shape)
    return TensorSpec(name=key, dtype=_DTYPES[dtype], shape=shapes.setdefault(shape, shape), shard=shard,
                      offset=data_start + offsets[0])


def _check_bounds(path: Path, tensors: list[TensorSpec], size: int) -> None:
    end = 0
    owner: TensorSpec | None = None  # the tensor reaching furthest so far
    for t in sorted(tensors, key=lambda t: t.offset):
        if not t.nbytes:
            continue
        if owner is not None and t.offset < end:
            raise CheckpointError(f"tensors {owner.name!r} and {t.name!r} overlap", path)
        owner, end = t, t.offset + t.nbytes
    if end > size:
        raise CheckpointError(f"truncated: data ends at byte {end} but the file has {size} bytes", path)

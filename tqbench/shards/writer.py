"""Writing safetensors shards: deterministic headers, tensors streamed in order, the file appearing atomically."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from tqbench.shards.header import TensorSpec


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for tensors stored back to back in `specs` order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Streams tensors into `path` in the order of `specs`; the file appears under its name only when complete."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.specs = list(specs)
        self._next = 0
        self._hash = hashlib.sha256()
        self.nbytes = 0
        self._file = open(self.tmp, "wb")
        self._put(header_bytes(self.specs, metadata))

    def _put(self, buf: bytes | memoryview) -> None:
        self._file.write(buf)
        self._hash.update(buf)
        self.nbytes += len(buf) if isinstance(buf, bytes) else buf.nbytes

    @property
    def sha256(self) -> str:
        """Checksum of everything written so far (of the whole file once closed)."""
        return self._hash.hexdigest()

    def write(self, name: str, data: bytes | memoryview | np.ndarray) -> None:
        spec = self.specs[self._next]
        if name != spec.name:
            raise ValueError(f"expected tensor {spec.name!r} next, got {name!r}")
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf = memoryview(data)
        if buf.nbytes != spec.nbytes:
            raise ValueError(f"tensor {name!r}: {buf.nbytes} bytes given, {spec.nbytes} expected")
        self._put(buf)
        self._next += 1

    def close(self) -> Path:
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensors were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_shard(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> Path:
    """Write a whole shard from `{name: (dtype, array)}` in insertion order."""
    specs = [TensorSpec(n, dt, tuple(a.shape)) for n, (dt, a) in tensors.items()]
    with ShardWriter(path, specs, metadata) as w:
        for n, (_, a) in tensors.items():
            w.write(n, a)
    return Path(path)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like MLX and PyTorch."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)

"""Reading tensor data from shards: raw bytes with os.pread, and decoding source formats to float in MLX.

Byte reads are safe on any thread (os.pread releases the GIL); decoding touches MLX and stays on the engine thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from tqbench.errors import CheckpointError
from tqbench.source.shard import TensorEntry

_NUMPY = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
          "F8_E8M0": np.uint8, "U16": np.uint16, "I16": np.int16, "F16": np.float16, "BF16": np.uint16,
          "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64, "I64": np.int64,
          "F64": np.float64}
_CHUNK = 1 << 30  # pread reads at most ~2 GiB at once on Linux


class ShardReader:
    """Reads tensors' bytes from a checkpoint's shards, keeping one file descriptor per shard."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fds: dict[str, int] = {}

    def _fd(self, shard: str) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
        return self._fds[shard]

    def read_bytes(self, t: TensorEntry) -> bytes:
        fd, parts, done = self._fd(t.shard), [], 0
        while done < t.nbytes:
            chunk = os.pread(fd, min(_CHUNK, t.nbytes - done), t.offset + done)
            if not chunk:
                raise CheckpointError(f"tensor {t.name!r}: file ends before its data", self.root / t.shard)
            parts.append(chunk)
            done += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_numpy(self, t: TensorEntry) -> np.ndarray:
        """The tensor as stored (bf16 and fp8 as their raw integer bit patterns)."""
        return np.frombuffer(self.read_bytes(t), dtype=_NUMPY[t.dtype]).reshape(t.shape)

    def read_mlx(self, t: TensorEntry) -> mx.array:
        """The tensor as an MLX array of its own dtype (bf16 stays bf16)."""
        a = mx.array(self.read_numpy(t))
        return a.view(mx.bfloat16) if t.dtype == "BF16" else a

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decode_mxfp4(packed: mx.array, scales: mx.array) -> mx.array:
    """compressed-tensors mxfp4 (u8 codes, u8 E8M0 scales) -> float32, bit-exact through MLX's own decoder."""
    rows = packed.shape[:-1]
    words = packed.reshape(*rows, -1, 4).view(mx.uint32).reshape(*rows, -1)
    return mx.dequantize(words, scales, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)


def decode_fp8(weight: mx.array, scale_inv: mx.array) -> mx.array:
    """fp8 e4m3 with block scales (scale_inv shaped ceil(out/b) x ceil(in/b)) -> float32."""
    out, inp = weight.shape[-2:]
    w = mx.from_fp8(weight, dtype=mx.float32)
    bo, bi = -(-out // scale_inv.shape[-2]), -(-inp // scale_inv.shape[-1])
    s = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), bo, axis=-2), bi, axis=-1)[..., :out, :inp]
    return w * s

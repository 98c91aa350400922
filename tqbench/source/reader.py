"""Reading tensor data from shards: raw bytes with os.pread, and decoding source formats to float in MLX.

Byte reads are safe on any thread (os.pread releases the GIL); decoding touches MLX and stays on the engine thread.
Tensors that will be decoded can be read ahead straight into MLX-owned memory (`tqbench.source.staging`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from tqbench.errors import CheckpointError
from tqbench.shards.header import TensorSpec
from tqbench.source.staging import Arena, Region, mlx_dtype

_NUMPY = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
          "F8_E8M0": np.uint8, "U16": np.uint16, "I16": np.int16, "F16": np.float16, "BF16": np.uint16,
          "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64, "I64": np.int64,
          "F64": np.float64}
_CHUNK = 1 << 30  # pread reads at most ~2 GiB at once on Linux


class ShardReader:
    """Reads tensors' bytes from a checkpoint's shards, keeping one file descriptor per shard.

    With `workers`, `prefetch` starts reads on helper threads (they only read bytes) and `read_bytes` collects them.
    With `stage_bytes` too, `prefetch_mlx` reads into an MLX-owned arena of that size and `read_mlx` hands out views
    of it; `release()` frees what was collected once the computations that read it are evaluated.
    """

    def __init__(self, root: Path, workers: int = 0, stage_bytes: int = 0):
        self.root = Path(root)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tqbench-read") if workers else None
        self._pending: dict[tuple[str, int, int], Future[bytes]] = {}
        self._stage_bytes = stage_bytes if workers else 0
        self._arena: Arena | None = None  # made on first use, on the MLX thread
        self._staged: dict[tuple[str, int, int], tuple[Region, Future[None]]] = {}
        self.staged_reads = 0  # tensors read into the arena
        self.arena_full = 0  # tensors read as bytes instead because the arena had no room

    def _fd(self, shard: str) -> int:
        with self._lock:
            if shard not in self._fds:
                self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
            return self._fds[shard]

    def prefetch(self, entries: list[TensorSpec]) -> None:
        """Start reading these tensors in the background (no-op without workers)."""
        if self._pool is None:
            return
        for t in entries:
            key = (t.shard, t.offset, t.nbytes)
            if key not in self._pending and key not in self._staged:
                self._pending[key] = self._pool.submit(self._pread, t)

    def prefetch_mlx(self, entries: list[TensorSpec]) -> None:
        """Start reading these tensors into the arena, for `read_mlx` (MLX thread only). A tensor the arena has no
        room for, or without a staging size, is prefetched as bytes instead."""
        if self._pool is None:
            return
        rest = []
        for t in entries:
            key = (t.shard, t.offset, t.nbytes)
            if key in self._pending or key in self._staged:
                continue
            region = None
            if self._stage_bytes and mlx_dtype(t.dtype) is not None:
                if self._arena is None:
                    self._arena = Arena(self._stage_bytes)
                region = self._arena.reserve(t.nbytes)
                self.arena_full += region is None
            if region is None:
                rest.append(t)
                continue
            self._staged[key] = (region, self._pool.submit(self._pread_into, t, self._arena.target(region)))
            self.staged_reads += 1
        self.prefetch(rest)

    def discard(self, entries: list[TensorSpec]) -> None:
        """Drop prefetched reads that will not be collected."""
        for t in entries:
            key = (t.shard, t.offset, t.nbytes)
            self._pending.pop(key, None)
            staged = self._staged.pop(key, None)
            if staged is not None:  # its region is freed at the next release(), once the read has stopped writing
                region, future = staged
                future.exception()
                region.collected = True

    def release(self) -> None:
        """Free the arena regions collected so far: call only once every computation that read them is evaluated."""
        if self._arena is not None:
            self._arena.release()

    def read_bytes(self, t: TensorSpec) -> bytes:
        key = (t.shard, t.offset, t.nbytes)
        staged = self._staged.pop(key, None)
        if staged is not None:  # read into the arena after all: copied out, its region freed at the next release()
            region, future = staged
            future.result()
            region.collected = True
            return bytes(self._arena.target(region))
        future = self._pending.pop(key, None)
        return future.result() if future is not None else self._pread(t)

    def _pread(self, t: TensorSpec) -> bytes:
        fd, parts, done = self._fd(t.shard), [], 0
        while done < t.nbytes:
            chunk = os.pread(fd, min(_CHUNK, t.nbytes - done), t.offset + done)
            if not chunk:
                raise CheckpointError(f"tensor {t.name!r}: file ends before its data", self.root / t.shard)
            parts.append(chunk)
            done += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _pread_into(self, t: TensorSpec, target: memoryview) -> None:
        fd, done = self._fd(t.shard), 0
        while done < t.nbytes:
            n = os.preadv(fd, [target[done:done + min(_CHUNK, t.nbytes - done)]], t.offset + done)
            if n <= 0:
                raise CheckpointError(f"tensor {t.name!r}: file ends before its data", self.root / t.shard)
            done += n

    def read_numpy(self, t: TensorSpec) -> np.ndarray:
        """The tensor as stored (bf16 and fp8 as their raw integer bit patterns)."""
        return np.frombuffer(self.read_bytes(t), dtype=_NUMPY[t.dtype]).reshape(t.shape)

    def read_mlx(self, t: TensorSpec) -> mx.array:
        """The tensor as an MLX array of its own dtype (bf16 stays bf16; fp8 and E8M0 as uint8). One read into the
        arena is a view of it: valid until `release()`."""
        staged = self._staged.pop((t.shard, t.offset, t.nbytes), None)
        if staged is not None:
            region, future = staged
            future.result()
            return self._arena.collect(region, mlx_dtype(t.dtype), tuple(t.shape))
        a = mx.array(self.read_numpy(t))
        return a.view(mx.bfloat16) if t.dtype == "BF16" else a

    def close_shard(self, shard: str) -> None:
        """Close the file of a shard nothing will read again (its disk space is freed only once no descriptor holds
        it after it is deleted)."""
        with self._lock:
            fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        if self._pool is not None:
            for f in [*self._pending.values(), *(f for _, f in self._staged.values())]:
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
            self._staged.clear()
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


def decode_fp8(weight: mx.array, scale_inv: mx.array, block: tuple[int, int] = (128, 128)) -> mx.array:
    """fp8 e4m3 with block scales (scale_inv shaped ceil(out/bo) x ceil(in/bi)) -> float32."""
    out, inp = weight.shape[-2:]
    w = mx.from_fp8(weight, dtype=mx.float32)
    bo, bi = block
    s = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), bo, axis=-2), bi, axis=-1)[..., :out, :inp]
    return w * s

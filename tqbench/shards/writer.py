"""Writing safetensors shards: deterministic headers, tensors streamed in order, the file appearing atomically."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from tqbench.shards.header import TensorSpec


def header_parts(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> Iterator[str]:
    """The JSON header, in pieces, for tensors stored back to back in `specs` order (one pass over `specs`; joined,
    byte for byte what json.dumps of the header dict gives; ASCII, so characters are bytes)."""
    yield "{"
    sep = ""
    if metadata:
        yield json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":"))[1:-1]
        sep = ","
    offset = 0
    for s in specs:
        end = offset + s.nbytes
        shape = ",".join(map(str, s.shape))
        yield (f'{sep}{json.dumps(s.name)}:{{"dtype":{json.dumps(s.dtype)},"shape":[{shape}],'
               f'"data_offsets":[{offset},{end}]}}')
        sep, offset = ",", end
    yield "}"


def _padded(n: int) -> int:
    return n + (-n % 8)  # the format pads the header to 8 bytes with spaces


def header_length(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """len(header_bytes(specs, metadata)), without building it."""
    return 8 + _padded(sum(len(part) for part in header_parts(specs, metadata)))


def header_bytes(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for tensors stored back to back in `specs` order."""
    raw = "".join(header_parts(specs, metadata)).encode()
    raw += b" " * (_padded(len(raw)) - len(raw))
    return struct.pack("<Q", len(raw)) + raw


class ResumeError(ValueError):
    """A `.partial` file cannot be continued from a mark (missing, shorter, another header, a mark that does not fit
    the specs): the caller writes the shard over."""


@dataclass(frozen=True, kw_only=True)
class WriterMark:
    """A point up to which `<shard>.partial` is durably written: the header and the first `tensors` tensors."""

    nbytes: int  # bytes of the partial file up to the mark (header included)
    tensors: int  # tensors written before the mark

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "tensors": self.tensors}

    @classmethod
    def from_dict(cls, d) -> WriterMark:
        if not isinstance(d, dict) or set(d) != {"nbytes", "tensors"}:
            raise ValueError(f"a writer mark is {{nbytes, tensors}}, not {d!r}")
        for key, value in d.items():
            if type(value) is not int or value < 0:
                raise ValueError(f"writer mark: {key} must be a non-negative integer, not {value!r}")
        return cls(nbytes=d["nbytes"], tensors=d["tensors"])


def _datasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)


class ShardWriter:
    """Streams tensors into `path` in the order of `specs`; the file appears under its name only when complete.

    `specs` is read once and may be a generator. Given `header_length` (known from a planning pass), the header is
    streamed into the file too, so the writer never holds a shard's tensor records or its header: it keeps each
    tensor's size and a running checksum of the names, and checks every write against them.

    `mark()` makes what is written so far durable and says how far that is; a writer given `resume=` that mark (and
    the same specs and metadata) continues the `.partial` file from there, after a crash, into the same file."""

    RESUME_CHUNK = 4 << 20  # bytes read at a time to checksum the kept part of a resumed file

    def __init__(self, path: Path, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None,
                 header_length: int | None = None, background: bool = False, resume: WriterMark | None = None):
        self.path = Path(path)
        self._worker: _Worker | None = None
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self._sizes = array("Q")
        self._names = hashlib.sha256()  # the header's names in order
        self._written = hashlib.sha256()  # the written ones
        kept = resume.tensors if resume is not None else 0  # tensors already in the resumed file

        def counted() -> Iterator[TensorSpec]:
            for spec in specs:
                if len(self._sizes) < kept:
                    self._written.update(spec.name.encode() + b"\0")
                self._sizes.append(spec.nbytes)
                self._names.update(spec.name.encode() + b"\0")
                yield spec

        self._next = 0
        self._hash = hashlib.sha256()
        self.nbytes = 0
        self._mark = resume  # the last durable mark (the directory entry is durable once there is one)
        if resume is None:
            self._file = open(self.tmp, "wb")
            self._write_header(counted(), metadata, header_length)
        else:
            self._continue(resume, counted(), metadata, header_length)
        if background:
            self._worker = _Worker(self._file, self._hash)

    def _write_header(self, specs: Iterable[TensorSpec], metadata: dict[str, str] | None,
                      header_length: int | None) -> None:
        if header_length is None:
            self._put(header_bytes(specs, metadata))
            return
        self._put(struct.pack("<Q", header_length - 8))
        for part in header_parts(specs, metadata):
            self._put(part.encode())
        self._put(b" " * (header_length - self.nbytes) if self.nbytes <= header_length else b"")
        if self.nbytes != header_length:
            self.abort()
            raise ValueError(f"{self.path}: the header takes {self.nbytes} bytes, {header_length} were planned")

    def _continue(self, mark: WriterMark, specs: Iterable[TensorSpec], metadata: dict[str, str] | None,
                  header_length: int | None) -> None:
        """Open the partial file at `mark`: check it, drop what follows the mark, checksum what precedes it."""
        try:
            self._file = open(self.tmp, "r+b")
        except FileNotFoundError:
            raise ResumeError(f"{self.tmp}: no partial file to resume") from None
        try:
            head = self._check_header(specs, metadata)
            if header_length is not None and head != header_length:
                raise ValueError(f"{self.path}: the header takes {head} bytes, {header_length} were planned")
            if mark.tensors > len(self._sizes) or mark.nbytes != head + sum(self._sizes[:mark.tensors]):
                raise ResumeError(f"{self.tmp}: mark {mark.to_dict()} does not fit its {len(self._sizes)} tensors")
            size = os.fstat(self._file.fileno()).st_size
            if size < mark.nbytes:
                raise ResumeError(f"{self.tmp}: {size} bytes, shorter than the mark's {mark.nbytes}")
            chunk, at = memoryview(bytearray(self.RESUME_CHUNK)), head
            while at < mark.nbytes:
                got = self._file.readinto(chunk[:min(len(chunk), mark.nbytes - at)])
                if not got:
                    raise ResumeError(f"{self.tmp}: ends at {at} bytes, before the mark's {mark.nbytes}")
                self._hash.update(chunk[:got])
                at += got
            self._file.truncate(mark.nbytes)
            self._file.seek(mark.nbytes)
        except BaseException:
            self._file.close()
            raise
        self.nbytes, self._next = mark.nbytes, mark.tensors

    def _check_header(self, specs: Iterable[TensorSpec], metadata: dict[str, str] | None) -> int:
        """Compare the file's header with the one `specs` and `metadata` give, one part at a time, checksumming it;
        its length."""
        differs = ResumeError(f"{self.tmp}: its header is not this shard's")
        prefix = self._file.read(8)
        if len(prefix) != 8:
            raise differs
        self._hash.update(prefix)
        n = 0
        for part in header_parts(specs, metadata):
            raw = part.encode()
            if self._file.read(len(raw)) != raw:
                raise differs
            self._hash.update(raw)
            n += len(raw)
        pad = b" " * (_padded(n) - n)
        if self._file.read(len(pad)) != pad or struct.unpack("<Q", prefix)[0] != n + len(pad):
            raise differs
        self._hash.update(pad)
        return 8 + n + len(pad)

    def _put(self, buf: bytes | memoryview) -> None:
        if self._worker is not None:
            self._worker.put(buf)
        else:
            self._file.write(buf)
            self._hash.update(buf)
        self.nbytes += len(buf) if isinstance(buf, bytes) else buf.nbytes

    @property
    def sha256(self) -> str:
        """Checksum of everything written so far (of the whole file once closed)."""
        return self._hash.hexdigest()

    def write(self, name: str, data: bytes | memoryview | np.ndarray) -> None:
        if self._next >= len(self._sizes):
            raise ValueError(f"tensor {name!r}: the header of {self.path.name} names no more tensors")
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf = memoryview(data)
        if buf.nbytes != self._sizes[self._next]:
            raise ValueError(f"tensor {name!r}: {buf.nbytes} bytes given, {self._sizes[self._next]} expected")
        self._written.update(name.encode() + b"\0")
        self._put(buf)
        self._next += 1

    def mark(self) -> WriterMark:
        """Make everything written so far durable (the background thread's writes included); how far that is."""
        if self._mark is not None and self._mark.nbytes == self.nbytes:
            return self._mark
        if self._worker is not None:
            self._worker.sync()
        else:
            self._file.flush()
            _datasync(self._file.fileno())
        if self._mark is None:  # the file's directory entry too, once
            fd = os.open(self.tmp.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._mark = WriterMark(nbytes=self.nbytes, tensors=self._next)
        return self._mark

    def close(self) -> Path:
        if self._next != len(self._sizes):
            raise ValueError(f"{self.path}: {len(self._sizes) - self._next} tensors were never written")
        if self._written.digest() != self._names.digest():
            raise ValueError(f"{self.path}: tensors were written under other names or in another order than the "
                             "header's")
        if self._worker is not None:
            self._worker, worker = None, self._worker
            worker.finish()  # re-raises the writing thread's error
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self, keep_marked: bool = False) -> None:
        """Stop writing and delete the `.partial` file; with `keep_marked`, keep it when a mark was taken (a caller
        that removed what the marked part was made from continues it with `resume=` later)."""
        if self._worker is not None:
            self._worker, worker = None, self._worker
            try:
                worker.finish()
            except Exception:  # noqa: BLE001 - the shard is dropped anyway; the caller's error is the one to report
                pass
        try:
            self._file.close()  # flushes what is buffered, which fails again when the disk is full (closed anyway)
        except OSError:
            pass
        if not (keep_marked and self._mark is not None):
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _Worker:
    """One thread that hashes and writes a shard's tensors in order while the caller produces the next ones; it
    flushes written data to disk every FLUSH_EVERY bytes, so the final fsync has little left to do. The caller keeps
    every buffer alive until the thread is done with it and drops it on its own thread (a buffer may be a view of an
    MLX array's memory, which the MLX thread alone should free). At most MAX_QUEUED buffers wait."""

    MAX_QUEUED = 8
    FLUSH_EVERY = 256 << 20

    def __init__(self, file, digest):
        self.file, self.digest = file, digest
        self.queue: queue.Queue = queue.Queue(self.MAX_QUEUED)
        self.held: deque = deque()  # buffers given to the thread, oldest first, until it reports them done
        self.done = 0  # buffers the thread has written (only it increments)
        self.released = 0  # buffers dropped from `held` (only the caller increments)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tqbench-shard-writer", daemon=True)
        self.thread.start()

    def put(self, buf) -> None:
        if self.error is not None:
            raise self.error
        self.held.append(buf)
        self.queue.put(buf)  # blocks while MAX_QUEUED wait
        self._release()

    def _release(self) -> None:
        while self.released < self.done:  # the thread is done with the oldest ones: drop them here
            self.held.popleft()
            self.released += 1

    def sync(self) -> None:
        """Wait until the thread has written every buffer given so far and flushed them to disk."""
        if self.error is not None:
            raise self.error
        synced = threading.Event()
        self.queue.put(synced)
        synced.wait()
        self._release()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        unflushed = 0
        while True:
            buf = self.queue.get()
            if buf is None:
                return
            if isinstance(buf, threading.Event):  # a sync request: everything before it is written
                try:
                    if self.error is None:
                        self.file.flush()
                        _datasync(self.file.fileno())
                        unflushed = 0
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    self.error = e
                buf.set()
                continue
            try:
                if self.error is None:
                    self.file.write(buf)
                    self.digest.update(buf)
                    unflushed += len(buf) if isinstance(buf, bytes) else buf.nbytes
                    if unflushed >= self.FLUSH_EVERY:
                        self.file.flush()
                        _datasync(self.file.fileno())
                        unflushed = 0
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self.error = e
            del buf
            self.done += 1

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.held.clear()
        if self.error is not None:
            raise self.error


def save_shard(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> Path:
    """Write a whole shard from `{name: (dtype, array)}` in insertion order."""
    specs = [TensorSpec(name=n, dtype=dt, shape=tuple(a.shape)) for n, (dt, a) in tensors.items()]
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

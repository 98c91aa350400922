"""ShardWriter: the background (threaded) writer gives the same file and checksum as the plain one."""

import hashlib
import json
import struct

import numpy as np
import pytest

from tqbench.shards.header import TensorSpec
from tqbench.shards.writer import ShardWriter, _Worker, header_length


def _tensors(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(f"t.{i}", rng.integers(0, 2**32, int(rng.integers(1, 5000)), dtype=np.uint32)) for i in range(n)]


def _write(path, tensors, background: bool):
    specs = [TensorSpec(n, "U32", tuple(a.shape)) for n, a in tensors]
    w = ShardWriter(path, iter(specs), {"format": "mlx"}, header_length(specs, {"format": "mlx"}), background)
    for n, a in tensors:
        w.write(n, a)
    w.close()
    return w


@pytest.mark.parametrize("flush_every", [1 << 30, 4096])
def test_background_writes_the_same_bytes_and_checksum(tmp_path, monkeypatch, flush_every):
    monkeypatch.setattr(_Worker, "FLUSH_EVERY", flush_every)  # also exercise the periodic fdatasync
    tensors = _tensors()
    a = _write(tmp_path / "a.safetensors", tensors, False)
    b = _write(tmp_path / "b.safetensors", tensors, True)
    data = (tmp_path / "b.safetensors").read_bytes()
    assert data == (tmp_path / "a.safetensors").read_bytes()
    assert b.sha256 == a.sha256 == hashlib.sha256(data).hexdigest()
    assert b.nbytes == len(data)
    # and it is a valid safetensors file: every tensor at its offsets
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    for name, arr in tensors:
        s, e = header[name]["data_offsets"]
        assert np.array_equal(np.frombuffer(data[8 + n + s:8 + n + e], np.uint32), arr)
    assert not list(tmp_path.glob("*.partial"))


def test_background_abort_leaves_nothing_and_size_errors_still_raise(tmp_path):
    tensors = _tensors(5)
    specs = [TensorSpec(n, "U32", tuple(a.shape)) for n, a in tensors]
    w = ShardWriter(tmp_path / "c.safetensors", iter(specs), None, header_length(specs), background=True)
    w.write(*tensors[0])
    with pytest.raises(ValueError, match="t.1"):
        w.write("t.1", tensors[1][1][:-1])  # one element short
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_buffers_are_released_by_the_caller_once_written(tmp_path):
    tensors = _tensors(30)
    specs = [TensorSpec(n, "U32", tuple(a.shape)) for n, a in tensors]
    w = ShardWriter(tmp_path / "d.safetensors", iter(specs), None, header_length(specs), background=True)
    for n, a in tensors:
        w.write(n, a)
    worker = w._worker
    assert len(worker.held) <= worker.MAX_QUEUED + 2  # bounded: no more than the queue plus the ones in hand
    w.close()
    assert worker.held == type(worker.held)() and worker.done == len(tensors)

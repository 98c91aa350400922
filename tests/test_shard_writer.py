"""ShardWriter: the background (threaded) writer gives the same file and checksum as the plain one; a .partial file
continued from a mark after a crash ends byte-identical to an uninterrupted write."""

import hashlib
import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tqbench.shards.header import TensorSpec
from tqbench.shards.writer import ResumeError, ShardWriter, WriterMark, _Worker, header_length


def _tensors(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(f"t.{i}", rng.integers(0, 2**32, int(rng.integers(1, 5000)), dtype=np.uint32)) for i in range(n)]


def _write(path, tensors, background: bool):
    specs = [TensorSpec(name=n, dtype="U32", shape=tuple(a.shape)) for n, a in tensors]
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
    specs = [TensorSpec(name=n, dtype="U32", shape=tuple(a.shape)) for n, a in tensors]
    w = ShardWriter(tmp_path / "c.safetensors", iter(specs), None, header_length(specs), background=True)
    w.write(*tensors[0])
    with pytest.raises(ValueError, match="t.1"):
        w.write("t.1", tensors[1][1][:-1])  # one element short
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_buffers_are_released_by_the_caller_once_written(tmp_path):
    tensors = _tensors(30)
    specs = [TensorSpec(name=n, dtype="U32", shape=tuple(a.shape)) for n, a in tensors]
    w = ShardWriter(tmp_path / "d.safetensors", iter(specs), None, header_length(specs), background=True)
    for n, a in tensors:
        w.write(n, a)
    worker = w._worker
    assert len(worker.held) <= worker.MAX_QUEUED + 2  # bounded: no more than the queue plus the ones in hand
    w.close()
    assert worker.held == type(worker.held)() and worker.done == len(tensors)


# Resuming a .partial from a mark after a crash

_META = {"format": "mlx"}


def _mixed_tensors():
    """Varied sizes, three of them above the 4 MiB a resume reads at a time."""
    rng = np.random.default_rng(7)
    sizes = [3, 1 << 20, 17, (5 << 20) // 4 + 3, 1000, (9 << 20) // 4 + 1, 4, (4 << 20) // 4]
    return [(f"layer.{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)]


def _specs(tensors):
    return [TensorSpec(name=n, dtype="F32", shape=tuple(a.shape)) for n, a in tensors]


def _writer(path, tensors, background, resume=None, metadata=_META):
    specs = _specs(tensors)
    return ShardWriter(path, iter(specs), metadata, header_length(specs, metadata), background, resume=resume)


def _write_all(path, tensors):
    path.parent.mkdir()
    w = _writer(path, tensors, False)
    for n, a in tensors:
        w.write(n, a)
    w.close()
    return path.read_bytes()


def _partial(path):
    return path.with_name(path.name + ".partial")


def _crash_at(path, tensors, k, background):
    """Write tensors, mark after the first `k`, write the rest but one, then stop as a crash would: no close, no
    abort, no rename, and garbage after whatever reached the file."""
    w = _writer(path, tensors, background)
    for n, a in tensors[:k]:
        w.write(n, a)
    mark = w.mark()
    for n, a in tensors[k:-1]:
        w.write(n, a)
    if w._worker is not None:
        w._worker.finish()  # the thread ends; the writer never renames
    w._file.close()
    with open(w.tmp, "ab") as f:
        f.write(b"\xde\xad" * 12345)
    return mark


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("k", [0, 3, 5, 8])
def test_resume_from_a_mark_gives_the_uninterrupted_file(tmp_path, background, k):
    tensors = _mixed_tensors()
    whole = _write_all(tmp_path / "whole" / "s.safetensors", tensors)
    path = tmp_path / "s.safetensors"
    mark = _crash_at(path, tensors, k, background)
    specs = _specs(tensors)
    assert mark == WriterMark(nbytes=header_length(specs, _META) + sum(s.nbytes for s in specs[:k]), tensors=k)
    assert WriterMark.from_dict(json.loads(json.dumps(mark.to_dict()))) == mark

    w = _writer(path, tensors, background, resume=mark)
    assert w.nbytes == mark.nbytes
    kept = (tmp_path / "s.safetensors.partial").read_bytes()
    assert len(kept) == mark.nbytes and w.sha256 == hashlib.sha256(kept).hexdigest()
    for n, a in tensors[k:]:
        w.write(n, a)
    assert w.close() == path
    data = path.read_bytes()
    assert data == whole
    assert w.sha256 == hashlib.sha256(data).hexdigest() and w.nbytes == len(data)
    assert not list(tmp_path.glob("*.partial"))


def test_a_resumed_writer_still_checks_names_and_order(tmp_path):
    tensors = _mixed_tensors()
    mark = _crash_at(tmp_path / "s.safetensors", tensors, 3, False)
    w = _writer(tmp_path / "s.safetensors", tensors, False, resume=mark)
    with pytest.raises(ValueError, match="bytes given"):
        w.write(*tensors[2])  # tensor 2 is already in the file; the next one is tensor 3, of another size
    for n, a in tensors[3:-1]:
        w.write(n, a)
    with pytest.raises(ValueError, match="1 tensors were never written"):
        w.close()
    w.write("other.name", tensors[-1][1])
    with pytest.raises(ValueError, match="other names"):
        w.close()


def test_mark_flushes_the_background_thread_and_releases_its_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(_Worker, "FLUSH_EVERY", 4096)  # periodic flushes between the marks
    tensors = _mixed_tensors()
    w = _writer(tmp_path / "s.safetensors", tensors, True)
    for i, (n, a) in enumerate(tensors):
        w.write(n, a)
        mark = w.mark()
        assert mark.tensors == i + 1 and mark.nbytes == w.nbytes
        assert w.tmp.stat().st_size == w.nbytes  # all of it reached the file
        assert len(w._worker.held) == 0 and w._worker.done == w._worker.released
        assert w.mark() is mark  # nothing new: no second sync
    w.close()
    assert w.sha256 == hashlib.sha256((tmp_path / "s.safetensors").read_bytes()).hexdigest()


def test_mark_raises_the_background_threads_error(tmp_path):
    tensors = _mixed_tensors()
    path = tmp_path / "s.safetensors"
    _partial(path).symlink_to("/dev/full")  # every flush fails: ENOSPC
    w = _writer(path, tensors, True)
    w.write(*tensors[0])
    with pytest.raises(OSError, match="No space left"):
        w.mark()
    with pytest.raises(OSError, match="No space left"):
        w.write(*tensors[1])  # the error stays
    w.abort()
    assert list(tmp_path.iterdir()) == []


_CHILD = """
import json, os, signal, sys
sys.path.insert(0, os.getcwd())
from tests.test_shard_writer import _mixed_tensors, _writer
path, k = sys.argv[1], int(sys.argv[2])
tensors = _mixed_tensors()
w = _writer(path, tensors, True)
for n, a in tensors[:k]:
    w.write(n, a)
mark = w.mark()
with open(path + ".mark.json", "w") as f:
    json.dump(mark.to_dict(), f)
for n, a in tensors[k:-1]:
    w.write(n, a)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_resume_after_a_real_kill(tmp_path):
    tensors = _mixed_tensors()
    whole = _write_all(tmp_path / "whole" / "s.safetensors", tensors)
    path = tmp_path / "s.safetensors"
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", _CHILD, str(path), "4"], cwd=repo, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not path.exists() and _partial(path).exists()
    mark = WriterMark.from_dict(json.loads((tmp_path / "s.safetensors.mark.json").read_text()))
    assert mark.tensors == 4
    w = _writer(path, tensors, True, resume=mark)
    for n, a in tensors[4:]:
        w.write(n, a)
    w.close()
    data = path.read_bytes()
    assert data == whole and w.sha256 == hashlib.sha256(data).hexdigest()


def test_resume_refuses_what_does_not_match(tmp_path):
    tensors = _mixed_tensors()
    path = tmp_path / "s.safetensors"
    with pytest.raises(ResumeError, match=r"s\.safetensors\.partial: no partial file"):
        _writer(path, tensors, False, resume=WriterMark(nbytes=100, tensors=0))

    mark = _crash_at(path, tensors, 4, False)
    partial = _partial(path)
    with pytest.raises(ResumeError, match=r"s\.safetensors\.partial: its header is not this shard's"):
        _writer(path, tensors, False, resume=mark, metadata={"format": "pt"})
    with pytest.raises(ResumeError, match="header is not this shard's"):
        _writer(path, tensors[:-1], False, resume=mark)  # one tensor fewer: another header
    with pytest.raises(ResumeError, match=r"does not fit its 8 tensors"):
        _writer(path, tensors, False, resume=WriterMark(nbytes=mark.nbytes + 4, tensors=mark.tensors))
    with pytest.raises(ResumeError, match=r"does not fit its 8 tensors"):
        _writer(path, tensors, False, resume=WriterMark(nbytes=mark.nbytes, tensors=9))
    size = partial.stat().st_size
    assert size > mark.nbytes  # nothing was cut by the refusals

    with open(partial, "r+b") as f:
        f.truncate(mark.nbytes - 1)
    with pytest.raises(ResumeError, match=rf"s\.safetensors\.partial: {mark.nbytes - 1} bytes, shorter than"):
        _writer(path, tensors, False, resume=mark)


@pytest.mark.parametrize("bad", [None, [1, 2], {"nbytes": 5}, {"nbytes": 5, "tensors": 1, "x": 0},
                                 {"nbytes": -1, "tensors": 0}, {"nbytes": "5", "tensors": 0},
                                 {"nbytes": 5, "tensors": True}, {"nbytes": 5.0, "tensors": 0}])
def test_a_malformed_mark_is_refused(bad):
    with pytest.raises(ValueError, match="mark"):
        WriterMark.from_dict(bad)

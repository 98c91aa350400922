"""Helpers the tests share: running a loaded model, the bytes of a converted model's experts, a conversion's tensors
and files, rewriting a shard's header, what the file system allows, free loopback ports."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import numpy as np


def output_tensors(dst: Path) -> dict[str, tuple[str, tuple[int, ...], int, str]]:
    """Every tensor a conversion wrote: name -> (dtype, shape, bytes, shard file)."""
    from tqbench.shards.header import read_header

    out = {}
    for f in sorted(dst.glob("*.safetensors")):
        for t in read_header(f).tensors:
            out[t.name] = (t.dtype, t.shape, t.nbytes, f.name)
    return out


def read_tensor(dst: Path, name: str) -> np.ndarray:
    """One tensor of a conversion, as numpy."""
    from tqbench.shards.header import read_header
    from tqbench.source.reader import ShardReader

    for f in sorted(dst.glob("*.safetensors")):
        for t in read_header(f).tensors:
            if t.name == name:
                with ShardReader(dst) as r:
                    return r.read_numpy(t)
    raise KeyError(name)


def file_bytes(dst: Path, drop: tuple[str, ...] = ("timings",)) -> dict[str, bytes]:
    """Every output file; the report without its `drop` keys (by default its timings, the one part that may differ
    between runs)."""
    from tqbench.layout.names import REPORT

    out = {}
    for p in sorted(dst.iterdir()):
        data = p.read_bytes()
        if p.name == REPORT:
            doc = json.loads(data)
            for key in drop:
                doc.pop(key)
            data = json.dumps(doc).encode()
        out[p.name] = data
    return out


def logits(model, tokens: list[int]) -> np.ndarray:
    """One forward pass over `tokens` (a batch of one), as float32."""
    import mlx.core as mx

    return np.array(model(mx.array([tokens])).astype(mx.float32))


def logits_and_tokens(model, prompt: list[int], n: int = 10) -> tuple[np.ndarray, list[int]]:
    """The prompt's logits and the first `n` greedy tokens mlx-lm generates after it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)), range(n))]
    return logits(model, prompt), tokens


def expert_bytes(model: Path) -> int:
    """One routed expert's bytes in a converted model, as its expert map says (every MoE layer alike)."""
    from tqbench.stream.store import ExpertStore

    store = ExpertStore.open(model)
    sizes = {lay.nbytes for lay in store.layers.values()}
    store.close()
    assert len(sizes) == 1
    return sizes.pop()


def read_header(path: Path) -> tuple[int, bytes]:
    """A safetensors file's header: its length and its JSON bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, f.read(n)


def put_header(path: Path, header: dict) -> None:
    """Rewrite a shard with a new header and the old data bytes (offsets are relative to the data)."""
    n, _ = read_header(path)
    data = path.read_bytes()[8 + n:]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def takes_o_direct(path: Path) -> bool:
    """Whether the file system at `path` opens files with O_DIRECT: `path` itself if it is a file, else a probe file
    written into the directory `path` (made if missing)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    if path.is_file():
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
            return True
        except OSError:
            return False
    path.mkdir(parents=True, exist_ok=True)
    probe = path / "o-direct-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(count: int = 1) -> int:
    """A loopback port nothing listens on, with `count` free ones from it (the ring backend listens on one per
    rank); bound and released, so another process could still take it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


class OnDemand(dict):
    """A dict whose missing values are made by `make(key)` when first asked for: a module fixture of several models
    builds (or converts, or runs) only those that the selected tests use."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value

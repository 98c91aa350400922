"""A model's identity for its hot-expert profile: derived from what decides which expert is which (the config, where
every routed expert lives, every tensor's name, shape and dtype, and a sample of every router's bytes), never from the
directory's path. A re-conversion with another recipe or layout gets another fingerprint, and so does a model retrained
or fine-tuned to the same shapes (its routers change), so stale counts are never reused; moving or copying the
directory keeps it."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqbench.stream.store import ExpertStore


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """What a profile's counts must match: MoE layers and experts per layer, and the routing top-k."""

    model_type: str
    layers: tuple[int, ...]  # MoE layer numbers, in order
    experts: int
    top_k: int

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "layers": list(self.layers), "experts": self.experts,
                "top_k": self.top_k}


ROUTER_SUFFIXES = (".gate.weight", ".gate.e_score_correction_bias")  # a MoE block's router (not `gate_proj`)
ROUTER_SAMPLE = 4096  # bytes read from the start of each router tensor


def fingerprint(path: str | Path, store: ExpertStore | None = None) -> str:
    """sha256 (first 16 hex digits) of the config, the expert layout, the tensor table (headers) and the first
    ROUTER_SAMPLE bytes of every router tensor (a few small reads, whatever the model's size)."""
    from tqbench.shards.header import read_header

    root = Path(path)
    h = hashlib.sha256()
    config = json.loads((root / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    store = store or _open(root)
    for n, lay in sorted(store.layers.items()):
        h.update(repr((n, lay.experts, lay.nbytes, lay.signature, lay.extents[0], lay.extents[-1])).encode())
    headers: dict[Path, list] = {}  # each shard's header is read once

    def tensors(f: Path) -> list:
        if f not in headers:
            headers[f] = read_header(f, f.name).tensors
        return headers[f]

    for f in store.files:
        for t in tensors(root / f):
            h.update(f"{t.name}|{t.dtype}|{t.shape}\n".encode())
    for f in sorted(root.glob("*.safetensors")):
        routers = [t for t in tensors(f) if t.name.endswith(ROUTER_SUFFIXES)]
        if routers:
            fd = os.open(f, os.O_RDONLY)
            try:
                for t in sorted(routers, key=lambda t: t.name):
                    h.update(t.name.encode() + os.pread(fd, min(t.nbytes, ROUTER_SAMPLE), t.offset))
            finally:
                os.close(fd)
    return h.hexdigest()[:16]


def _open(root: Path) -> ExpertStore:
    """The model's expert layout (headers or expert_map.json only; no file stays open)."""
    from tqbench.stream.store import ExpertStore

    store = ExpertStore.open(root)
    store.close()
    return store


def geometry(path: str | Path, store: ExpertStore | None = None) -> Geometry:
    from tqbench.source.config import parse_config

    root = Path(path)
    raw = json.loads((root / "config.json").read_text())
    cfg = parse_config(raw, root / "config.json")
    store = store or _open(root)
    layers = tuple(sorted(store.layers))
    experts = max(lay.experts for lay in store.layers.values())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    model_type = str(raw.get("model_type") or text.get("model_type") or "")  # as tqbench.runtime.load names it
    return Geometry(model_type=model_type, layers=layers, experts=experts, top_k=int(cfg.top_k or 0))

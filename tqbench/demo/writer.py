"""The demo checkpoint writer: a K3-layout source checkpoint of a `DemoSpec` from any weights source, the tensors
split into `spec.num_shards` shards by the project's greedy shard split, built in a temporary directory next to the
destination and renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from tqbench.demo.spec import DemoSpec, source_config, special_ids, tensor_plan
from tqbench.demo.tokenizer import demo_tokenizer_ranks
from tqbench.demo.weights import WeightSource, random_weights
from tqbench.layout.names import shard_file
from tqbench.layout.shard_units import assign_shards
from tqbench.shards.header import TensorSpec
from tqbench.shards.writer import ShardWriter
from tqbench.tokenizer import write_tokenizer


def write_checkpoint(dest: Path, spec: DemoSpec, weights: WeightSource, ranks: dict[bytes, int]) -> Path:
    """Write a K3-layout source checkpoint for `spec` (tensors from `weights`, a tiktoken vocabulary `ranks` of
    `spec.base_vocab` tokens) to `dest`, replacing it, atomically: it is built in a temporary directory next to `dest`
    and renamed into place."""
    if len(ranks) != spec.base_vocab:
        raise ValueError(f"the tokenizer has {len(ranks)} tokens, the spec wants {spec.base_vocab}")
    return build_atomically(Path(dest), lambda tmp: _write_into(tmp, spec, weights, ranks), replace=True)


def write_source(dest: Path, spec: DemoSpec = DemoSpec(), seed: int = 0) -> Path:
    """Write a seeded random K3-layout source checkpoint for `spec` to `dest` (replacing it), atomically."""
    return write_checkpoint(dest, spec, random_weights(seed), demo_tokenizer_ranks(spec))


def build_atomically(dest: Path, fill: Callable[[Path], None], replace: bool) -> Path:
    """Make the directory `dest` by `fill`ing a temporary directory next to it and renaming that into place; an
    existing `dest` is replaced when `replace`, else kept (another process made it first)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        fill(tmp)
        if dest.exists() and not replace:  # another process finished first
            shutil.rmtree(tmp)
        else:
            _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def split_shards(plan: list[TensorSpec], num_shards: int) -> list[list[TensorSpec]]:
    """The tensors in order, in at most `num_shards` shards: the project's greedy split (`assign_shards`) at the
    smallest shard size that needs no more shards than that."""
    lo, hi = max((t.nbytes for t in plan), default=1), max(sum(t.nbytes for t in plan), 1)
    while lo < hi:  # the greedy split never makes more shards of a larger size
        mid = (lo + hi) // 2
        if len(assign_shards(plan, mid)) <= num_shards:
            hi = mid
        else:
            lo = mid + 1
    return assign_shards(plan, lo)


def _write_into(out: Path, spec: DemoSpec, weights: WeightSource, ranks: dict[bytes, int]) -> None:
    write_tokenizer(out, ranks)
    plan = tensor_plan(spec)
    shards = split_shards(plan, spec.num_shards)
    weight_map: dict[str, str] = {}
    for k, tensors in enumerate(shards):
        fname = shard_file(k, len(shards))
        with ShardWriter(out / fname, tensors, {"format": "pt"}) as w:
            for t in tensors:
                w.write(t.name, weights(t))
                weight_map[t.name] = fname
    total = sum(t.nbytes for t in plan)
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", source_config(spec))
    _write_json(out / "generation_config.json", {**special_ids(spec), "max_new_tokens": 64})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _swap_into_place(new: Path, dest: Path) -> None:
    """Rename `new` to `dest`; an existing `dest` is moved aside first and deleted after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
        os.replace(dest, old / dest.name)
    try:
        os.replace(new, dest)
    except OSError:
        if dest.exists():  # another process put a complete one there first
            shutil.rmtree(new, ignore_errors=True)
        else:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

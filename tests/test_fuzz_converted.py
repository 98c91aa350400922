"""Fuzzing a converted model: its shard headers, shard lengths, config, expert map and index are mutated at random
(a fixed seed, so a failure is reproducible by its number), and `tqbench inspect` and `tqbench chat --prompt` must
either run or stop with one error line: never a traceback, never a hang.

Each mutant is a copy of the converted model in which only the mutated file is a new file (the rest are hard links,
never written). Chat runs half the mutants resident and half with its routed experts streamed through a small cache,
so the expert map is read on the path that uses it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from cli_helpers import tqbench
from conftest import demo_tq4
from model_helpers import put_header, read_header

pytestmark = pytest.mark.slow

MUTANTS = 60  # ~2 min on 2 cores (each mutant that passes the checks costs a model load)
SEED = 29
SECONDS_PER_RUN = 120  # a run that takes longer has hung


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The demo converted with tq4 into several shards (so a shard can go missing), streaming layout."""
    dest = demo_tq4(tmp_path_factory.mktemp("fuzz"), shard_size=4_000_000)
    assert len(list(dest.glob("model-*.safetensors"))) >= 3
    return dest


@dataclass(frozen=True)
class Mutant:
    number: int
    what: str  # what was done, for the failure report


# -- mutations: each takes (model dir, rng) and returns what it did ------------------------------------------------

def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


def flip_header_byte(root: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(root))
    n, _ = read_header(shard)
    pos = 8 + rng.randrange(n)
    new = rng.choice(b'"{}[],:-0123456789eE x\x00\xff')
    with open(shard, "r+b") as f:
        f.seek(pos)
        f.write(bytes([new]))
    return f"{shard.name}: header byte {pos} -> {new:#x}"


def header_length(root: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(root))
    n, _ = read_header(shard)
    value = rng.choice([0, 1, 7, n - 8, n - 1, n + 1, n + 8, shard.stat().st_size, 2 ** 40, 2 ** 64 - 1])
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", value))
    return f"{shard.name}: header length {n} -> {value}"


def truncate_shard(root: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(root))
    size = shard.stat().st_size
    n, _ = read_header(shard)
    at = rng.choice([0, 4, 8 + rng.randrange(n), 8 + n + rng.randrange(size - 8 - n), size - 1])
    os.truncate(shard, at)
    return f"{shard.name}: truncated to {at} of {size} bytes"


def extend_shard(root: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(root))
    extra = rng.randrange(1, 5000)
    with open(shard, "ab") as f:
        f.write(rng.randbytes(extra))
    return f"{shard.name}: {extra} bytes appended"


def edit_header_entry(root: Path, rng: random.Random) -> str:
    shard = rng.choice(_shards(root))
    _, raw = read_header(shard)
    header = json.loads(raw)
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    how = rng.choice(["dtype", "shape", "offsets", "delete", "rename", "swap", "metadata"])
    if how == "dtype":
        entry["dtype"] = rng.choice(["F32", "BF16", "U8", "U32", "I64", "F8_E4M3", "Q4", 7, None])
    elif how == "shape":
        shape = entry["shape"]
        entry["shape"] = rng.choice([[], [0], shape[::-1], [*shape, 1], [shape[0] * 2] + shape[1:] if shape else [2],
                                     [-1] + shape[1:], "abc"])
    elif how == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[e, b], [b + 1, e + 1], [b, e + 4], [0, e - b], [b], [b, e, 0],
                                            [b - 8, e - 8], [b, 2 ** 62]])
    elif how == "delete":
        del header[name]
    elif how == "rename":
        header[name + ".x" if rng.random() < 0.5 else name.replace("layers.", "layers.9", 1)] = header.pop(name)
    elif how == "swap":
        other = rng.choice([k for k in header if k not in ("__metadata__", name)])
        header[name], header[other] = header[other], header[name]
        name = f"{name} <-> {other}"
    else:
        header["__metadata__"] = rng.choice([[], "x", {"format": "np"}, {"format": 3}])
    put_header(shard, header)
    return f"{shard.name}: {how} {name}"


_ODD_VALUES: list[Any] = [None, -1, 0, 1, 3, 10 ** 9, -(10 ** 9), 0.5, "x", "", [], [1, 2], {}, {"a": 1}, True]


def _leaves(doc: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        out = [path] if path else []
        for k, v in doc.items():
            out += _leaves(v, (*path, k))
        return out
    if isinstance(doc, list):
        out = [path]
        for i, v in enumerate(doc[:6]):
            out += _leaves(v, (*path, i))
        return out
    return [path]


def _mutate_json(path: Path, rng: random.Random, pick: Callable[[list[tuple]], tuple] | None = None) -> str:
    text = path.read_text()
    if rng.random() < 0.15:
        cut = rng.randrange(len(text))
        path.write_text(text[:cut] if rng.random() < 0.5 else text[:cut] + "}{" + text[cut:])
        return f"{path.name}: text cut at {cut}"
    doc = json.loads(text)
    leaves = _leaves(doc)
    where = pick(leaves) if pick else rng.choice(leaves)
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    key = where[-1]
    if rng.random() < 0.3 and isinstance(parent, dict):
        del parent[key]
        what = "deleted"
    else:
        value = rng.choice(_ODD_VALUES)
        parent[key] = value
        what = f"= {value!r}"
    path.write_text(json.dumps(doc))
    return f"{path.name}: {'.'.join(map(str, where))} {what}"


def mutate_config(root: Path, rng: random.Random) -> str:
    return _mutate_json(root / "config.json", rng)


def mutate_expert_map(root: Path, rng: random.Random) -> str:
    # Half of the edits land on one expert's [file, offset] (the map is thousands of them).
    def pick(leaves):
        experts = [p for p in leaves if len(p) >= 4 and p[0] == "layers"]
        return rng.choice(experts) if experts and rng.random() < 0.5 else rng.choice(leaves)

    return _mutate_json(root / "expert_map.json", rng, pick)


def mutate_index(root: Path, rng: random.Random) -> str:
    index = root / "model.safetensors.index.json"
    if rng.random() < 0.4:
        shard = rng.choice(_shards(root))
        shard.unlink()
        return f"{shard.name}: deleted"
    doc = json.loads(index.read_text())
    name = rng.choice(sorted(doc["weight_map"]))
    how = rng.choice(["elsewhere", "unknown file", "outside", "extra tensor", "delete"])
    if how == "elsewhere":
        doc["weight_map"][name] = rng.choice([s.name for s in _shards(root)])
    elif how == "unknown file":
        doc["weight_map"][name] = "model-00099-of-00099.safetensors"
    elif how == "outside":
        doc["weight_map"][name] = "../elsewhere.safetensors"
    elif how == "extra tensor":
        doc["weight_map"][name + ".extra"] = doc["weight_map"][name]
    else:
        del doc["weight_map"][name]
    index.write_text(json.dumps(doc))
    return f"{index.name}: {how} {name}"


MUTATIONS = [flip_header_byte, header_length, truncate_shard, extend_shard, edit_header_entry, edit_header_entry,
             mutate_config, mutate_config, mutate_expert_map, mutate_expert_map, mutate_index]


def _mutant_copy(src: Path, dest: Path) -> None:
    """Hard links of every file (cheap); a mutation replaces the file it changes by a private copy first."""
    dest.mkdir()
    for p in src.iterdir():
        os.link(p, dest / p.name)


def _private(root: Path) -> None:
    for p in root.iterdir():
        if p.stat().st_nlink > 1:
            data = p.read_bytes()
            p.unlink()
            p.write_bytes(data)


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung()


def _verdict(r) -> str | None:
    """None when the run is acceptable: it ran, or it stopped with one error line and no traceback."""
    if "Traceback" in r.err:
        return "traceback"
    if r.code == 0:
        return None
    if r.code == 3 and "incomplete checkpoint" in r.err:  # inspect's report of what is there, then exit 3
        return None
    errors = [line for line in r.err.splitlines() if line.startswith("tqbench: error: ")]
    lines = [line for line in r.err.strip().splitlines() if line.strip()]
    if len(errors) != 1 or lines[-1] != errors[0]:
        return f"exit {r.code} without exactly one final error line"
    return None


def test_mutated_converted_models_fail_in_one_line(converted, tmp_path, capsys, monkeypatch):
    rng = random.Random(SEED)
    failures, outcomes = [], {"ran": 0, "refused": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for number in range(MUTANTS):
            root = tmp_path / f"m{number}"
            _mutant_copy(converted, root)
            _private(root)
            mutation = MUTATIONS[number % len(MUTATIONS)]
            mutant = Mutant(number, mutation(root, rng))
            budget = ["--cache-budget-gb", "3MB"] if number % 2 else []
            for args in (["inspect", root], ["chat", "--model", root, "--prompt", "def f(", "--max-tokens", "1",
                                             "--no-chat-template", *budget]):
                signal.alarm(SECONDS_PER_RUN)
                try:
                    r = tqbench(capsys, monkeypatch, *args)
                except _Hung:
                    failures.append(f"#{mutant.number} {mutant.what}: {args[0]} hung")
                    continue
                except Exception as e:  # noqa: BLE001 - an escaped exception is what the test looks for
                    failures.append(f"#{mutant.number} {mutant.what}: {args[0]} raised {type(e).__name__}: {e}")
                    continue
                finally:
                    signal.alarm(0)
                bad = _verdict(r)
                if bad:
                    tail = " | ".join(r.err.strip().splitlines()[-3:])
                    failures.append(f"#{mutant.number} {mutant.what}: {args[0]} {bad}: {tail[-400:]}")
                else:
                    outcomes["ran" if r.code == 0 else "refused"] += 1
            shutil.rmtree(root)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not failures, "\n".join(failures)
    # The mutations are not all harmless or all fatal: both outcomes occur.
    assert outcomes["ran"] > 6 and outcomes["refused"] > 30, outcomes

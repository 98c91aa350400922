"""`tqbench chat` on a broken model: one line naming the file (or tensor, or entry) and what is wrong, the exit code
`inspect` gives for the same files, no traceback, and nothing in the model directory written or changed.

Every file is checked before MLX reads it: MLX's own loader stops with a traceback (`[load_safetensors] ... invalid
data offsets`) on a truncated shard or a garbage header.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from cli_helpers import Result, tqbench
from conftest import converted as shared_conversion
from conftest import file_bytes
from model_helpers import put_header, read_header
from tqbench.demo import DemoSpec, ensure_demo
from tqbench.errors import ExitCode


@pytest.fixture(scope="module")
def converted() -> Path:
    """A small demo (4 layers, 16 experts) converted with tq4 into four shards: shared, each test changes a copy."""
    return shared_conversion("tq4", DemoSpec(), shard_size=150_000)


@pytest.fixture
def model(converted, tmp_path) -> Path:
    root = tmp_path / "model"
    shutil.copytree(converted, root)
    return root


def _chat(capsys, monkeypatch, root: Path, *extra: str):
    before = file_bytes(root)
    r = tqbench(capsys, monkeypatch, "chat", "--model", root, "--prompt", "def f(", "--max-tokens", "1", *extra)
    assert "Traceback" not in r.err
    assert r.out == ""
    assert file_bytes(root) == before  # nothing in the model directory written or changed
    *progress, last = r.err.strip().splitlines()
    assert all(line.startswith("loading ") for line in progress), r.err
    return Result(r.code, r.out, last)


def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


def test_truncated_converted_shard(model, capsys, monkeypatch):
    shard = _shards(model)[1]
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.BAD_INPUT
    assert r.err.strip() == (f"tqbench: error: {shard}: truncated: data ends at byte {size} but the file has "
                             f"{size - 1000} bytes")


def test_garbage_header(model, capsys, monkeypatch):
    shard = _shards(model)[0]
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"garbage!")
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.BAD_INPUT
    assert r.err.strip() == (f"tqbench: error: {shard}: header is not valid JSON (Expecting value: line 1 column 1 "
                             "(char 0))")


def test_truncated_source_shard(tmp_path, capsys, monkeypatch):
    src = tmp_path / "demo"
    shutil.copytree(ensure_demo(), src)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    header_end = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]
    os.truncate(shard, header_end + 100)
    r = _chat(capsys, monkeypatch, src)
    assert r.code == ExitCode.BAD_INPUT
    line = r.err.strip()
    assert line.startswith(f"tqbench: error: {shard}: truncated: data ends at byte ") and \
        line.endswith(f" but the file has {header_end + 100} bytes"), line


def test_missing_shard_is_named_with_inspects_exit_code(model, capsys, monkeypatch):
    gone = _shards(model)[2]
    index = json.loads((model / "model.safetensors.index.json").read_text())
    lost = sum(1 for f in index["weight_map"].values() if f == gone.name)
    gone.unlink()
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.INCOMPLETE == 3
    assert r.err.strip() == (f"tqbench: error: {model}: 1 shard(s) missing: {gone.name} (the index puts {lost:,} "
                             "tensors there); it cannot run without them")
    assert tqbench(capsys, monkeypatch, "inspect", model).code == 3  # the same files, the same exit code


def test_metadata_that_is_not_strings(model, capsys, monkeypatch):
    shard = _shards(model)[0]
    header = json.loads(read_header(shard)[1])
    header["__metadata__"] = {"format": 3}
    put_header(shard, header)
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.BAD_INPUT
    assert r.err.strip() == f"tqbench: error: {shard}: __metadata__ is not a JSON object of strings"


@pytest.mark.parametrize("field, value, what", [
    ("rotation", "", "rotation '' is not {\"kind\": hadamard | blockwise-hadamard | none, \"block\": a length}"),
    ("format", 0.5, "format 0.5 is none of turboquant, affine, mxfp4"),
    ("group_size", "64", "group_size '64' is not a positive whole number"),
    ("bits", 12, "bits 12 is not a whole number from 1 to 8"),
    ("scales", "max", "scales 'max' is none of search, rms"),
])
def test_quantization_entry_of_the_wrong_kind(model, field, value, what, capsys, monkeypatch):
    config = json.loads((model / "config.json").read_text())
    name = sorted(config["quantization"]["modules"])[0]
    config["quantization"]["modules"][name][field] = value
    (model / "config.json").write_text(json.dumps(config))
    expected = f"tqbench: error: {model / 'config.json'}: quantization.modules[{name!r}]: {what}"
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.BAD_INPUT and r.err.strip() == expected
    r = tqbench(capsys, monkeypatch, "inspect", model)  # inspect reads the same block the same way
    assert r.code == ExitCode.BAD_INPUT and r.err.strip() == expected


def test_rotation_block_that_does_not_fit_the_module(model, capsys, monkeypatch):
    config = json.loads((model / "config.json").read_text())
    name, entry = next((n, e) for n, e in sorted(config["quantization"]["modules"].items())
                       if e["format"] == "turboquant" and e["rotation"]["block"])
    entry["rotation"]["block"] = 1_000_000_000
    (model / "config.json").write_text(json.dumps(config))
    r = _chat(capsys, monkeypatch, model)
    assert r.code == ExitCode.BAD_INPUT
    line = r.err.strip()
    assert line.startswith(f"tqbench: error: {model}: module ") and \
        "the recorded rotation block 1000000000 does not rotate its input width" in line, line


def _expert_map(model: Path) -> dict:
    return json.loads((model / "expert_map.json").read_text())


STREAMED = ("--cache-budget-gb", "3MB")


def test_expert_map_with_a_wrong_dtype(model, capsys, monkeypatch):
    doc = _expert_map(model)
    layer = sorted(doc["layers"], key=int)[0]
    doc["layers"][layer]["tensors"]["w1.scales"]["dtype"] = ""
    (model / "expert_map.json").write_text(json.dumps(doc))
    r = _chat(capsys, monkeypatch, model, *STREAMED)
    assert r.code == ExitCode.BAD_INPUT
    line = r.err.strip()
    assert line.startswith(f"tqbench: error: {model / 'expert_map.json'}: malformed expert map: layer {layer}: "
                           "tensor 'w1.scales' is not {offset, bytes, dtype, shape}"), line


def test_expert_map_pointing_past_a_file(model, capsys, monkeypatch):
    doc = _expert_map(model)
    layer = sorted(doc["layers"], key=int)[-1]
    entry = doc["layers"][layer]
    fi, _ = entry["experts"][5]
    size = (model / doc["files"][fi]).stat().st_size
    entry["experts"][5] = [fi, size - 10]
    (model / "expert_map.json").write_text(json.dumps(doc))
    r = _chat(capsys, monkeypatch, model, *STREAMED)
    assert r.code == ExitCode.BAD_INPUT
    assert r.err.strip() == (f"tqbench: error: {model / 'expert_map.json'}: layer {layer}: expert 5's bytes "
                             f"[{size - 10}, {size - 10 + entry['length']}) run past the end of {doc['files'][fi]} "
                             f"({size} bytes)")


def test_expert_map_naming_a_file_outside_the_model(model, capsys, monkeypatch):
    doc = _expert_map(model)
    doc["files"][0] = "../elsewhere.safetensors"
    (model / "expert_map.json").write_text(json.dumps(doc))
    r = _chat(capsys, monkeypatch, model, *STREAMED)
    assert r.code == ExitCode.BAD_INPUT
    assert r.err.strip() == (f"tqbench: error: {model / 'expert_map.json'}: malformed expert map: \"files\" is not a "
                             "list of file names in its directory")


def test_stats_json_on_a_resident_model_is_refused_before_loading(model, tmp_path, capsys, monkeypatch):
    stats = tmp_path / "stats.json"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "hi", "--stats-json", stats)
    assert r.code == ExitCode.USAGE and r.out == ""
    assert r.err.strip() == ("tqbench: error: --stats-json writes streaming statistics, and this model's experts run "
                             "resident (fits): stream them with --cache-budget-gb, or leave out --stats-json")
    assert not stats.exists()

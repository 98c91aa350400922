"""Bad input: one clear line naming the file and the problem, a non-zero exit, nothing written."""

from __future__ import annotations

import json
import struct

import pytest

from cli_helpers import tqbench
from conftest import file_bytes
from tqbench.errors import ExitCode


def _first_shard(root):
    return sorted(root.glob("model-*.safetensors"))[0]


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _truncate(root):
    p = _first_shard(root)
    p.write_bytes(p.read_bytes()[:-10])
    return p.name, "truncated"


def _huge_header_length(root):
    p = _first_shard(root)
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) + 1000) + raw[8:])
    return p.name, "runs past the end of the file"


def _bad_json(root):
    p = _first_shard(root)
    raw = bytearray(p.read_bytes())
    raw[8] = ord("[")
    raw[9] = ord("{")
    p.write_bytes(bytes(raw))
    return p.name, "not valid JSON"


def _unknown_dtype(root):
    p = _first_shard(root)
    name = "language_model.model.embed_tokens.weight"
    _rewrite_header(p, lambda h: h[name].update(dtype="F7"))
    return p.name, f"tensor '{name}': unknown dtype 'F7'"


def _wrong_length(root):
    p = _first_shard(root)
    name = "language_model.model.embed_tokens.weight"
    _rewrite_header(p, lambda h: h[name].update(shape=[256, 65]))
    return p.name, f"tensor '{name}': 32768 bytes in the file but shape [256, 65] x BF16 needs 33280"


def _overlap(root):
    p = _first_shard(root)

    def mutate(h):
        names = [k for k in h if k != "__metadata__"]
        a, b = names[0], names[1]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + (h[b]["data_offsets"][1] - h[b]["data_offsets"][0])]
    _rewrite_header(p, mutate)
    return p.name, "overlap"


def _outside(root):
    index = json.loads((root / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../x.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json", "shard path '../x.safetensors' points outside the checkpoint directory"


def _no_config(root):
    (root / "config.json").unlink()
    return root.name, "no config.json"


def _empty_config(root):
    (root / "config.json").write_text("{}")
    return "config.json", "no model_type"


def _config_without_model_type(root):
    config = json.loads((root / "config.json").read_text())
    config.pop("model_type", None)
    config.get("text_config", {}).pop("model_type", None)
    (root / "config.json").write_text(json.dumps(config))
    return "config.json", "no model_type"


def _not_a_checkpoint(root):
    for p in root.glob("*.safetensors"):
        p.unlink()
    (root / "model.safetensors.index.json").unlink()
    (root / "notes.txt").write_text("hello")
    return root.name, "not a model checkpoint"


def _unknown_expert_naming(root):
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for p in root.glob("*.safetensors"):
        _rewrite_header(p, lambda h: [h.__setitem__(k.replace("experts.", "specialists."), h.pop(k))
                                      for k in list(h) if "experts." in k and "shared" not in k])
    index["weight_map"] = {k.replace("experts.", "specialists.") if "shared" not in k else k: v
                           for k, v in index["weight_map"].items()}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root.name, "no tensor name was recognised as a routed expert"


@pytest.mark.parametrize("breaker", [_truncate, _huge_header_length, _bad_json, _unknown_dtype, _wrong_length,
                                     _overlap, _outside, _no_config, _empty_config, _config_without_model_type,
                                     _not_a_checkpoint, _unknown_expert_naming])
def test_bad_checkpoint_gives_one_clear_line(breaker, small_k3, capsys, monkeypatch):
    where, what = breaker(small_k3)
    before = file_bytes(small_k3)
    r = tqbench(capsys, monkeypatch, "inspect", small_k3)
    assert r.code == ExitCode.BAD_INPUT
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("tqbench: error: ") and where in lines[0] and what in lines[0], lines[0]
    assert file_bytes(small_k3) == before  # nothing written, nothing changed


def test_config_without_model_type_is_refused_by_convert(small_k3, tmp_path, capsys, monkeypatch):
    (small_k3 / "config.json").write_text("{}")
    dest = tmp_path / "out"
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", small_k3, "--mlx-path", dest, "-r", "tq4-g64")
    assert r.code == ExitCode.BAD_INPUT and r.out == ""
    assert r.err.strip() == f"tqbench: error: {small_k3 / 'config.json'}: no model_type (at the top level or under " \
                            "text_config): not a model config"
    assert not dest.exists()


def test_missing_shard_reports_the_rest(small_k3, capsys, monkeypatch):
    index = json.loads((small_k3 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    gone = shards[1]
    lost = sorted(k for k, v in index["weight_map"].items() if v == gone)
    (small_k3 / gone).unlink()
    r = tqbench(capsys, monkeypatch, "inspect", small_k3, "--json")
    assert r.code == ExitCode.INCOMPLETE == 3
    doc = json.loads(r.out)
    assert doc["complete"] is False
    assert doc["missing"] == [{"file": gone, "tensors": lost}]
    assert doc["tensors"] == len(index["weight_map"]) - len(lost)
    assert doc["index_total_size"] == index["metadata"]["total_size"] > doc["bytes"]
    assert gone in r.err and "incomplete" in r.err
    # The readable report names the shard too, and still exits 3.
    r = tqbench(capsys, monkeypatch, "inspect", small_k3)
    assert r.code == 3 and gone in r.out and "INCOMPLETE" in r.out


def test_missing_directory(tmp_path, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "inspect", tmp_path / "nope")
    assert r.code == ExitCode.BAD_INPUT and r.err.strip() == f"tqbench: error: {tmp_path / 'nope'}: no such directory"


def test_usage_error_exits_2(capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "inspect", "--by", "colour", ".")
    assert r.code == ExitCode.USAGE

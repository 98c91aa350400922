"""Reading model.safetensors.index.json string by string (tqbench.source.index) gives what json.load gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tqbench.errors import CheckpointError
from tqbench.source.index import read_index


def write(root: Path, doc: object, raw: str | None = None) -> Path:
    root.mkdir(exist_ok=True)
    (root / "model.safetensors.index.json").write_text(raw if raw is not None else json.dumps(doc, indent=2))
    return root


def test_names_and_checksums_equal_a_json_parse(tmp_path):
    weight_map = {f"model.layers.{i}.experts.{e}.w1.weight": f"model-0000{i % 3 + 1}-of-00003.safetensors"
                  for i in range(5) for e in range(7)}
    weight_map['odd "quoted" name \\ {brace} \u00e9'] = "model-00001-of-00003.safetensors"
    root = write(tmp_path / "a", {"metadata": {"total_size": 12345, "note": "{not the map}"},
                                  "weight_map": weight_map})
    index = read_index(root)
    assert index.total_size == 12345
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    assert sorted(index.files) == sorted(by_file)
    for file, names in by_file.items():
        assert index.names(file) == names
        assert index.matches(file, reversed(names))  # order does not matter, content does
        assert not index.matches(file, names[:-1])
        assert not index.matches(file, [*names[:-1], "another"])
        assert index.missing_in(file, set(names[1:])) == names[0]


def test_compact_and_empty_maps(tmp_path):
    root = write(tmp_path / "b", None, raw='{"weight_map":{"a":"x.safetensors","b":"x.safetensors"},"metadata":{}}')
    index = read_index(root)
    assert index.names("x.safetensors") == ["a", "b"] and index.total_size is None
    assert read_index(write(tmp_path / "c", {"weight_map": {}})).files == {}


@pytest.mark.parametrize("raw, message", [
    ('{"weight_map": {"a": "x.safetensors",}}', "invalid JSON"),
    ('{"weight_map": {"a": 3}}', "no weight_map object"),
    ('{"metadata": {}}', "no weight_map object"),
    ('{"weight_map": ["a"]}', "no weight_map object"),
    ('{"weight_map": {"a": "../x.safetensors"}}', "points outside the checkpoint directory"),
])
def test_bad_indexes_are_one_line_errors(tmp_path, raw, message):
    root = write(tmp_path / "d", None, raw=raw)
    with pytest.raises(CheckpointError, match=message) as e:
        read_index(root)
    assert "model.safetensors.index.json" in str(e.value) and "\n" not in str(e.value)

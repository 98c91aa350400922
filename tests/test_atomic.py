"""Atomic writes (tqbench.atomic): the content lands whole under its name, no temporary file stays behind, and a write
that fails leaves an existing file as it was."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tqbench import atomic


def _failing_chunks():
    yield b"first chunk\n"
    raise RuntimeError("the producer failed mid-write")


def test_bytes_text_and_json_are_written_whole(tmp_path) -> None:
    atomic.write_bytes(tmp_path / "a.bin", b"\x00\x01")
    atomic.write_bytes(tmp_path / "chunks.txt", (part for part in (b"one ", b"two ", b"three")))
    atomic.write_text(tmp_path / "b.txt", "caf\u00e9\n", fsync=False)
    atomic.write_json(tmp_path / "c.json", {"k": [1, 2]})
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "chunks.txt").read_bytes() == b"one two three"
    assert (tmp_path / "b.txt").read_bytes() == "caf\u00e9\n".encode()
    assert (tmp_path / "c.json").read_text() == json.dumps({"k": [1, 2]}, indent=2) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.json", "chunks.txt"]


def test_an_existing_file_is_replaced(tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    atomic.write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_leaves_no_temporary_file_and_the_old_file_untouched(tmp_path) -> None:
    path = tmp_path / "index.json"
    with pytest.raises(RuntimeError, match="mid-write"):
        atomic.write_bytes(path, _failing_chunks())
    assert list(tmp_path.iterdir()) == []  # nothing under the name, no temporary file
    path.write_bytes(b"complete")
    with pytest.raises(RuntimeError, match="mid-write"):
        atomic.write_bytes(path, _failing_chunks())
    assert path.read_bytes() == b"complete" and list(tmp_path.iterdir()) == [path]


def test_the_temporary_file_is_next_to_the_destination_and_names_it(tmp_path, monkeypatch) -> None:
    """The rename happens within one directory (one file system), and a temporary file that a killed process left
    says which file it was to become."""
    seen = []
    real_replace = os.replace

    def recording_replace(src, dst):
        seen.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", recording_replace)
    atomic.write_bytes(tmp_path / "config.json", b"{}")
    [(tmp, dst)] = seen
    assert tmp.parent == dst.parent == tmp_path and tmp.name.endswith(atomic.TEMP_SUFFIX)
    assert atomic.temp_target(tmp.name) == "config.json"
    assert atomic.temp_target("config.json.partial") is None and atomic.temp_target("config.json") is None


def test_a_new_file_gets_the_usual_permissions(tmp_path) -> None:
    """As open() would make it (0666 less the umask), not tempfile's owner-only 0600."""
    umask = os.umask(0o022)
    try:
        atomic.write_bytes(tmp_path / "model.json", b"{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "model.json").stat().st_mode) == 0o644


def test_writes_to_one_file_use_their_own_temporary_files(tmp_path, monkeypatch) -> None:
    """Two writers of one file (two processes caching the same kernel) never write into the same temporary file."""
    names = []
    real_open = open

    def recording_open(file, mode="r", *args, **kwargs):
        names.append(Path(file).name)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", recording_open)
    atomic.write_bytes(tmp_path / "k.cubin", b"a")
    atomic.write_bytes(tmp_path / "k.cubin", b"b")
    assert len(names) == 2 and names[0] != names[1]
    assert (tmp_path / "k.cubin").read_bytes() == b"b"

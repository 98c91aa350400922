"""Output locations that cannot be written are refused before any work, in one line naming the path: a convert
output under a regular file or on a file system that allows no new directory, and the same for every other command
that writes a file (profile export and merge, chat --stats-json, the demo in the cache directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_helpers import tqbench
from conftest import file_bytes
from tqbench.convert import convert
from tqbench.demo.install import demo_path
from tqbench.writable import OutputError, check_output_dir, check_output_file
from tqbench.errors import ExitCode
from tqbench.recipe import Recipe

# Where nothing can be created, and why: /sys refuses new directories to everyone; /proc refuses root with ENOENT
# (the directory exists, what is made in it not) and other users with EACCES.
SYS_WHY = "permission denied"
PROC_WHY = "the file system does not allow it" if os.geteuid() == 0 else "permission denied"


@pytest.fixture
def notes(tmp_path, monkeypatch) -> Path:
    """A regular file, `notes.txt`, in the working directory (tmp_path)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    return tmp_path / "notes.txt"


def bad_outputs(tmp_path: Path) -> list[tuple[str, str]]:
    """(output directory as typed, the problem) for outputs that cannot be made."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    return [
        ("notes.txt/out", "notes.txt is a file, not a directory"),
        ("notes.txt/a/b", "notes.txt is a file, not a directory"),
        ("notes.txt", "is a file, not a directory"),
        ("gone", "is a broken symbolic link"),
        ("gone/out", "gone is a broken symbolic link"),
        ("/proc/nope", f"cannot create the output directory in /proc ({PROC_WHY})"),
        ("/sys/nope/deeper", f"cannot create the output directory in /sys ({SYS_WHY})"),
    ]


def test_convert_refuses_an_output_it_cannot_make(small_k3, notes, tmp_path, capsys, monkeypatch):
    cases = bad_outputs(tmp_path)
    before = file_bytes(tmp_path)
    for dest, problem in cases:
        r = tqbench(capsys, monkeypatch, "convert", "--hf-path", small_k3, "--mlx-path", dest, "-r", "tq4-g64")
        assert (r.code, r.out, r.err) == (ExitCode.BAD_INPUT, "", f"tqbench: error: {dest}: {problem}\n"), dest
    assert file_bytes(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "notes.txt", "small-k3"]
    assert not Path("/proc/nope").exists() and not Path("/sys/nope").exists()


def test_a_usable_output_is_checked_without_a_trace(tmp_path):
    (tmp_path / "out").mkdir()
    for dest in (tmp_path / "out", tmp_path / "new" / "deeper"):
        check_output_dir(dest)  # the directory made and removed to try leaves nothing behind
    check_output_file(tmp_path / "out" / "stats.json")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and list((tmp_path / "out").iterdir()) == []


def test_the_output_is_checked_before_the_source_is_read(notes, tmp_path, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", tmp_path / "no-source", "--mlx-path", "notes.txt/out")
    assert r.code == 1 and r.err == "tqbench: error: notes.txt/out: notes.txt is a file, not a directory\n"


def test_the_engine_convert_refuses_before_planning(notes, tmp_path):
    # The engine's entry (the TUI's and every script's way in): refused at the first step, with no source to read.
    with pytest.raises(OutputError) as e:
        next(convert(tmp_path / "no-source", Path("notes.txt/out"), Recipe.parse("tq4-g64")))
    assert str(e.value) == "notes.txt/out: notes.txt is a file, not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory whatever its mode")
def test_a_directory_without_write_permission(small_k3, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", small_k3, "--mlx-path", locked / "out")
    assert r.err == f"tqbench: error: {locked / 'out'}: cannot create the output directory in {locked} " \
                    "(permission denied)\n"
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", small_k3, "--mlx-path", locked)
    assert r.err == f"tqbench: error: {locked}: cannot write into this directory (permission denied)\n"
    assert list(locked.iterdir()) == []


def bad_files(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(output file as typed, the path the line names, the problem) for files that cannot be written."""
    os.mkfifo(tmp_path / "fifo")
    return [
        ("notes.txt/p.json", "notes.txt/p.json", "notes.txt is a file, not a directory"),
        ("no-such-dir/p.json", "no-such-dir", "no such directory"),
        (".", ".", "this is a directory; give a file"),
        ("fifo", "fifo", "is a device, pipe or socket, not a file"),
        ("/proc/p.json", "/proc/p.json", f"cannot create a file in /proc ({PROC_WHY})"),
        ("/sys/p.json", "/sys/p.json", f"cannot create a file in /sys ({SYS_WHY})"),
    ]


@pytest.mark.parametrize("command", [
    ["profile", "export", "--model", "model", "--output"],
    ["profile", "merge", "a.json", "b.json", "--output"],
    ["chat", "--model", "model", "--prompt", "hi", "--stats-json"],
], ids=["profile-export", "profile-merge", "chat-stats-json"])
def test_commands_that_write_a_file_refuse_one_they_cannot_write(command, notes, tmp_path, capsys, monkeypatch):
    # Checked before any work: the model is an empty directory and the profiles to merge do not exist, so any work
    # done first would fail with another line.
    (tmp_path / "model").mkdir()
    cases = bad_files(tmp_path)
    before = file_bytes(tmp_path)
    label = "--stats-json: " if command[0] == "chat" else ""
    for file, named, problem in cases:
        r = tqbench(capsys, monkeypatch, *command, file)
        assert (r.code, r.out, r.err) == (ExitCode.BAD_INPUT, "", f"tqbench: error: {named}: {label}{problem}\n"), file
    assert file_bytes(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "model", "notes.txt"]


def test_demo_refuses_a_cache_directory_it_cannot_write(notes, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "notes.txt" / "cache"))
    r = tqbench(capsys, monkeypatch, "demo")
    assert (r.code, r.out) == (ExitCode.BAD_INPUT, "")
    assert r.err == f"tqbench: error: {demo_path()}: {tmp_path / 'notes.txt'} is a file, not a directory\n"
    monkeypatch.setenv("TQBENCH_CACHE_DIR", "/proc/tqbench-cache")
    r = tqbench(capsys, monkeypatch, "demo")
    assert r.code == 1 and r.err == (f"tqbench: error: {demo_path()}: cannot create the output directory in /proc "
                                     f"({PROC_WHY})\n")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"

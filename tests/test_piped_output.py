"""Output piped to a file never wraps: long tensor names and paths stay on one line in `inspect`, `plan` and
`convert` (stdout and the progress on stderr), whatever the terminal width would have been. And a pipe whose reader
goes away (`tqbench ... | head -1`) is no error: every command exits as it would have, quietly, and what it still
writes to stderr gets there."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_k3_text
from tqbench.demo import DemoSpec, ensure_demo, write_source
from tqbench.paths import shipped_profiles
from tqbench.skeleton import k3_config, k3_tensor_specs, write_skeleton
from tqbench.source import open_checkpoint

LONG = "a-checkpoint-directory-with-a-name-long-enough-to-overflow-eighty-columns-on-its-own"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}


def piped(*args) -> subprocess.CompletedProcess:
    """Run tqbench with stdout and stderr going to pipes, as `tqbench ... > file 2> log` does."""
    return subprocess.run([sys.executable, "-m", "tqbench", *map(str, args)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=_env(), timeout=300)


def reader_gone(*args) -> tuple[int, str]:
    """Run tqbench with stdout a pipe whose reader has gone before anything is written (its read end closed at
    once, long before Python has started), as after `| head` exits; its exit code and stderr."""
    p = subprocess.Popen([sys.executable, "-m", "tqbench", *map(str, args)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    p.stdout.close()
    err = p.stderr.read()
    return p.wait(timeout=300), err


def shell_pipe(args: list, reader: str) -> subprocess.CompletedProcess:
    """`tqbench ARGS | READER` in bash: tqbench's exit code (PIPESTATUS), the reader's stdout, tqbench's stderr."""
    command = shlex.join([sys.executable, "-m", "tqbench", *map(str, args)])
    return subprocess.run(["bash", "-c", f"{command} | {reader}; exit ${{PIPESTATUS[0]}}"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=_env(), timeout=300)


def line_with(text: str, needle: str) -> str:
    """The one line that holds `needle` whole (it fails when the needle was broken across lines)."""
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"{needle!r} is not on any one line of:\n{text}"
    return lines[0]


@pytest.fixture
def long_k3(tmp_path) -> Path:
    text = small_k3_text()
    return write_skeleton(tmp_path / LONG, k3_config(text), k3_tensor_specs(text), shard_size=64 * 1024)


def test_inspect(long_k3):
    names = sorted(t.entry.name for t in open_checkpoint(long_k3).tensors if "experts.1." in t.entry.name)
    done = piped("inspect", long_k3, "--tensors", "*experts.1.*", "--by", "shard")
    assert done.returncode == 0, done.stderr
    for name in names:  # one row per tensor: its name, role, dtype, shape and shard on one line
        row = line_with(done.stdout, name).split()
        assert row[0] == name and row[1] == "routed_expert" and row[-1].endswith(".safetensors")
    assert len(max(done.stdout.splitlines(), key=len)) > 80
    assert not any(c in done.stdout for c in "┃│━─")  # no borders


def test_plan(long_k3):
    done = piped("plan", long_k3, "-r", "tq3a-tqTe-down4-g64", "-r", "tq3a-tqTe-g64-mlpg128", "--memory", "64GB",
                 "--disk-gbps", "2", "--platform", "linux", "--tensors", "*layers.2.*experts.*.w1.*")
    assert done.returncode == 0, done.stderr
    assert line_with(done.stdout, str(long_k3)).startswith("source")
    header = line_with(done.stdout, "tq3a-tqTe-down4-g64").split()
    assert header[-2:] == ["tq3a-tqTe-down4-g64", "tq3a-tqTe-g64-mlpg128"]
    for name in ("gate_proj.weight", "gate_proj.scales"):  # kept at source here: in = 32
        line_with(done.stdout, f"language_model.model.layers.2.block_sparse_moe.switch_mlp.{name}")
    line_with(done.stdout, "max tok/s: the disk-bound ceiling, bandwidth / (MoE layers x K x expert page")


def test_convert(tmp_path):
    src = write_source(tmp_path / LONG, DemoSpec(), seed=0)
    dst = tmp_path / f"{LONG}-converted"
    done = piped("convert", "--hf-path", src, "--mlx-path", dst, "-r", "tq4-g64", "--shard-size", "400000")
    assert done.returncode == 0, done.stderr
    assert line_with(done.stderr, f"converting {src} -> {dst} with tq4-g64").endswith(" of tensors as tqbench plan counts, + shard headers)")
    progress = [line for line in done.stderr.splitlines() if line.startswith("convert ")]
    assert progress and progress[-1].startswith("convert 100%: ")
    wrote = [line for line in done.stderr.splitlines() if line.startswith("  wrote model-")]
    assert len(wrote) == len(list(dst.glob("model-*.safetensors"))) > 1
    assert line_with(done.stdout, str(dst)).split()[0] == str(dst)  # the summary row


# ---- a reader that goes away ---------------------------------------------------------------------------------------

def test_head_of_a_long_report_exits_0_quietly(tmp_path):
    text = small_k3_text(layers=8, experts=64)
    big = write_skeleton(tmp_path / "big", k3_config(text), k3_tensor_specs(text), shard_size=1024 * 1024)
    args = ["inspect", big, "--tensors", "*", "--limit", "100000"]
    whole = piped(*args).stdout
    assert len(whole) > 256 * 1024  # far more than a pipe holds (64 KiB): the writes after head exits fail
    done = shell_pipe(args, "head -1")
    assert (done.returncode, done.stdout, done.stderr) == (0, whole.splitlines(keepends=True)[0], "")


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["plan", "--help"], ["profile", "merge", "--help"], ["demo"], ["demo", "--json"],
    ["inspect", "{src}", "--tensors", "*"], ["inspect", "{src}", "--json"],
    ["plan", "{src}", "--memory", "64GB", "--disk-gbps", "2", "--platform", "linux", "--tensors", "*"],
    ["plan", "{src}", "--memory", "64GB", "--disk-gbps", "2", "--platform", "linux", "--json"],
    ["profile", "diff", "{profile}", "{profile}"], ["profile", "diff", "{profile}", "{profile}", "--json"],
], ids=lambda args: " ".join(args))
def test_every_command_exits_0_quietly_when_stdout_has_no_reader(args, long_k3):
    profile = shipped_profiles() / "demo-tq4.json"
    code, err = reader_gone(*(a.format(src=long_k3, profile=profile) for a in args))
    assert (code, err) == (0, "")


def test_an_incomplete_checkpoint_still_exits_3(long_k3):
    gone = sorted(long_k3.glob("model-*.safetensors"))[-1]
    gone.unlink()
    code, err = reader_gone("inspect", long_k3, "--tensors", "*")
    assert code == 3 and err.startswith(f"tqbench: {long_k3}: incomplete checkpoint: 1 shard(s) named by the index "
                                        f"are missing ({gone.name}")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_convert_finishes_and_reports_on_stderr_without_a_reader(tmp_path):
    src = write_source(tmp_path / "src", DemoSpec(), seed=0)
    dst = tmp_path / "out"
    code, err = reader_gone("convert", "--hf-path", src, "--mlx-path", dst, "-r", "tq4-g64", "--json")
    assert code == 0 and "Traceback" not in err
    assert (dst / "model.safetensors.index.json").is_file()  # the conversion ran to the end
    # Without --json the summary table goes to stdout after the progress on stderr: both still end as they would.
    code, err = reader_gone("convert", "--hf-path", src, "--mlx-path", dst, "-r", "tq4-g64")
    assert code == 0 and err.startswith(f"converting {src} -> {dst} with tq4-g64") and "Traceback" not in err


@pytest.mark.slow
def test_chat_prints_its_summary_after_the_reader_of_the_reply_left():
    done = shell_pipe(["chat", "--model", ensure_demo(), "--prompt", "hi", "--max-tokens", "8"], "head -c 5")
    assert done.returncode == 0 and len(done.stdout) == 5
    assert done.stderr.splitlines()[-1].startswith("[8 tokens (max tokens), ")  # the reply's summary, after it
    assert "Traceback" not in done.stderr

"""Output piped to a file never wraps: long tensor names and paths stay on one line in `inspect`, `plan` and
`convert` (stdout and the progress on stderr), whatever the terminal width would have been."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import small_k3_text
from tqbench.demo import DemoSpec, write_source
from tqbench.skeleton import k3_config, k3_tensor_specs, write_skeleton
from tqbench.source import open_checkpoint

LONG = "a-checkpoint-directory-with-a-name-long-enough-to-overflow-eighty-columns-on-its-own"


def piped(*args) -> subprocess.CompletedProcess:
    """Run tqbench with stdout and stderr going to pipes, as `tqbench ... > file 2> log` does."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run([sys.executable, "-m", "tqbench", *map(str, args)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=300)


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

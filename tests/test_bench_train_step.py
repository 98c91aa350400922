"""benchmarks/train_step.py --quick times the demo's real training step (scripts/train_demo.py's `training_step`) at
two batch sizes, with MLX's optimizer and the flat one, counts each step's operations, and writes figures that agree
with each other; a bad --batches or --optimizers is a one-line usage error."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_step.py"


@pytest.mark.slow  # times eight training-step configurations of the chat demo's model, counting operations (~30-60 s)
def test_quick_run_times_the_real_step_at_each_batch_and_optimizer(tmp_path):
    out = tmp_path / "train_step.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--optimizers", "mlx,flat", "--kda-chunks", "16,32",
                        "--count-ops", "--out", str(out)], capture_output=True, text=True, env=dict(os.environ),
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["schema"] == "tqbench.bench.train-step/1" and d["baseline"] == "batch 2"
    rows = d["rows"]
    assert d["kda_chunks"] == [16, 32]
    assert [(r["batch"], r["seq_len"], r["compiled"], r["kda_chunk"], r["optimizer"]) for r in rows] == [
        (b, 32, False, c, o) for b in (2, 4) for c in (16, 32) for o in ("mlx", "flat")]
    for r in rows:
        assert r["seconds_per_step"] > 0 and r["steps_timed"] == 2 and 0 < r["forward_s"]
        assert math.isclose(r["tokens_per_second"], r["batch"] * 32 / r["seconds_per_step"])
        # a step of the freshly initialised model on random tokens: about the uniform loss, ln(vocabulary)
        assert abs(r["first_loss"] - math.log(4608)) < 0.5
        assert r["primitives"] == sum(r["primitives_by_name"].values()) > r["kernel_primitives"] > 1000
    assert rows[0]["tokens_per_second_vs_baseline"] == 1.0
    assert math.isclose(rows[4]["tokens_per_second_vs_baseline"],
                        rows[4]["tokens_per_second"] / rows[0]["tokens_per_second"])
    for r, first in zip(rows[2:4] + rows[6:8], rows[0:2] + rows[4:6]):  # chunk 32 against chunk 16, same optimizer
        assert math.isclose(r["step_time_vs_first_chunk"], r["seconds_per_step"] / first["seconds_per_step"])
        assert first["step_time_vs_first_chunk"] == 1.0
        assert r["first_loss"] == pytest.approx(first["first_loss"], abs=0.05)  # the same model; rounding, routing
    for mlx, flat in (rows[0:2], rows[2:4], rows[4:6], rows[6:8]):
        assert mlx["first_loss"] == flat["first_loss"]  # the same model and tokens: only the update differs
        assert mlx["step_time_vs_first_optimizer"] == 1.0
        assert math.isclose(flat["step_time_vs_first_optimizer"], flat["seconds_per_step"] / mlx["seconds_per_step"])
        # clipping and AdamW per parameter cost ~20 operations for each of the 204 trainable tensors; on one vector
        # a few dozen in all
        assert mlx["kernel_primitives"] - flat["kernel_primitives"] > 15 * 204
    assert d["peak_rss"] > 0 and all(r["mlx_peak_memory"] > 0 for r in rows) and "openblas_mapped" in d


def test_bad_batches_are_a_usage_error(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--batches", "64,x", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--batches: comma-separated integers, not '64,x'" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.json").exists()
    p = subprocess.run([sys.executable, str(SCRIPT), "--optimizers", "mlx,sgd", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--optimizers: a comma-separated list of mlx and flat, not 'mlx,sgd'" in p.stderr
    assert not (tmp_path / "o.json").exists()
    p = subprocess.run([sys.executable, str(SCRIPT), "--kda-chunks", "16,24", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--kda-chunks: comma-separated powers of two, not '16,24'" in p.stderr
    assert not (tmp_path / "o.json").exists()

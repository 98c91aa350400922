"""benchmarks/kda_training.py --quick runs both parts on the CPU and writes figures that agree with each other: the
chunked recurrence gives the loop's loss and gradients, and a training step's first loss is the same either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the chat demo's model twice and times a few steps (~15 s)

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_consistent_figures(tmp_path):
    out = tmp_path / "kda.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kda_training.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["schema"] == "tqbench.bench.kda-training/1" and d["quick"] is True
    rows = {r["kernel"]: r for r in d["recurrence"]["rows"]}
    assert list(rows) == ["loop", "chunk8", "chunk16", "chunk32"]
    for name, r in rows.items():
        assert r["seconds"] > 0
        assert abs(r["speedup_vs_loop"] - rows["loop"]["seconds"] / r["seconds"]) < 1e-9
        if name != "loop":  # the same numbers as the loop's, to float32 rounding
            assert r["loss_rel_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-3
    t = d["training"]
    assert (t["batch"], t["seq_len"]) == (4, 32)
    assert abs(t["chunk16"]["first_loss"] - t["loop"]["first_loss"]) < 1e-4 * t["loop"]["first_loss"]
    for k in ("loop", "chunk16"):
        assert abs(t[k]["tokens_per_second"] * t[k]["seconds_per_step"] - 4 * 32) < 1e-6
    assert abs(t["speedup"] - t["loop"]["seconds_per_step"] / t["chunk16"]["seconds_per_step"]) < 1e-9

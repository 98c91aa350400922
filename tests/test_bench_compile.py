"""benchmarks/compile_time.py --quick: four fresh processes on a tiny K3-shaped model, each with its own empty or
reused kernel caches, on the CPU (where no CUDA kernel exists: the GPU run uses the same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a tiny K3-shaped model and runs it in four processes (~10 s)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "compile_time.py"


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, env=env, timeout=900)


def test_quick_run_times_every_step_of_every_run(tmp_path):
    out = tmp_path / "c.json"
    p = _run(tmp_path, "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert list(d["runs"]) == ["mlx fresh", "nvrtc fresh", "mlx warm", "nvrtc warm"]
    for name, r in d["runs"].items():
        assert [s["step"] for s in r["steps"]] == ["short prompt (4 tokens)", "short: token 1", "short: token 2",
                                                   "long prompt (12 tokens)", "long: token 1", "long: token 2"]
        assert all(s["seconds"] > 0 for s in r["steps"])
        assert d["steps_total_s"][name] == pytest.approx(sum(s["seconds"] for s in r["steps"]))
        assert r["kernel_specs"] == 0 and r["nvrtc"]["compiled"] == 0  # the CPU has no fused kernels
        assert r["self_check_warnings"] == []
        assert len(r["tokens"]) == 6
    # the same model and prompts give the same greedy tokens in every process
    assert d["tokens_agree"] is True
    assert len({tuple(r["tokens"]) for r in d["runs"].values()}) == 1
    assert d["fresh_ratio_nvrtc_vs_mlx"] == pytest.approx(d["steps_total_s"]["nvrtc fresh"]
                                                          / d["steps_total_s"]["mlx fresh"])
    # the per-run caches were temporary: only the model is left in the work directory
    assert sorted(x.name for x in (tmp_path / "work").iterdir()) == ["k3-stream", "k3-stream.json"]


@pytest.mark.parametrize("args, says", [(["--runs", "nvrtc warm"], "each warm run with its fresh one"),
                                        (["--layers", "1"], "--layers takes 2 or more"),
                                        (["--experts", "3"], "--experts 4 or more"),
                                        (["--long", "0"], "--long 1 or more")])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, args, says):
    p = _run(tmp_path, *args, "--out", str(tmp_path / "c.json"))
    last = p.stderr.strip().splitlines()[-1]  # argparse's usage, then one line that says what is wrong
    assert p.returncode == 2 and last.startswith("compile_time.py: error: ") and says in last
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "work").exists()

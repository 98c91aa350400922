"""benchmarks/quantizer.py --quick times every quantizer kernel on small matrices and reports figures that agree."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tqbench.quant import turboquant as tq

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_times_every_kernel_against_passes(tmp_path):
    out = tmp_path / "q.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantizer.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in d["rows"]}
    assert list(rows) == list(tq.available_quantizer_kernels())
    assert all(r["same_codes_and_scales_as_passes"] for r in rows.values())
    passes = statistics.median(rows["passes"]["times_s"])
    for r in rows.values():
        assert len(r["times_s"]) == d["repeats"] == 2
        assert r["median_s"] == pytest.approx(statistics.median(r["times_s"]))
        assert r["vs_passes"] == pytest.approx(r["median_s"] / passes)
        assert r["gb_per_s"] == pytest.approx(d["float32_bytes"] / r["median_s"] / 1e9)
        assert r["batched_same_output"]  # each of the stacked experts' codes and scales equal one expert's
        assert r["batched_median_s_per_expert"] == pytest.approx(statistics.median(r["batched_times_s_per_expert"]))
        assert r["batched_vs_one"] == pytest.approx(r["batched_median_s_per_expert"] / r["median_s"])
    assert d["batch"] == 2
    assert d["float32_bytes"] == 4 * (2 * 64 * 256 + 256 * 64)
    assert [m["codebook"] for m in d["matrices"]] == ["T", "T", "4"] and all(m["rotated"] for m in d["matrices"])


def test_both_scale_rules_in_one_run(tmp_path):
    out = tmp_path / "q.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantizer.py"), "--quick", "--rules", "rms,search",
                        "--kernels", "compiled", "--batch", "1", "--out", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["rules"] == ["rms", "search"]
    rows = {(r["kernel"], r["rule"]): r for r in d["rows"]}
    assert set(rows) == {(k, rule) for k in ("compiled", "passes") for rule in ("rms", "search")}
    assert all(r["same_codes_and_scales_as_passes"] for r in rows.values())
    for (k, rule), r in rows.items():
        assert r["vs_rms"] == pytest.approx(r["median_s"] / rows[(k, "rms")]["median_s"])

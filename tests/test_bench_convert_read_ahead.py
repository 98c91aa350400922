"""benchmarks/convert_read_ahead.py --quick converts one source both ways and reports figures that agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a benchmark's quick run in a process of its own: converts a model both ways (~6 s)
def test_quick_run_pairs_the_two_ways_of_reading(tmp_path):
    out = tmp_path / "ra.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convert_read_ahead.py"), "--quick", "--out",
                        str(out), "--work", str(tmp_path / "work")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [(r["mode"], r["round"]) for r in d["rows"]] == [("arena", 0), ("bytes", 0)]
    arena, plain = d["rows"]
    (s,) = d["summary"]
    assert s["bytes_over_arena_paired"] == [pytest.approx(plain["seconds"] / arena["seconds"])]
    assert arena["mb_per_s"] == pytest.approx(d["source_bytes"] / arena["seconds"] / 1e6)
    assert s["same_output_bytes"] and arena["output_bytes"] > 0
    assert d["read_ahead"] == 128 * 2**20 and d["default_read_ahead"] == 0  # this CPU: the bytes path by default

"""benchmarks/host_tier.py and benchmarks/distributed.py --quick run end to end on the CPU and write figures that
agree with each other: every run gives the same greedy tokens, the ratios are against the baseline of the same
process or round, the host tier serves by copies what the cache alone reads, ranks read their own layers' experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a random K3-layout model converted and decoded in five runs; 2 and 1 ranks launched

ROOT = Path(__file__).resolve().parent.parent


def bench(script: str, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--work", str(tmp_path / "w"),
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_host_tier_quick(tmp_path):
    d = bench("host_tier.py", tmp_path)
    assert d["same_tokens_in_every_run"] is True
    runs = {r["label"]: r for r in d["runs"]}
    base, host = runs["cache"], runs["cache + host"]
    assert base["vs_cache_median"] == 1.0 and base["tiers"]["host"] == 0
    assert host["tiers"]["host"] > 0 and host["tiers"]["disk"] < base["tiers"]["disk"]
    assert host["tiers"]["gpu"] == pytest.approx(base["tiers"]["gpu"])  # the slots make the same choices
    assert host["bytes_read_per_token"] < base["bytes_read_per_token"]
    rep = d["repeats"][0]["rows"]
    assert all(r["vs_cache"] == pytest.approx(r["decode_tps"] / rep[0]["decode_tps"]) for r in rep)


def test_distributed_quick(tmp_path):
    d = bench("distributed.py", tmp_path)
    rows = {(s["ranks"], s["budget"]): s for s in d["summary"]}
    assert set(rows) == {(1, None), (2, None), (1, "300KB"), (2, "300KB")}
    assert all(s["same_tokens"] for s in d["summary"])
    one, two = rows[(1, "300KB")], rows[(2, "300KB")]
    assert set(two["bytes_per_pass_by_rank"]) == {"0", "1"} and two["layers_by_rank"] == {"0": [4, 8], "1": [0, 4]}
    for rnd in d["rounds"]:
        by = {(r["ranks"], r["budget"]): r for r in rnd}
        for (n, b), r in by.items():
            assert r["vs_one_process"] == pytest.approx(r["decode_tps"] / by[(1, b)]["decode_tps"])
    assert one["vs_one_process_median"] == 1.0

"""benchmarks/page_in.py --quick drives the real streamer (with and without its read gate, and an older streamer.py
given with --before) against raw O_DIRECT reads of the same experts, and writes figures that agree with each other and
with what was asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_helpers import takes_o_direct

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a benchmark's quick run in a process of its own (~5 s)
def test_quick_run_pairs_this_streamer_with_an_older_one(tmp_path):
    if not takes_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    before = tmp_path / "old_streamer.py"
    before.write_text((ROOT / "tqbench" / "stream" / "streamer.py").read_text())  # the same code: a valid "before"
    before_pagein = tmp_path / "old_pagein.py"
    before_pagein.write_text((ROOT / "tqbench" / "stream" / "pagein.py").read_text())  # its read path
    out = tmp_path / "page_in.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "page_in.py"), "--quick", "--work",
                        str(tmp_path / "work"), "--before", str(before), "--before-pagein", str(before_pagein),
                        "--rounds", "2", "--reads-in-flight", "0,1",
                        "--out", str(out)],
                       capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    cfg = d["config"]
    assert d["schema"] == "tqbench.bench.page_in/1" and cfg["experts"] == 12 and cfg["expert_bytes"] == 1 << 20
    assert d["store"]["bytes"] == 1000 + 12 * (1 << 20)  # one layer after the 1,000-byte prefix
    rows = d["rows"]
    # two rounds, each variant once per round, the order alternating
    assert [(r["round"], r["variant"]) for r in rows] == [(0, "after"), (0, "in-flight-1"), (0, "before"),
                                                          (1, "before"), (1, "in-flight-1"), (1, "after")]
    for r in rows:
        assert r["buffers"] == 2 * cfg["workers"] and r["expert_bytes"] == 1 << 20
        # every call asks for per_call distinct experts; a miss is one that was not cached
        assert 0 < r["misses"] <= cfg["calls"] * cfg["per_call"]
        assert r["gbps_on_misses"] == pytest.approx(r["misses"] * r["expert_bytes"] / r["page_in_s"] / 1e9)
        assert r["ratio"] == pytest.approx(r["gbps_on_misses"] / r["raw_gbps"])
        assert r["ratio_best_raw"] == pytest.approx(r["gbps_on_misses"] / max(r["raw_gbps"], r["raw1_gbps"]))
        assert r["raw1_gbps"] > 0 and r["reads_in_flight"] == (1 if r["variant"] == "in-flight-1" else 0)
        assert r["ms_per_miss"] == pytest.approx(r["page_in_s"] / r["misses"] * 1e3)
        split = r["miss_split_ms"]
        assert split["read_s"] > 0 and all(v >= 0 for v in split.values())
        assert split["read_s"] <= r["ms_per_miss"] * cfg["workers"] + 1e-6  # at most `workers` reads at once
        if r["reads_in_flight"] == 1:  # the gate: one read at a time, so reading fits in the page-ins' wall time
            assert split["read_s"] <= r["ms_per_miss"] + 1e-6
    import statistics

    for variant in ("after", "in-flight-1", "before"):
        mine = [r["ratio"] for r in rows if r["variant"] == variant]
        assert d["summary"][variant]["ratio"] == pytest.approx(statistics.median(mine))
        assert d["summary"][variant]["processes"] == 2
    pairs = [a["ratio"] / b["ratio"] for a in rows for b in rows
             if a["variant"] == "after" and b["variant"] == "before" and a["round"] == b["round"]]
    assert d["summary"]["after_over_before_ratio"] == pytest.approx(statistics.median(pairs))

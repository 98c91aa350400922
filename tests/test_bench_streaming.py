"""benchmarks/streaming.py --quick runs end to end (trace, replay with O_DIRECT reads, end-to-end decode) and writes a
complete JSON; its offline bounds are checked on hand-made traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script
from tqbench.demo import SHIPPED_SPEC

pytestmark = pytest.mark.slow  # traces the demo, writes a 470 MB expert file, converts and decodes a model (~45 s)

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "streaming.py"
# The shipped demo's MoE layers and experts per layer: the trace is per MoE layer, the cache holds expert-layers.
L = sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers))
E, K = SHIPPED_SPEC.num_experts, SHIPPED_SPEC.num_experts_per_token


def _bench():
    return load_script(SCRIPT)


def test_best_fixed_set_and_belady_on_hand_made_traces():
    b = _bench()
    # 2 layers (ids 3 and 5), 4 tokens, top-2. Counts: layer 3: e0 x3, e1 x2, e2 x2, e3 x1; layer 5: e0 x4, e1 x4.
    trace = np.array([[[0, 1], [0, 2], [0, 1], [2, 3]],
                      [[0, 1], [1, 0], [0, 1], [1, 0]]], dtype=np.int16)
    batches = b.batches_of(trace, [3, 5])
    assert batches[1] == [(3, [0, 2]), (5, [0, 1])]
    total = 16
    assert b.best_fixed_hit_rate(batches, 1) == 4 / total  # (5,0) or (5,1)
    assert b.best_fixed_hit_rate(batches, 2) == 8 / total  # (5,0), (5,1)
    assert b.best_fixed_hit_rate(batches, 3) == 11 / total  # + (3,0)
    assert b.best_fixed_hit_rate(batches, 5) == 15 / total  # + (3,1), (3,2)
    assert b.best_fixed_hit_rate(batches, 100) == 1.0
    # Belady on A B C A B C with two slots: A, B, C miss (C evicts B, used last), A hits, B misses (evicts A, never
    # used again), C hits: 2 of 6. LRU hits nothing.
    abc = b.batches_of(np.array([[[0], [1], [2], [0], [1], [2]]], dtype=np.int16), [0])
    assert b.belady_hit_rate(abc, 2) == 2 / 6
    assert b.simulate(abc, b.make_cache(2, "lru"))["hit_rate"] == 0.0
    # A layer call's own experts are never evicted to make room for one another.
    locked = b.batches_of(np.array([[[0, 1], [2, 3], [0, 1]]], dtype=np.int16), [0])
    assert b.belady_hit_rate(locked, 2) == 0.0
    assert b.belady_hit_rate(locked, 4) == 2 / 6


def test_quick_run_writes_every_section(tmp_path):
    out = tmp_path / "streaming.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "tqbench.bench.streaming/1" and doc["config"]["quick"]
    assert doc["machine"]["git_commit"]
    rp = doc["replay"]
    assert rp["trace"]["shape"][0] == L and rp["trace"]["shape"][-1] == rp["trace"]["top_k"] == K
    assert rp["trace"]["routings"] > 0 and rp["trace"]["expert_layers"] == L * E
    budgets = [int(x) for x in doc["config"]["budgets"].split(",")]
    assert [r["budget"] for r in rp["hit_rates"]] == budgets
    for r, lam_row in zip(rp["hit_rates"], rp["lam_sweep"]["rows"]):
        policies = [r["lru"], r["lrfu"], *(lam_row[str(lam)] for lam in rp["lam_sweep"]["lams"])]
        for h in policies:
            assert 0 <= h <= r["belady"] <= 1, r
        assert 0 <= r["best_fixed"] <= 1
        for key in ("gap_closed", "beats_fixed", "closes_third", "disk_ratio_default_mode", "disk_ratio_best_mode"):
            assert key in r
    workers = [int(x) for x in doc["config"]["workers"].split(",")]
    modes = _bench().reader_modes(workers)
    assert len(rp["disk"]) == len(budgets) * 2 * len(modes)
    assert [x["mode"] for x in rp["disk_summary"]] == [_bench().mode_name(*m) for m in modes]
    for d in rp["disk"]:
        assert d["misses"] >= doc["config"]["misses"]
        assert d["expert_bytes"] == d["misses"] * doc["config"]["expert_bytes"]
        assert d["gbps"] > 0 and d["ratio"] > 0 and d["raw_gbps"] > 0
        if rp["direct"]:
            assert d["page_cache_resident_after"] is None or d["page_cache_resident_after"] < 0.01
    assert rp["raw_best_gbps"] > 0 and len(rp["raw"]) == len(budgets) + 1
    assert rp["best_streamer_mode"] in [x["mode"] for x in rp["disk_summary"] if not x["pending_only"]]
    e2e = doc["e2e"]
    rows = {r["run"]: r for r in e2e["rows"]}
    assert list(rows) == ["resident", "streamed, fits", "streamed, small", "streamed, small, look-ahead"]
    assert rows["resident"]["vs_resident"] == 1.0
    for name, r in rows.items():
        assert r["decode_tps"] > 0 and r["same_tokens_as_resident"], (name, r)
        if name != "resident":
            for key in ("bytes_per_token", "hit_rate", "stall_share", "ceiling_tps", "vs_ceiling", "slots"):
                assert key in r, (name, key)
            assert 0 <= r["stall_share"] < 1
    assert rows["streamed, small"]["slot_share"] < 0.5 <= rows["streamed, fits"]["slot_share"]
    assert set(doc["goals"]) == {"default_policy_beats_best_fixed_at_every_budget",
                                 "default_policy_closes_a_third_of_lru_gap_at_every_budget",
                                 "disk_ratio_at_least_0.9_in_the_streamers_best_mode",
                                 "streamed_over_resident_at_least_0.9_when_it_fits"}
    assert "hit rates" in p.stdout and "end to end" in p.stdout

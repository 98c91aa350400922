"""benchmarks/k3_gpu.py --quick runs every part end to end on the CPU at tiny shapes and writes figures that agree
with each other (the GPU run uses the same code at K3's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # converts two tiny K3-shaped models and decodes them in five processes (~10 s)

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_consistent_figures(tmp_path):
    out = tmp_path / "k3.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "k3_gpu.py"), "--quick", "--work",
                        str(tmp_path / "work"), "--out", str(out), "--runs", "A,B,W"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    rows = {r["label"]: r for r in d["stream"]["rows"]}
    assert list(rows) == ["A cold (learns the profile)", "B cold", "B warm from A's profile"]
    cold, warm = rows["B cold"], rows["B warm from A's profile"]
    # disk on misses: the cold run's bytes over its wait, and that over the best raw bandwidth
    assert cold["disk_gbps_on_misses"] == pytest.approx(cold["bytes_per_token"] / cold["stall_s_per_token"] / 1e9)
    assert d["disk_on_misses_vs_raw"] == pytest.approx(cold["disk_gbps_on_misses"] / d["raw"]["best_gbps"])
    # the same raw reads at random experts, and where a miss's wait went (every B cold miss timed: no look-ahead)
    assert [r["workers"] for r in d["raw"]["random"]["rows"]] == [r["workers"] for r in d["raw"]["rows"]]
    assert d["raw"]["best_gbps_random"] == max(r["gbps"] for r in d["raw"]["random"]["rows"])
    random_gbps = d["raw"]["best_gbps_random"]
    assert d["disk_on_misses_vs_raw_random"] == pytest.approx(cold["disk_gbps_on_misses"] / random_gbps)
    m = cold["per_miss_ms"]
    assert m["timed"] > 0 and m["read"] > 0 and min(m.values()) >= -1e-9
    assert m["stall"] == pytest.approx(cold["read_s_per_miss"] * 1e3)
    assert m["before_reads"] + m["reading"] + m["after_reads"] <= m["stall"] + 1e-6
    # a token's split adds up to its mean time: compute (the resident token) + waiting + the rest
    split = cold["split_per_token_s"]
    assert split["compute"] == d["resident"]["token_s_median"]
    if split["overhead"] > 0:
        assert sum(split.values()) == pytest.approx(1 / cold["decode_tps"])
    # the prompt's forward pass: a cold run starts from an empty cache (the compile warm-up had a model of its own),
    # so every expert the prompt routes is a miss of one read; the warm run routes the same experts, some pinned
    pf, wpf = cold["prefill"], warm["prefill"]
    assert pf["hits"] == 0 and pf["misses"] > 0 and pf["bytes"] == pf["misses"] * d["model"]["expert_bytes"]
    assert cold["prefill_tps"] == pytest.approx(pf["tokens"] / pf["seconds"])
    assert pf["other_s"] == pytest.approx(pf["seconds"] - pf["stall_s"]) and 0 < pf["stall_s"] < pf["seconds"]
    assert wpf["hits"] + wpf["misses"] == pf["misses"] and wpf["misses"] < pf["misses"]
    assert [w["top_k"] for w in d["stream"]["warmups"]] == [None] and d["stream"]["warmups"][0]["seconds"] > 0
    # the warm run pinned experts and served hits from them; the cold ones pinned nothing
    assert warm["pinned"] > 0 and warm["hits_pinned"] > 0 and cold["hits_pinned"] == 0
    # no CUDA here: the streamer's GPU prefetch stayed off
    assert cold["gpu_prefetch"] == {"active": False, "calls": 0, "error": None}
    # the resident model ran in two fresh processes, giving the same greedy tokens as the streamed B runs
    assert len(d["startup"]["processes"]) == 2
    assert cold["same_tokens_as_resident"] is True and warm["same_tokens_as_resident"] is True
    # conversion: the first run (compiling), then one round of the three modes (rotated once: bytes, compare, arena);
    # each mode's MB/s is the source bytes over its seconds, and the round's arena seconds over each other mode's
    c = d["convert"]
    assert [(r["mode"], r["round"]) for r in c["runs"]] == [("arena", None), ("bytes", 0), ("compare", 0), ("arena", 0)]
    seconds = {r["mode"]: r["seconds"] for r in c["runs"][1:]}
    assert c["mb_per_s"] == {m: pytest.approx(c["source_bytes"] / 1e6 / t) for m, t in seconds.items()}
    assert c["speedup_over_arena"] == {m: [pytest.approx(seconds["arena"] / seconds[m])] for m in ("bytes", "compare")}
    assert c["arena_speedup_paired"] == [pytest.approx(seconds["bytes"] / seconds["arena"])]
    assert c["source_mb_per_s"] == c["mb_per_s"]["arena"]
    # the same files whichever way it read (the report aside: its timings differ, so whole-tree sizes may differ by a
    # byte); `compare` sums the errors in another order, which may change their last digits in the journal
    assert len({r["engine_bytes_out"] for r in c["runs"]}) == 1
    assert len({r["output_digest"] for r in c["runs"] if r["mode"] != "compare"}) == 1
    errors = {r["mode"]: r["mean_rel_error"] for r in c["runs"]}
    assert errors["compare"] == pytest.approx(errors["arena"], rel=1e-5) and errors["bytes"] == errors["arena"]


def test_finish_without_a_b_cold_run_keeps_the_rows_and_skips_the_ratios():
    # `--runs 1,2` has no "B cold" row: the ratios and the projection are that row's, the per-row figures are not
    from k3_gpu import finish

    row = dict(label="B cold, 1 worker", stall_s_per_token=0.3, decode_tps=2.5, per_miss_ms={"stall": 9.0})
    doc = dict(raw=dict(best_gbps=1.5, best_gbps_random=2.0), model=dict(expert_bytes=10_000_000, moe_layers=8),
               resident=dict(token_s_median=0.02), stream=dict(rows=[row]))
    finish(doc)
    assert "disk_on_misses_vs_raw" not in doc and "projection_k3" not in doc
    assert row["per_miss_ms"]["raw_random_read"] == pytest.approx(10_000_000 / 2.0e9 * 1e3)  # 5 ms
    assert row["split_per_token_s"] == dict(compute=0.02, waiting_on_reads=0.3, overhead=pytest.approx(0.4 - 0.32))
    assert row["split_per_layer_token_ms"]["waiting_on_reads"] == pytest.approx(300 / 8)


def test_quick_tier_runs_count_host_copies_and_project_k3_on_two_tiers(tmp_path):
    """Issue 33's runs: the host tier under B cold's budget reads less and serves the rest by copies, the same greedy
    tokens as resident; the K3-box run's budgets are the box's shares, as are those of its warm (U) and cache-routed
    (V) forms; the two-tier projection follows its formula."""
    out = tmp_path / "k3.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "k3_gpu.py"), "--quick", "--work",
                        str(tmp_path / "work"), "--out", str(out), "--parts", "stream,resident", "--runs", "A,B,H,T,U,V",
                        "--budget-gb", "0.0009", "--host-gb", "0.004"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    rows = {r["label"]: r for r in d["stream"]["rows"]}
    cold, host, box = rows["B cold"], rows["B cold, host tier"], rows["B cold, K3 box tiers"]
    assert cold["hits_host"] == 0 and host["hits_host"] > 0
    assert host["misses_per_token"] < cold["misses_per_token"]
    assert host["tiers"]["gpu"] + host["tiers"]["host"] + host["tiers"]["disk"] == pytest.approx(1.0)
    assert host["same_tokens_as_resident"] is True and box["same_tokens_as_resident"] is True
    from k3_gpu import K3_BOX_SHARES, K3_MOE_LAYERS, box_budget

    assert box["budget_bytes"] == box_budget(d["model"], K3_BOX_SHARES["gpu"], d["config"]["workers"])
    warm, routed = rows["B warm from A's profile, K3 box tiers"], rows["B cold, K3 box tiers, cache routing 0.02"]
    assert warm["budget_bytes"] == routed["budget_bytes"] == box["budget_bytes"]
    assert warm["same_tokens_as_resident"] is True  # a warm cache changes where experts come from, not the tokens
    proj = d["projection_k3_tiers"]
    layer_s = d["resident"]["token_s_median"] / d["model"]["spec"]["num_hidden_layers"]
    for row in proj["rows"]:
        k = row["top_k"]
        want = 1 / (K3_MOE_LAYERS * k * box["tiers"]["disk"] * cold["read_s_per_miss"]
                    + K3_MOE_LAYERS * k * box["tiers"]["host"] * proj["host_wait_s"] + 93 * layer_s)
        assert row["tps"] == pytest.approx(want)
    by_run = d["projection_k3_tiers_by_run"]  # the same formula for each K3-box run, with its own tiers and stall
    assert set(by_run) == {box["label"], warm["label"], routed["label"]} and by_run[box["label"]] == proj
    for label, p in by_run.items():
        r = rows[label]
        stall_on_misses = r["misses_per_token"] * cold["read_s_per_miss"]
        assert p["host_wait_s"] == pytest.approx(max(0.0, r["stall_s_per_token"] - stall_on_misses)
                                                 / r["host_hits_per_token"])
        assert [x["misses_per_token"] for x in p["rows"]] == pytest.approx([K3_MOE_LAYERS * k * r["tiers"]["disk"]
                                                                            for k in (16, 8)])

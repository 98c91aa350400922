"""benchmarks/policy_cost.py --quick: the synthetic K3-shaped routing is what it says, and the figures written agree
with a direct replay of the same routing through the slot cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_routing_is_k3_shaped_and_carries_a_third_over():
    import policy_cost

    batches = policy_cost.k3_routing(12, layers=5, seed=1)
    assert len(batches) == 12 and all([layer for layer, _ in t] == list(range(5)) for t in batches)
    for t in batches:
        for _, experts in t:
            assert len(experts) == 16 == len(set(experts)) and experts == sorted(experts)
            assert 0 <= experts[0] and experts[-1] < 896
    for layer in range(5):  # each token keeps at least round(16 / 3) = 5 of the layer's previous experts
        for a, b in zip(batches, batches[1:]):
            assert len(set(a[layer][1]) & set(b[layer][1])) >= 5
    assert policy_cost.k3_routing(12, layers=5, seed=1) == batches  # seeded


def test_quick_run_agrees_with_a_direct_replay(tmp_path):
    import policy_cost
    from streaming import simulate

    from tqbench.stream.cache import SlotCache

    out = tmp_path / "pc.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_cost.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [(r["policy"], r["slots"], r["tokens"]) for r in d["rows"]] == [
        ("lru", 200, 20), ("lrfu", 200, 20), ("lrfu-next", 200, 20)]
    batches = policy_cost.k3_routing(30, layers=8)  # 10 warm-up tokens, 20 timed
    for r in d["rows"]:
        cache = SlotCache(200, r["policy"])
        simulate(batches, cache, 0, 10)
        want = simulate(batches, cache, 10)
        assert (r["hits"], r["misses"]) == (want["hits"], want["misses"]) and r["hits"] + r["misses"] == 20 * 8 * 16
        assert r["ms_per_token"] > 0 and abs(r["us_per_miss"] * r["misses"] / 1000 - r["ms_per_token"] * 20) < 1e-6
    assert d["peak_rss"] > 0
    lrfu = d["rows"][1]["ms_per_token"]
    assert all(abs(r["vs_lrfu"] - r["ms_per_token"] / lrfu) < 1e-12 for r in d["rows"])

#!/usr/bin/env python3
"""What each expert-cache policy's bookkeeping costs per token at Kimi K3's scale (issue 11): the slot cache
(`tqbench.stream.cache.SlotCache`) driven as the streamer drives it (`streaming.py`'s `simulate`) over a synthetic
K3-shaped routing: 60 MoE layers x 896 experts, top-16 a token, each layer's experts drawn with Zipf-like weights
(a different order per layer) and a third of a token's experts carried over from the layer's previous token.

    python benchmarks/policy_cost.py --out bench-results/policy_cost.json    # 3,000 and 12,000 slots, 300 tokens
    python benchmarks/policy_cost.py --quick                                 # a smoke run (seconds)

Per policy and slot count: milliseconds of bookkeeping per token (the median of --repeats runs over the same
routing, each from an empty cache, after --warm tokens that fill it), hits and misses over the timed tokens, and
microseconds per miss. The ratios are against `lrfu` measured in the same run; peak RSS at the end (lrfu-next keeps
2 bytes x experts^2 of counts per layer). Only the bookkeeping is timed: no reads, no MLX. The hit rates are the
synthetic routing's, not a real model's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from harness import REPO, peak_rss_bytes


def k3_routing(tokens: int, layers: int = 60, experts: int = 896, k: int = 16, carry: float = 1 / 3,
               seed: int = 0) -> list[list[tuple[int, list[int]]]]:
    """[token][layer call] = (layer, sorted distinct experts): per layer a Zipf-like popularity (weight 1 / rank^0.8)
    over a random order of its experts; each token keeps round(carry * k) of the layer's previous experts (chosen at
    random) and draws the rest by weight without replacement."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1) ** 0.8
    orders = [rng.permutation(experts) for _ in range(layers)]
    keep = round(carry * k)
    prev: list[np.ndarray | None] = [None] * layers
    out = []
    for _ in range(tokens):
        calls = []
        for layer in range(layers):
            kept = rng.choice(prev[layer], keep, replace=False) if prev[layer] is not None else np.zeros(0, int)
            p = w.copy()
            p[np.isin(orders[layer], kept)] = 0.0
            p /= p.sum()
            new = rng.choice(orders[layer], k - len(kept), replace=False, p=p)
            chosen = np.concatenate([kept, new]).astype(int)
            prev[layer] = chosen
            calls.append((layer, sorted(int(e) for e in chosen)))
        out.append(calls)
    return out


def measure(batches, slots: int, policy: str, warm: int, repeats: int) -> dict:
    from streaming import simulate

    from tqbench.stream.cache import SlotCache

    times, result = [], None
    for _ in range(repeats):
        cache = SlotCache(slots, policy)
        simulate(batches, cache, 0, warm)
        t = time.perf_counter()
        result = simulate(batches, cache, warm)
        times.append(time.perf_counter() - t)
    timed = len(batches) - warm
    sec = statistics.median(times)
    return {"policy": policy, "slots": slots, "tokens": timed, "ms_per_token": 1000 * sec / timed,
            "hits": result["hits"], "misses": result["misses"], "hit_rate": result["hit_rate"],
            "us_per_miss": 1e6 * sec / max(1, result["misses"]), "runs_s": times}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", default="3000,12000")
    p.add_argument("--policies", default="lru,lrfu,lrfu-next")
    p.add_argument("--tokens", type=int, default=300, help="timed tokens (after --warm)")
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 layers, 200 slots, 10 warm-up + 20 timed tokens, one run")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "policy_cost.json")
    a = p.parse_args(argv)
    from tqbench.stream.policies import POLICIES

    try:
        slot_counts = [int(s) for s in a.slots.split(",")]
    except ValueError:
        raise SystemExit(f"--slots: comma-separated integers, not {a.slots!r}") from None
    policies = a.policies.split(",")
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        raise SystemExit(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    layers = 60
    if a.quick:
        layers, slot_counts, a.tokens, a.warm, a.repeats = 8, [200], 20, 10, 1
    started = time.time()
    batches = k3_routing(a.warm + a.tokens, layers=layers)
    rows = []
    for slots in slot_counts:
        base = None
        for policy in policies:
            r = measure(batches, slots, policy, a.warm, a.repeats)
            rows.append(r)
            if policy == "lrfu":
                base = r["ms_per_token"]
            print(f"{slots:6d} slots {policy:10s}: {r['ms_per_token']:7.2f} ms/token, hit rate {r['hit_rate']:.3f}, "
                  f"{r['us_per_miss']:.0f} us/miss", flush=True)
        for r in rows:
            if r["slots"] == slots and base:
                r["vs_lrfu"] = r["ms_per_token"] / base
    doc = {"schema": "tqbench.bench.policy-cost/1", "date": time.strftime("%Y-%m-%d"),
           "machine": {"platform": platform.platform(), "python": platform.python_version()}, "quick": a.quick,
           "routing": {"layers": layers, "experts": 896, "top_k": 16, "carry": 1 / 3, "zipf": 0.8,
                       "warm_tokens": a.warm, "timed_tokens": a.tokens},
           "rows": rows, "peak_rss": peak_rss_bytes(), "seconds": round(time.time() - started, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Expert-cache replacement policies against the offline bounds, on routing traces: the goal is that the default policy
closes at least a third of LRU's gap to Belady at every budget (gap_closed = (policy - lru) / (belady - lru), in hit
rate) and beats the best fixed set.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/policies.py \\
        --work /tmp/policies --out results/bench-policies-cpu.json
    python benchmarks/policies.py --trace a.npy --trace b.npy   # your own traces, int [moe layers, tokens, k]
    python benchmarks/policies.py --quick                       # a smoke run (a minute or two)

Workloads (unless --trace is given): the shipped demo (7 MoE layers x 448 experts, top-8) run teacher-forced over
`--tokens` tokens cut into `--window`-token windows from an empty context (`training.modelstats.trace_routing`), so
each position is routed as a decode of that text would route it:
- `code`: the held-out split of the code corpus (benchmarks/streaming.py's trace; reused from --work while its inputs
  match),
- `chat`: the held-out conversations (`training.conversations`, one pass, seed 0, through the demo's chat template).

Budgets (cache slots = expert-layers; --budgets takes integers, fractions of the expert-layers like 1/16, and `ws/2`:
half of one token's routed experts over all layers, below one token's working set, where LRU hits nothing). For each,
with the cache driven as the streamer drives it (benchmarks/streaming.py's `simulate`: per token and MoE layer, look up
the distinct routed experts, then place the misses with that layer's experts locked):
- `lru`, `lrfu` (lam 0.01: the default policy until 2026-12-02, `OLD_DEFAULT` here), `lrfu@0.02` (the same at lam
  0.02), `lrfu-next` (the default: LRFU on two time scales plus a learned prediction of each layer's next routing,
  NextLRFU in tqbench/stream/policies.py; its bookkeeping costs 2-3x lrfu's, benchmarks/policy_cost.py);
- `belady` (offline optimum with the layer's experts locked) and `best_fixed` (the budget's most-routed keys);
- references, not policies: `oracle-next-h` is `lrfu@0.02` whose victim is never a key that the rest of this token or
  the next h tokens route, when another is unlocked: what perfect knowledge of the next h tokens would add to LRFU;
  `belady-h` is Belady's MIN that sees only the rest of this token and the next h tokens (beyond them LRFU at lam
  0.02 decides): how far ahead a policy would have to see to close a given share of the gap.
Reports gap_closed per policy and budget, whether it is >= 1/3 and whether the policy beats the best fixed set.

Writes JSON (`--out`, default bench-results/policies.json, schema tqbench.bench.policies/1) and prints tables.
"""

from __future__ import annotations

import sys

from harness import add_size_options, machine_info, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from streaming import (RELEVANT, batches_of, belady_hit_rate, best_fixed_hit_rate, demo_digest, lookup,  # noqa: E402
                       prepare_trace, simulate)

SCHEMA = "tqbench.bench.policies/1"
GOAL = 1 / 3
OLD_DEFAULT = "lrfu"  # the default until 2026-12-02 (now lrfu-next), the baseline of "not below"; the JSON key's name
DEFAULTS = dict(tokens=20480, window=256, budgets="ws/2,1/16,1/8,1/4,1/2", workloads="code,chat",
                policies="lru,lrfu,lrfu@0.02,lrfu-next", oracles="1,4",
                horizons="1,4,16,64")
QUICK = dict(tokens=1024, window=256, budgets="ws/2,1/8,1/2", workloads="code", policies="lru,lrfu,lrfu-next",
             oracles="1", horizons="4")


def make_policy_cache(budget: int, spec: str):
    """A SlotCache for `spec`: a policy name, or `name@lam` (LRFU-family at that lam)."""
    from tqbench.stream.cache import SlotCache
    from tqbench.stream.policies import POLICIES

    name, _, lam = spec.partition("@")
    cache = SlotCache(budget, name)
    if lam:
        cache.policy = POLICIES[name](float(lam))
    return cache


def oracle_hit_rate(batches, budget: int, h: int, lam: float = 0.02) -> float:
    """LRFU at `lam` whose victim is never a key the rest of the current token or the next `h` tokens route (when a
    key outside them is unlocked): a reference for what knowing the next h tokens would add, not an online policy."""
    from tqbench.stream.cache import SlotCache
    from tqbench.stream.policies import LRFU

    cache = SlotCache(budget, "lrfu")
    cache.policy = LRFU(lam)
    hits = total = 0
    for t, token in enumerate(batches):
        now = t + 1
        ahead = {(layer, e) for later in batches[t + 1:t + 1 + h] for layer, es in later for e in es}
        this = [(layer, set(es)) for layer, es in token]
        for i, (layer, experts) in enumerate(token):
            locked, missing = lookup(cache, layer, experts, now)
            hits += len(experts) - len(missing)
            total += len(experts)
            rest = {(lay, e) for lay, es in this[i + 1:] for e in es}
            keep = {k for k in (rest | ahead) if k in cache}
            for e in missing:
                guard = locked | keep
                if len(cache) >= cache.capacity and len(set(cache.slots) - guard - cache.pinned) == 0:
                    guard = locked
                cache.place((layer, e), now, guard)
                locked.add((layer, e))
    return hits / max(1, total)


def horizon_hit_rate(batches, budget: int, h: int, lam: float = 0.02) -> float:
    """Belady within a horizon: a reference that knows the rest of the current token and the next `h` tokens exactly
    and nothing beyond. A miss with the cache full evicts, among the keys not in the current layer call, one that no
    call within the horizon uses (the smallest LRFU value at `lam` among those), else the one used last within it.
    With `h` past the trace's end it is Belady's MIN (streaming.belady_hit_rate); it asks how far ahead a policy would
    have to see to close a given share of the gap."""
    from tqbench.stream.policies import one_more_access

    calls = [c for token in batches for c in token]
    per_token = len(batches[0]) if batches else 1
    never = len(calls) + 1
    nxt: list[list[int]] = [[] for _ in calls]  # per call, each expert's next call, as in belady_hit_rate
    last: dict[tuple[int, int], int] = {}
    for i in range(len(calls) - 1, -1, -1):
        layer, experts = calls[i]
        nxt[i] = [last.get((layer, e), never) for e in experts]
        for e in experts:
            last[(layer, e)] = i
    lrfu: dict[tuple[int, int], tuple[float, int]] = {}  # key -> (log2 C at t_last, t_last), as LRFU keeps it
    row_of: dict[tuple[int, int], int] = {}
    keys: list = [None] * budget
    use = np.zeros(budget, dtype=np.int64)  # the resident key's next call
    prio = np.zeros(budget)  # LRFU's time-invariant order: log2 C + lam * t_last
    locked = np.zeros(budget, dtype=bool)
    hits = total = 0
    for i, (layer, experts) in enumerate(calls):
        now = i // per_token + 1  # ticks count tokens from 1, as simulate's
        seen = (now + h) * per_token  # the calls numbered below `seen` are within the horizon
        rows, missing = [], []
        for e, u in zip(experts, nxt[i]):  # look the call's experts up first: its hits are locked
            key = (layer, e)
            old = lrfu.get(key)
            log_c = 0.0 if old is None else one_more_access(old[0], now - old[1], lam)
            lrfu[key] = (log_c, now)
            row = row_of.get(key)
            if row is None:
                missing.append((key, u, log_c))
                continue
            use[row], prio[row], locked[row] = u, log_c + lam * now, True
            rows.append(row)
        hits += len(experts) - len(missing)
        total += len(experts)
        for key, u, log_c in missing:  # then place the misses, each locked once placed
            if len(row_of) < budget:
                row = len(row_of)
            else:
                free = ~locked
                far = free & (use >= seen)
                row = int(np.flatnonzero(far)[np.argmin(prio[far])]) if far.any() else \
                    int(np.flatnonzero(free)[np.argmax(use[free])])
                del row_of[keys[row]]
            row_of[key], keys[row] = row, key
            use[row], prio[row], locked[row] = u, log_c + lam * now, True
            rows.append(row)
        locked[rows] = False
    return hits / max(1, total)


def token_counts(flag: str, spec) -> list[int]:
    """`--oracles` / `--horizons`: comma-separated token counts >= 0 (may be empty)."""
    parts = [x.strip() for x in str(spec).split(",") if x.strip()]
    if not all(x.isdigit() for x in parts):
        raise SystemExit(f"{flag} {spec}: comma-separated whole numbers of tokens (like 1,4,16)")
    return [int(x) for x in parts]


def parse_budgets(spec: str, expert_layers: int, working_set: int, k: int) -> list[tuple[str, int]]:
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "ws":
            b = working_set
        elif part.startswith("ws/"):
            b = working_set // int(part[3:])
        elif "/" in part:
            b = int(expert_layers * Fraction(part))
        else:
            b = int(part)
        if not k <= b <= expert_layers:
            raise SystemExit(f"budget {part} = {b}: must hold one layer's top-{k} and at most {expert_layers}")
        out.append((part, b))
    return out


def chat_trace(work: Path, tokens: int, window: int) -> tuple[np.ndarray, dict]:
    """The demo's routing over the held-out conversations (one pass, seed 0), cached in `work` while inputs match."""
    out, marker = work / "chat-trace.npy", work / "chat-trace.json"
    want = dict(demo=demo_digest(), tokens=tokens, window=window, python=platform.python_version(), seed=0)
    if out.is_file() and marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("inputs") == want:
            return np.load(out), dict(info, reused=True)
    from mlx_lm import load

    from tqbench.demo import SHIPPED_DEMO, SHIPPED_SPEC
    from tqbench.tokenizer import load_encoding
    from training.conversations import build_conversations, encode_conversation, mine_stdlib, split_items
    from training.corpus import stdlib_root
    from training.modelstats import trace_routing

    t0 = time.perf_counter()
    enc = load_encoding(SHIPPED_DEMO)
    template = json.loads((SHIPPED_DEMO / "tokenizer_config.json").read_text())["chat_template"]
    _, val_items = split_items(mine_stdlib(stdlib_root()))
    convs = build_conversations(val_items, 0, passes=1)
    stream = np.array([t for c in convs for t in encode_conversation(enc, c.messages, template)], np.uint32)
    n = min(tokens, (len(stream) - 1) // window * window)
    model, _ = load(str(SHIPPED_DEMO))
    t1 = time.perf_counter()
    trace = trace_routing(model, stream[: n + 1], window=window, batch=32)
    moe = [i for i in range(SHIPPED_SPEC.num_hidden_layers) if SHIPPED_SPEC.is_moe(i)]
    info = dict(mode="chat-trace", shape=list(trace.shape), conversations=len(convs), heldout_tokens=int(len(stream)),
                tokens_sha256=hashlib.sha256(stream[: n + 1].astype(np.uint32).tobytes()).hexdigest(),
                moe_layers=moe, num_experts=SHIPPED_SPEC.num_experts, top_k=SHIPPED_SPEC.num_experts_per_token,
                trace_seconds=time.perf_counter() - t1, total_seconds=time.perf_counter() - t0, inputs=want)
    np.save(out, trace)
    marker.write_text(json.dumps(info))
    return trace, dict(info, reused=False)


def replay(name: str, trace: np.ndarray, info: dict, cfg: dict) -> dict:
    """Every policy and bound at every budget on one trace."""
    layers = list(info.get("moe_layers") or range(trace.shape[0]))
    experts = int(info.get("num_experts") or trace.max() + 1)
    k = trace.shape[-1]
    expert_layers = len(layers) * experts
    working_set = len(layers) * k
    batches = batches_of(trace, layers)
    policies = [p.strip() for p in cfg["policies"].split(",") if p.strip()]
    oracles = token_counts("--oracles", cfg["oracles"])
    horizons = token_counts("--horizons", cfg.get("horizons", ""))
    rows = []
    for label, b in parse_budgets(cfg["budgets"], expert_layers, working_set, k):
        t0 = time.perf_counter()
        row: dict = dict(budget=b, label=label, share=b / expert_layers, belady=belady_hit_rate(batches, b),
                         best_fixed=best_fixed_hit_rate(batches, b), seconds={})
        for p in policies:
            t1 = time.perf_counter()
            row[p] = simulate(batches, make_policy_cache(b, p))["hit_rate"]
            row["seconds"][p] = time.perf_counter() - t1
        for h in oracles:
            row[f"oracle-next-{h}"] = oracle_hit_rate(batches, b, h)
        for h in horizons:
            row[f"belady-{h}"] = horizon_hit_rate(batches, b, h)
        gap = row["belady"] - row["lru"] if "lru" in row else None
        names = policies + [f"oracle-next-{h}" for h in oracles] + [f"belady-{h}" for h in horizons]
        row["gap_closed"] = {p: (row[p] - row["lru"]) / gap if gap else None for p in names}
        row["closes_third"] = {p: g is not None and g >= GOAL for p, g in row["gap_closed"].items()}
        row["beats_fixed"] = {p: row[p] > row["best_fixed"] for p in names}
        rows.append(row)
        print(f"  {name} {label:>5} = {b:5d} slots: " + " ".join(f"{p} {row[p]:.4f}" for p in names)
              + f" belady {row['belady']:.4f} fixed {row['best_fixed']:.4f}"
              + f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    return dict(name=name, trace=info, tokens=len(batches), expert_layers=expert_layers, working_set=working_set,
                rows=rows)


def summarize(workloads: list[dict], policies: list[str]) -> dict:
    """Per policy: budgets (over every workload) where it closes a third of the gap / beats the best fixed set /
    is not below the old default's hit rate."""
    out = {}
    rows = [r for w in workloads for r in w["rows"]]
    for p in policies:
        below = sum(r[p] >= r[OLD_DEFAULT] for r in rows) if OLD_DEFAULT in rows[0] else None
        out[p] = dict(budgets=len(rows), closes_third=sum(r["closes_third"][p] for r in rows),
                      beats_fixed=sum(r["beats_fixed"][p] for r in rows), not_below_old_default=below,
                      min_gap_closed=min(r["gap_closed"][p] for r in rows))
    return out


def print_tables(doc: dict) -> None:
    for w in doc["workloads"]:
        rows = w["rows"]
        names = [k for k in rows[0]["gap_closed"]]
        print(f"\n{w['name']}: {w['tokens']} tokens, {w['expert_layers']} expert-layers, {w['working_set']} routed per "
              "token (hit rate; gap closed)")
        print(f"{'budget':>12} " + " ".join(f"{n:>15}" for n in names) + f" {'belady':>7} {'fixed':>7}")
        for r in rows:
            cells = " ".join(f"{r[n]:7.4f} {r['gap_closed'][n]:+6.2f} " for n in names)
            print(f"{r['label']:>5} {r['budget']:>6} {cells} {r['belady']:7.4f} {r['best_fixed']:7.4f}")
    print("\nsummary (budgets over all workloads):")
    for p, s in doc["summary"].items():
        print(f"  {p:>12}: closes a third at {s['closes_third']}/{s['budgets']}, beats the best fixed set at "
              f"{s['beats_fixed']}/{s['budgets']}, not below {OLD_DEFAULT} at {s['not_below_old_default']}/"
              f"{s['budgets']}, smallest gap closed {s['min_gap_closed']:+.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--trace", type=Path, action="append", default=[],
                   help="a routing trace .npy [moe layers, tokens, k] instead of the demo's workloads (repeatable); "
                        "layers count 0.. and experts 0..max+1")
    p.add_argument("--work", type=Path, default=Path("bench-results/policies-work"),
                   help="where the demo's traces are kept and reused")
    p.add_argument("--out", type=Path, default=Path("bench-results/policies.json"), help="JSON result file")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for the code trace's child process")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)
    token_counts("--oracles", cfg["oracles"])  # checked before any tracing
    token_counts("--horizons", cfg["horizons"])
    t_start = time.perf_counter()
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    doc: dict = dict(schema=SCHEMA, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=[sys.executable, *sys.argv],
                     machine=machine_info(work, RELEVANT),
                     config=dict(cfg, quick=a.quick, goal=GOAL, old_default=OLD_DEFAULT))
    traces: list[tuple[str, np.ndarray, dict]] = []
    if a.trace:
        for f in a.trace:
            t = np.load(f)
            traces.append((f.stem, t, dict(path=str(f), shape=list(t.shape),
                                           sha256=hashlib.sha256(f.read_bytes()).hexdigest())))
    else:
        for w in (x.strip() for x in cfg["workloads"].split(",") if x.strip()):
            print(f"tracing the demo's routing ({w}) ...", end=" ", flush=True)
            if w == "code":
                t, info = prepare_trace(work, dict(trace_tokens=cfg["tokens"], window=cfg["window"]), a.timeout)
            elif w == "chat":
                t, info = chat_trace(work, cfg["tokens"], cfg["window"])
            else:
                raise SystemExit(f"--workloads: unknown {w!r} (code, chat)")
            print(("reused" if info.get("reused") else f"{info['trace_seconds']:.0f}s") + f": {t.shape}", flush=True)
            traces.append((w, t, info))
    doc["workloads"] = [replay(name, t, info, cfg) for name, t, info in traces]
    names = list(doc["workloads"][0]["rows"][0]["gap_closed"])
    doc["summary"] = summarize(doc["workloads"], names)
    doc["total_seconds"] = time.perf_counter() - t_start
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_tables(doc)
    print(f"\nwrote {a.out} ({doc['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Hot-expert profiles at a fixed cache budget (issue 12): cold, shipped, learned, exported-and-imported, and the
seed system's rule, on sessions about one kind of text and then another.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/hot_profile.py
    python benchmarks/hot_profile.py --quick            # a smoke run

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset.)

Workload: the shipped demo converted with `tq4` (what `tqbench chat` runs), expert streaming at `--budget-kb` (about
a quarter of its 3,136 expert-layers by default), page cache on (this measures hits and bytes, not speed). Phase 1 is
`--sessions` chat sessions about domain A, phase 2 as many about domain B (default email, then asyncio: two large
domains the demo was trained on); a session is one conversation of `--turns` questions ("What does
email.message.Message.get do?" about that domain's documented functions and methods, seeded, none asked twice),
greedy `--tokens` per reply, each session a fresh engine session and expert cache, as a new `tqbench chat` process
would be. Every variant replays the same sessions in the same order through the engine (`tqbench.chat.session.ChatSession`):

- cold: `--cold --no-learn`, no profile;
- shipped: the profile shipped for the demo (`profiles/demo-tq4.json`, made from held-out code files), no learning;
- learned: the engine's defaults: learning into its own store, using the learned profile once mature (20,000
  routings; before that the shipped one), pins up to 0.5 of the slots, prompts' routings weighed as decode's;
- learned 10%: the same with the earlier defaults, 0.1 of the slots and prompts weighed 0.25;
- imported (phase 2 only): phase 1's learned profile exported to a file (`tqbench profile export`'s function) and
  imported into a fresh store (`tqbench profile import`'s), then the same as learned: it must give exactly the learned
  variant's phase-2 figures (the file loses nothing);
- seed rule: TurboQuant-MLX's rule emulated on our streamer: counts merged at the end of each session as new + 0.7 x
  old into its usage-profile format, used only once mature (20,000 routings), pins up to 60% of the budget.

Reported per variant and phase: hit rate (and pinned hits), critical bytes read per generated token, preload bytes and
seconds, and per session. Writes JSON (`--out`, schema tqbench.bench.profile/1) and prints a table.
"""

from __future__ import annotations

import os
import platform
import sys

from harness import add_size_options, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SCHEMA = "tqbench.bench.profile/1"
SEED_DECAY, SEED_MATURE, SEED_PIN_SHARE = 0.7, 20_000, 0.6  # TurboQuant-MLX's rule (docs/profiles.md)
DEFAULTS = dict(domains="email,asyncio", sessions=4, turns=3, tokens=40, budget_kb=2600, seed=0)
QUICK = dict(domains="email,asyncio", sessions=2, turns=1, tokens=8, budget_kb=600, seed=0)


def questions(domain: str, n: int, rng: np.random.Generator) -> list[str]:
    """`n` distinct seeded questions about `domain`'s documented functions and methods (training items)."""
    from training.conversations import domain_of, mine_stdlib, question
    from training.corpus import corpus_files, stdlib_root

    root = stdlib_root()
    files = [f for f in corpus_files(root) if domain_of(f) == domain]
    items = [i for i in mine_stdlib(root, files) if i.kind in ("function", "method")]
    if len(items) < n:
        raise SystemExit(f"domain {domain!r} has {len(items)} documented functions and methods; {n} needed")
    pick = rng.choice(len(items), n, replace=False)
    return [question(items[i], "What does {name} do?") for i in pick]


def run_session(model: str, turns: list[str], tokens: int, budget: int, opts) -> dict:
    """One chat session through the engine; its streaming figures and the experts it routed (for the seed rule)."""
    from tqbench.chat.request import ChatRequest, StreamRequest
    from tqbench.chat.session import ChatSession
    from tqbench.runtime.conversation import Sampling
    from tqbench.events import ReplyDone
    from tqbench.events import PageIn

    s = ChatSession()
    counts: dict[int, dict[int, int]] = {}
    generated = 0
    try:
        with s.open(ChatRequest(model=model, stream=StreamRequest(budget=f"{budget}B", workers=2, page_cache="on"),
                                profile=opts)) as job:
            loaded = job.result()[-1]
        for text in turns:
            with s.reply(text, Sampling(max_tokens=tokens)) as job:
                for ev in job.result():
                    if isinstance(ev, PageIn):
                        layer = counts.setdefault(ev.layer, {})
                        for e in ev.experts:
                            layer[e] = layer.get(e, 0) + 1
                    elif isinstance(ev, ReplyDone):
                        generated += ev.generated_tokens
        st = s.stats().to_dict()
    finally:
        s.close()  # the learner's last save
    return dict(profile=loaded.profile.to_dict() if loaded.profile else None, generated=generated, hits=st["hits"], hits_pinned=st["hits_pinned"],
                misses=st["misses"], hit_rate=st["hit_rate"], critical_bytes=st["critical_bytes"],
                preload_bytes=st["preload_bytes"], preload_s=st["preload_s"], slots=st["slots"],
                pinned=st["pinned"], counts=counts)


def seed_usage(old: dict | None, counts: dict[int, dict[int, int]], experts: int) -> dict:
    """The seed system's usage profile after a session: new + 0.7 x old, merged at exit."""
    merged = {}
    layers = set(counts) | {int(k) for k in (old or {}).get("counts", {})}
    for n in sorted(layers):
        new = np.zeros(experts)
        for e, c in counts.get(n, {}).items():
            new[e] = c
        prev = np.asarray((old or {}).get("counts", {}).get(str(n), np.zeros(experts)), dtype=float)
        merged[str(n)] = (new + SEED_DECAY * prev).tolist()
    routings = sum(sum(c.values()) for c in counts.values()) + SEED_DECAY * ((old or {}).get("routings") or 0)
    return {"version": 1, "num_experts": experts, "routings": routings, "counts": merged}


def summarize(rows: list[dict]) -> dict:
    hits, misses = sum(r["hits"] for r in rows), sum(r["misses"] for r in rows)
    gen = sum(r["generated"] for r in rows)
    return dict(sessions=len(rows), hit_rate=hits / max(1, hits + misses),
                pinned_hit_share=sum(r["hits_pinned"] for r in rows) / max(1, hits + misses),
                critical_bytes_per_token=sum(r["critical_bytes"] for r in rows) / max(1, gen),
                preload_bytes=sum(r["preload_bytes"] for r in rows), preload_s=sum(r["preload_s"] for r in rows),
                generated=gen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--variants", default=None, help="a comma-separated subset of the variants (default: all)")
    p.add_argument("--out", type=Path, default=Path("bench-results/profile.json"))
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)

    from tqbench.convert import convert
    from tqbench.demo import SHIPPED_SPEC, ensure_demo
    from tqbench.profile import ProfileStore
    from tqbench.profile.share import export_learned, import_file
    from tqbench.recipe import Recipe
    from tqbench.chat.request import ProfileOptions

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    rng = np.random.default_rng(cfg["seed"])
    domains = cfg["domains"].split(",")
    n, k = cfg["sessions"], cfg["turns"]
    phases = {d: [questions(d, n * k, rng)[i * k:(i + 1) * k] for i in range(n)] for d in domains}
    plan = [(d, turns) for d in domains for turns in phases[d]]
    budget = cfg["budget_kb"] * 1000
    with tempfile.TemporaryDirectory(prefix="tqbench-profile-bench-") as tmp:
        work = Path(tmp)
        model = work / "demo-tq4"
        t0 = time.perf_counter()
        for _ in convert(ensure_demo(), model, Recipe.parse("tq4")):
            pass
        log(f"converted the demo with tq4 in {time.perf_counter() - t0:.1f} s")
        stores = {v: work / f"store-{v}" for v in ("learned", "learned10", "imported", "empty")}
        seed_file, seed_doc = work / "seed-usage.json", None
        results: dict[str, list[dict]] = {v: [] for v in ("cold", "shipped", "learned", "learned 10%", "imported",
                                                           "seed rule")}
        for i, (domain, turns) in enumerate(plan):
            phase = 1 + domains.index(domain)
            if i == n and (not a.variants or "imported" in a.variants.split(",")):
                # phase 2 starts: export what "learned" has, import it into a fresh store
                exported = work / "exported.json"
                st = ProfileStore(str(stores["learned"]))
                try:
                    export_learned(str(model), st, exported)
                finally:
                    st.close()
                st = ProfileStore(str(stores["imported"]))
                try:
                    import_file(str(model), exported, st)
                finally:
                    st.close()
            seed_mature = seed_doc is not None and seed_doc["routings"] >= SEED_MATURE
            variants = {
                "cold": ProfileOptions(cold=True, learn=False),
                "shipped": ProfileOptions(learn=False, store=str(stores["empty"])),
                "learned": ProfileOptions(store=str(stores["learned"])),
                "learned 10%": ProfileOptions(store=str(stores["learned10"]), pin_share=0.1, prefill_weight=0.25),
                "seed rule": (ProfileOptions(file=str(seed_file), learn=False, pin_share=SEED_PIN_SHARE)
                              if seed_mature else ProfileOptions(cold=True, learn=False)),
            }
            if phase > 1:
                variants["imported"] = ProfileOptions(store=str(stores["imported"]))
            if a.variants:
                variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
            for name, opts in variants.items():
                r = run_session(str(model), turns, cfg["tokens"], budget, opts)
                r.update(phase=phase, domain=domain, session=i + 1)
                if name == "seed rule":
                    seed_doc = seed_usage(seed_doc, r["counts"], SHIPPED_SPEC.num_experts)
                    seed_file.write_text(json.dumps(seed_doc))
                del r["counts"]
                results[name].append(r)
                log(f"session {i + 1} ({domain}) {name:<14}: hit {r['hit_rate']:.1%} (pinned {r['hits_pinned']}), "
                    f"{r['critical_bytes'] / max(1, r['generated']) / 1e3:.1f} kB/token, profile "
                    f"{r['profile']['source']} ({r['profile']['routings']:,} routings, {r['pinned']} pinned)")
        slots = next(r["slots"] for rows in results.values() for r in rows)
    results = {k: v for k, v in results.items() if v}
    summary = {name: {f"phase {ph}": summarize([r for r in rows if r["phase"] == ph]) for ph in (1, 2)
                      if any(r["phase"] == ph for r in rows)} for name, rows in results.items()}
    same = [(a["hits"], a["misses"], a["critical_bytes"]) == (b["hits"], b["misses"], b["critical_bytes"])
            for a, b in zip(results.get("imported", []), [r for r in results.get("learned", []) if r["phase"] == 2])]
    doc = dict(schema=SCHEMA, config=cfg, budget_bytes=budget, slots=slots, expert_layers=SHIPPED_SPEC.num_experts
               * sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers)),
               sessions=[dict(domain=d, questions=t) for d, t in plan], results=results, summary=summary,
               imported_equals_learned=(all(same) and len(same) == n) if "imported" in results else None,
               machine=dict(platform=platform.platform(), python=platform.python_version(),
                            cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d")))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nbudget {budget:,} bytes = {slots} slots of {doc['expert_layers']:,} expert-layers; "
          f"phase 1 {domains[0]}, phase 2 {domains[1]}, {n} sessions each")
    print(f"{'variant':<15} {'phase':<6} {'hit rate':>8} {'pinned':>7} {'kB/token':>9} {'preload':>9}")
    for name, phs in summary.items():
        for ph, s in phs.items():
            print(f"{name:<15} {ph[-1]:<6} {s['hit_rate']:>8.1%} {s['pinned_hit_share']:>7.1%} "
                  f"{s['critical_bytes_per_token'] / 1e3:>9.1f} {s['preload_bytes'] / 1e3:>7.0f}kB")
    print(f"imported == learned in phase 2: {doc['imported_equals_learned']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

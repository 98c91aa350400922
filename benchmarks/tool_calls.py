#!/usr/bin/env python3
"""Where tool calls break (issue 49): the demo's held-out tool calls (`tqbench eval --tools`'s cases) scored on the
source, on each recipe's conversion, and on the K3 recipe's conversion with fewer experts per token
(`--max-active-experts`) and with cache-aware routing, in one run.

    python benchmarks/tool_calls.py --out results/bench-tool-calls-cpu.json     # about 30 minutes on 2 cores
    python benchmarks/tool_calls.py --quick                                      # a smoke run: 3 cases, 2 rows
    python benchmarks/tool_calls.py --model build/v9a/checkpoint --tool-syntax schema    # another source, guarded

The source runs once: its calls are what every other row is compared with ("same call as the source's"), besides
the reference calls ("exact"). Each row is one model loaded as a chat loads it (tqbench.runtime.load; streamed with
an expert cache where the row says so), scored by tqbench.eval.tools.score_tools (greedy; valid calls: the tokenizer's
tool parser and the tools' JSON schemas; answers: the reply after the tool's result quotes it). Rows:
- `source`: the shipped demo (its exact rate against the reference is the goal of >= 80%);
- each of `--recipes`, converted from the demo into the work directory (once; kept);
- the K3 recipe at `--ks` experts per token (the demo's own is 8);
- the K3 recipe streamed with a cache of `--cache-slots` experts and cache-aware routing at each of `--margins`.
(On Linux the script re-executes itself with Debian's OpenBLAS preloaded when it exists and LD_PRELOAD is unset.)
"""

from __future__ import annotations

import sys

from harness import add_size_options, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import dump_json, log, machine_info, peak_rss_bytes  # noqa: E402

SCHEMA = "tqbench.bench.tool_calls/1"
K3_RECIPE = "tq3a-tqTe-down4-g64"
DEFAULTS = dict(cases=0, recipes="tq4,tq3,affine3,affine4," + K3_RECIPE, ks="6,4,2", margins="0.05,0.1",
                cache_slots=600)
QUICK = dict(cases=3, recipes="tq4", ks="4", margins="", cache_slots=600)


def row(name: str, score, source=None, seconds: float = 0.0, **extra) -> dict:
    """One row's figures; `source`: the source's ToolScore, whose calls this row's are compared with."""
    from tqbench.eval.tools import same_call

    out = dict(name=name, cases=score.cases, valid=score.valid, valid_rate=score.valid_rate, exact=score.exact,
               exact_rate=score.exact_rate, answered=score.answered, answers=score.answers,
               answer_rate=score.answer_rate, seconds=seconds, **extra)
    if source is not None:
        agree = sum(r.call.valid and same_call(r.call, s.call.name, s.call.arguments) and s.call.valid
                    for r, s in zip(score.results, source.results))
        out.update(same_as_source=agree, same_as_source_rate=agree / score.cases)
    out["problems"] = sorted({r.call.problem.split(":")[0] for r in score.results if r.call.problem})
    return out


def score(path: Path, cases, *, k: int = 0, budget: int = 0, margin: float = 0.0, tool_syntax: str = "sample"):
    from tqbench.eval.tools import score_tools
    from tqbench.runtime.load import load
    from tqbench.runtime.routing import set_active_experts
    from tqbench.stream.streamer import StreamConfig

    streaming = StreamConfig(budget_bytes=budget, workers=2, page_cache="on", cache_routing=margin) if budget else None
    loaded = load(path, streaming=streaming)
    try:
        if k:
            set_active_experts(loaded.model, k)
        steps = score_tools(loaded, None, cases, tool_syntax=tool_syntax)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
    finally:
        if loaded.streamer is not None:
            loaded.streamer.close()


def main(argv: list[str] | None = None) -> int:
    from tqbench.chat.request import TOOL_SYNTAX

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK, "a smoke run")
    p.add_argument("--model", type=Path, help="the source (default: the shipped demo)")
    p.add_argument("--work", type=Path, default=Path("bench-results/tool-calls"), help="conversions go here (kept)")
    p.add_argument("--out", type=Path, default=Path("bench-results/tool_calls.json"))
    p.add_argument("--tool-syntax", choices=TOOL_SYNTAX, default="sample",
                   help="every row's tool calls decoded as `tqbench eval --tools --tool-syntax` does (schema: held to "
                        "the offered tools' grammar)")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)

    from tqbench.convert import convert
    from tqbench.demo import SHIPPED_SPEC, ensure_demo
    from tqbench.eval.tools import load_cases
    from tqbench.layout.names import INDEX_FILE
    from tqbench.recipe import Recipe

    from cache_routing import budget_bytes

    source = a.model or Path(ensure_demo())
    cases = load_cases(None, cfg["cases"])
    t0 = time.perf_counter()
    doc: dict = dict(schema=SCHEMA, command=" ".join(sys.argv), config=cfg, machine=machine_info(a.work, ("tqbench",)),
                     source=str(source), rows=[])

    def add(name: str, path: Path, **kw) -> None:
        t = time.perf_counter()
        s = score(path, cases, tool_syntax=a.tool_syntax, **kw)
        extra = {key: v for key, v in kw.items() if v}
        doc["rows"].append(row(name, s, None if name == "source" else src, time.perf_counter() - t, **extra))
        r = doc["rows"][-1]
        log(f"{name:>28}: valid {r['valid']}/{r['cases']}, exact {r['exact']}, same as source "
            f"{r.get('same_as_source', '-')}, answers {r['answered']}/{r['answers']} ({r['seconds']:.0f} s)")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(dump_json(doc))

    t = time.perf_counter()
    src = score(source, cases, tool_syntax=a.tool_syntax)
    doc["rows"].append(row("source", src, None, time.perf_counter() - t))
    log(f"{'source':>28}: valid {src.valid}/{src.cases}, exact {src.exact}, answers {src.answered}/{src.answers}")
    converted = {}
    for name in cfg["recipes"].split(","):
        recipe = Recipe.parse(name)
        dest = a.work / recipe.name
        if not (dest / INDEX_FILE).is_file():
            log(f"converting the demo with {recipe.name}")
            list(convert(source, dest, recipe))
        converted[recipe.name] = dest
        add(recipe.name, dest)
    k3 = converted.get(K3_RECIPE) or next(iter(converted.values()))
    native = SHIPPED_SPEC.num_experts_per_token
    for k in [int(x) for x in str(cfg["ks"]).split(",") if x]:
        add(f"{k3.name}, {k} of {native} experts", k3, k=k)
    budget = budget_bytes(k3, cfg["cache_slots"])
    for m in [float(x) for x in str(cfg["margins"]).split(",") if x]:
        add(f"{k3.name}, cache routing {m:g}", k3, budget=budget, margin=m)
    doc.update(seconds=time.perf_counter() - t0, peak_rss=peak_rss_bytes())
    a.out.write_text(dump_json(doc))
    log(f"wrote {a.out} in {doc['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

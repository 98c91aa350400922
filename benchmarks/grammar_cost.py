#!/usr/bin/env python3
"""What constrained decoding costs a token (issue 49): llguidance's mask for each next token, at the demo's vocabulary
(a real model decoding) and at K3's (163,840 tokens), against the decode time of a token.

    python benchmarks/grammar_cost.py --out results/bench-grammar-cpu.json    # about 3 minutes on 2 cores
    python benchmarks/grammar_cost.py --quick                                 # a smoke run

Part 1, the demo (a real mlx-lm kimi_k3 with today's chat template, greedy, one process): `--replies` replies of
`--tokens` tokens each way, alternating: free (no grammar), `schema` (tool calls held to the tools' schemas: the
model writes text), `required` (a call to the weather tool must come), `json` (one JSON object). Decode tok/s from
the engine's ReplyDone, and the mask's own time per token (tqbench.runtime.grammar.Constrained.mask_s / masks).

Part 2, K3's vocabulary: a byte-level BPE of 163,840 tokens trained on the standard library with Hugging Face
`tokenizers` (K3's own tokenizer is not available here; the mask's cost depends on the vocabulary's size and shape,
not on the model), llguidance's view of it, and the same grammars fed a long rendered tool call and a JSON document
token by token: microseconds per mask, and with the mask applied to a logits vector of that size in MLX. What that is
of a K3 token is read against decode times measured elsewhere (given with --k3-token-ms).
(On Linux the script re-executes itself with Debian's OpenBLAS preloaded when it exists and LD_PRELOAD is unset.)
"""

from __future__ import annotations

import sys

from harness import add_size_options, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import dump_json, log, machine_info, peak_rss_bytes  # noqa: E402

SCHEMA = "tqbench.bench.grammar/1"
DEFAULTS = dict(replies=3, tokens=96, k3_vocab=163_840, masks=400)
QUICK = dict(replies=1, tokens=16, k3_vocab=20_000, masks=40)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "search_docs", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["query"]}}}]
DOC_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}}}}


def tool_model(work: Path):
    """The demo with today's chat template (it renders tools), loaded as a chat loads it."""
    from tqbench.demo import ensure_demo
    from tqbench.runtime.load import load
    from tqbench.tokenizer import CHAT_TEMPLATE

    model = work / "demo-tools"
    if not model.is_dir():
        shutil.copytree(ensure_demo(), model)
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load(model)


def demo_part(work: Path, replies: int, tokens: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.events import ReplyDone
    from tqbench.runtime import grammar
    from tqbench.runtime.complete import chat_prompt
    from tqbench.runtime.conversation import Sampling, generate

    loaded = tool_model(work)
    prompt = chat_prompt(loaded, [{"role": "user", "content": "What is the weather in Oslo this week? Then "
                                   "search the docs for textwrap."}], TOOLS)
    ways = {"free": None, "schema": grammar.reply_grammar(tools=TOOLS, tool_syntax="schema"),
            "required": grammar.reply_grammar(tools=TOOLS, tool_choice="get_weather"),
            "json": grammar.json_grammar(DOC_SCHEMA)}
    made: list[grammar.Constrained] = []
    around = grammar.Constrained.around

    def keep(*a, **kw):  # the sampler a reply made, for its mask timings
        made.append(around(*a, **kw))
        return made[-1]

    grammar.Constrained.around = keep
    runs: dict[str, list] = {w: [] for w in ways}
    try:
        for r in range(replies + 1):  # the first round warms up (compiles), not counted
            for way, g in (ways.items() if r % 2 else reversed(ways.items())):
                made.clear()
                sampling = Sampling(max_tokens=tokens, temp=0.0, grammar=g)
                done = next(ev for ev in generate(loaded, prompt, make_prompt_cache(loaded.model), sampling, cached=0,
                                                  held=[]) if isinstance(ev, ReplyDone))
                if r:
                    c = made[0] if made else None
                    runs[way].append({"decode_tps": done.decode_tps, "tokens": done.generated_tokens,
                                      "mask_us": c.mask_s / c.masks * 1e6 if c and c.masks else None})
    finally:
        grammar.Constrained.around = around
    out = {}
    base_ms = 1000 / statistics.median(x["decode_tps"] for x in runs["free"])
    for way, rs in runs.items():
        ms = 1000 / statistics.median(x["decode_tps"] for x in rs)
        masks = [x["mask_us"] for x in rs if x["mask_us"] is not None]
        out[way] = {"token_ms": round(ms, 3), "vs_free": round(ms / base_ms, 3), "tokens": [x["tokens"] for x in rs],
                    "mask_us": round(statistics.median(masks), 1) if masks else None,
                    "mask_share": round(statistics.median(masks) / 1000 / ms, 4) if masks else None}
        log(f"demo {way}: {ms:.2f} ms/token ({ms / base_ms:.3f}x free), mask {out[way]['mask_us']} us")
    return {"vocab": 4608, "rows": out, "device": str(__import__("mlx.core").core.default_device())}


def big_tokenizer(work: Path, vocab: int):
    """A byte-level BPE of `vocab` tokens on the standard library (trained once, kept in the work directory)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = work / f"bpe-{vocab}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    t0 = time.time()
    tok.train_from_iterator(texts(), trainer)
    log(f"BPE of {tok.get_vocab_size():,} tokens trained in {time.time() - t0:.0f} s")
    tok.save(str(path))
    return tok


def k3_part(work: Path, vocab: int, masks: int) -> dict:
    import llguidance
    import mlx.core as mx
    import numpy as np

    from tqbench.runtime import grammar

    tok = big_tokenizer(work, vocab)
    n = tok.get_vocab_size()
    eos = tok.token_to_id("<|end_of_msg|>")
    ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=n, eos_token=eos)
    call = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
            'type="string"<|sep|>Oslo, Norway<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>'
            '7<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="search_docs" index="2"<|sep|><|open|>'
            'argument key="query" type="string"<|sep|>textwrap.shorten placeholder width<|close|>argument<|sep|>'
            '<|open|>argument key="tags" type="array"<|sep|>["stdlib", "text", "wrap"]<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|><|end_of_msg|>')
    text = "Sure, let me look that up for you. " * 4
    doc = json.dumps({"title": "The standard library's text modules",
                      "items": [{"name": m, "n": i}
                                for i, m in enumerate(["textwrap", "string", "re", "difflib"] * 4)]})
    feeds = {"schema: text then calls": (grammar.reply_grammar(tools=TOOLS, tool_syntax="schema"), text + call),
             "json": (grammar.json_grammar(DOC_SCHEMA), doc + "<|end_of_msg|>")}
    logits = mx.random.normal((1, n))
    mx.eval(logits)
    out = {}
    for label, (g, feed) in feeds.items():
        ids = tok.encode(feed).ids
        times, apply = [], []
        done = 0
        while done < masks:
            m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(g))
            c = grammar.Constrained(lambda lp: lp, m, n, [eos])
            for i in ids:
                t0 = time.perf_counter()
                allowed = c.allowed()
                t1 = time.perf_counter()
                masked = mx.where(mx.array(allowed), logits, -float("inf"))
                mx.eval(masked)
                t2 = time.perf_counter()
                if not allowed[i] or not m.consume_token(i):
                    raise SystemExit(f"{label}: the grammar refused token {i} ({tok.decode([i])!r})")
                times.append(t1 - t0)
                apply.append(t2 - t1)
                done += 1
        out[label] = {"tokens_fed": len(ids), "masks": done,
                      "mask_us_median": round(statistics.median(times) * 1e6, 1),
                      "mask_us_p90": round(float(np.percentile(times, 90)) * 1e6, 1),
                      "mask_us_max": round(max(times) * 1e6, 1),
                      "apply_us_median": round(statistics.median(apply) * 1e6, 1)}
        log(f"K3 vocab {label}: mask {out[label]['mask_us_median']} us median, {out[label]['mask_us_p90']} p90, "
            f"applied {out[label]['apply_us_median']} us")
    return {"vocab": n, "tokenizer": "byte-level BPE trained on the standard library (tokenizers)", "rows": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("build/bench-grammar"))
    ap.add_argument("--k3-token-ms", type=float, nargs="*", default=[21.3, 252.5],
                    help="K3 decode times per token to read the mask against (default: the H100 K3-shaped resident "
                         "run, and both tiers at full K3's shares)")
    add_size_options(ap, DEFAULTS, QUICK)
    a = ap.parse_args()
    s = sizes(a, DEFAULTS, QUICK)
    a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    demo = demo_part(a.work, s["replies"], s["tokens"])
    k3 = k3_part(a.work, s["k3_vocab"], s["masks"])
    worst = max(r["mask_us_median"] + r["apply_us_median"] for r in k3["rows"].values())
    k3["share_of_k3_token"] = {str(ms): round(worst / 1000 / ms, 4) for ms in a.k3_token_ms}
    result = {"schema": SCHEMA, "sizes": s, "demo": demo, "k3_vocab": k3, "seconds": round(time.time() - t0, 1),
              "peak_rss_bytes": peak_rss_bytes(), "machine": machine_info(a.work)}
    text = dump_json(result)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

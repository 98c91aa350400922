#!/usr/bin/env python3
"""The demo models' evidence (issue 10), for one or more checkpoints in one run, on the same texts:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python scripts/demo_eval.py --model v1=tqbench/demo/checkpoint --model v2=build/demo-train-chat/checkpoint

- perplexity on the held-out split of the standard library's code (`tqbench.demo.is_heldout`, 128-token windows from
  an empty context, as scripts/demo_stats.py), on third-party Python no demo saw (the installed `click` and `diskcache`
  packages' sources) and on the held-out conversations (`training.conversations`, rendered with the chat template);
  per domain too (the top-level package of a file);
- the docstring test: for 30 held-out functions and methods (seeded, at most 4 from one file; none whose docstring
  also appears in a training file), the greedy answer to "What does NAME do?" in the chat template; a win when it
  shares more words (three or more letters, not stopwords) with the true docstring than with the docstring of another
  of the 30 (seeded); also counted without the words of the question (no credit for repeating the name); with
  several models, each paired with the first (wins only one has, exact sign test), and with `--functions` above 30
  (more of the same draw) those pairs also on the test's 30 and on the others apart;
- routing over the same tokens: per MoE layer, the experts covering 50/80/90% of the routings, overall, per source
  and per domain (and the hottest 4% of experts' share and the 80% cover as a share of the experts, the figures real
  models are reported in); consecutive tokens' Jaccard overlap within windows; hot sets (each text's hottest 20% of
  experts) of two halves of one domain's text against those of different domains, and the share of a half's routings
  that a hot set learned on its other half, on the other domains, or on itself (the oracle) would have served.

On a CPU the routed experts are dequantized to float32 first (`--experts float`, the default there: MLX's CPU
gather_mm takes only float32, and the quantized mxfp4 path is about 4x slower); the same weights, with the experts'
products in float32 rather than the quantized kernel's arithmetic (the first demo: held-out perplexity 46.34,
46.36 through the quantized kernel).
Writes a JSON document (--out, default build/demo-eval/eval.json) and prints a summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.harness import dump_json, log
from tqbench.tokenizer import load_encoding
from training.conversations import (
    DocItem,
    build_conversations,
    domain_of,
    mine_stdlib,
    render,
    split_items,
)
from training.corpus import corpus_files, is_heldout, stdlib_root

ROOT = Path(__file__).resolve().parent.parent

WINDOW = 128
THIRD_PARTY = ("click", "diskcache")
TEST_FUNCTIONS = 30  # the docstring test's size (issue 10); --functions asks more of the same draw
SHARES = (0.5, 0.8, 0.9)
HOT_FRACTION = 0.2  # a hot set: the hottest 20% of a layer's experts
MIN_DOMAIN_TOKENS = 2048  # domains with fewer tokens get no per-domain figures (halves of 1,024 at least)
QUESTION = "What does {name} do?"
STOPWORDS = frozenset("""
the and for are was were with that this from not but all any can has have had its into than then them they their
there these those which when where what who will would should could may might must been being does did doing done
also each other some such only own same very just more most over under again once here both few nor too off out
you your our use used uses using return returns returned true false none self cls object value values given
""".split())


# ---- texts ----------------------------------------------------------------------------------------------------------


def third_party_files(packages=THIRD_PARTY) -> list[tuple[str, Path]]:
    """(package, file) for every .py file of the installed `packages`, sorted."""
    out = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"{pkg} is not installed")
        base = Path(list(spec.submodule_search_locations)[0])
        out += [(pkg, f) for f in sorted(base.rglob("*.py"))]
    return out


class Stream:
    """Documents as one token stream, each followed by the eos, with their domains and ends."""

    def __init__(self, docs: list[tuple[str, list[int]]], eos: int | None):
        ids: list[int] = []
        self.domains, self.ends = [], []
        for domain, d in docs:
            ids += d + ([eos] if eos is not None else [])
            self.domains.append(domain)
            self.ends.append(len(ids))
        self.tokens = np.array(ids, dtype=np.int32)

    def segments(self, limit: int) -> dict[str, list[tuple[int, int]]]:
        """domain -> [(start, end)] of its documents, cut at `limit` tokens."""
        out: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for d, end in zip(self.domains, self.ends):
            s, e = min(start, limit), min(end, limit)
            if e > s:
                out.setdefault(d, []).append((s, e))
            start = end
        return out


def code_stream(enc, eos: int, root: Path | None = None) -> Stream:
    root = Path(root or stdlib_root())
    files = [f for f in corpus_files(root) if is_heldout(f)]
    return Stream([(domain_of(f), enc.encode_ordinary((root / f).read_text(encoding="utf-8"))) for f in files], eos)


def third_party_stream(enc, eos: int) -> Stream:
    return Stream([(pkg, enc.encode_ordinary(f.read_text(encoding="utf-8"))) for pkg, f in third_party_files()], eos)


def chat_stream(enc, items: list[DocItem], template: str, seed: int) -> Stream:
    """The held-out conversations (one pass, as prepare builds val_chat.npy), rendered; each ends with its eos."""
    convs = build_conversations(items, seed, passes=1)
    return Stream([(c.domain, enc.encode(render(c.messages, template), allowed_special="all")) for c in convs], None)


# ---- model passes ---------------------------------------------------------------------------------------------------


def load_model(path: Path, experts: str = "auto"):
    """mlx-lm's model and tokenizer of a checkpoint; with `experts` "float" (or "auto" on a CPU) the quantized routed
    experts become float32 SwitchLinears of the same values."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(path))
    if experts == "float" or (experts == "auto" and mx.default_device() == mx.cpu):
        dequantize_experts(model)
    model.eval()
    return model, tok


def dequantize_experts(model) -> int:
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    n = 0
    for _, module in model.named_modules():
        for key, child in list(module.children().items()):
            if isinstance(child, QuantizedSwitchLinear):
                if getattr(child, "global_scale", None) is not None:
                    raise ValueError("experts with a global scale are not supported here")
                w = mx.dequantize(child.weight, child.scales, getattr(child, "biases", None),
                                  group_size=child.group_size, bits=child.bits, mode=child.mode, dtype=mx.float32)
                new = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in child)
                new.weight = w
                if "bias" in child:
                    new.bias = child.bias
                setattr(module, key, new)
                n += 1
    return n


def forward_pass(model, tokens: np.ndarray, window: int = WINDOW, batch: int = 16,
                 limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-token next-token loss (nats, `[n * window]`, position j predicting token j + 1) and the routing trace
    (`[moe layers, n * window, k]` int16) of `tokens` cut into `n` non-overlapping windows from an empty context."""
    import mlx.core as mx
    import mlx.nn as nn

    from training.modelstats import capture_routing, windows

    x, y = windows(tokens, window, limit)
    nll, trace = [], []
    for i in range(0, len(x), batch):
        with capture_routing(model) as calls:
            logits = model(mx.array(x[i:i + batch].astype(np.int32))).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, mx.array(y[i:i + batch].astype(np.int32)), reduction="none")
        mx.eval(loss, *calls)
        nll.append(np.array(loss).reshape(-1))
        layers = np.stack([np.array(c) for c in calls])
        trace.append(layers.reshape(layers.shape[0], -1, layers.shape[-1]))
    return np.concatenate(nll), np.concatenate(trace, axis=1).astype(np.int16)


def loss_summary(nll: np.ndarray) -> dict:
    loss = float(nll.mean()) if len(nll) else float("nan")
    return {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 3), "tokens": int(len(nll))}


def per_domain_loss(nll: np.ndarray, segments: dict[str, list[tuple[int, int]]]) -> dict:
    """Loss per domain, each target token counted in the domain of its document."""
    out = {}
    for d, segs in segments.items():
        parts = [nll[max(s - 1, 0):e - 1] for s, e in segs]
        v = np.concatenate(parts) if parts else np.zeros(0)
        if len(v) >= MIN_DOMAIN_TOKENS:
            out[d] = loss_summary(v)
    return out


# ---- the docstring test ---------------------------------------------------------------------------------------------


def words(text: str) -> set[str]:
    """Lower-case words of three or more letters, stopwords left out."""
    return {w for w in re.findall(r"[a-z]{3,}", text.lower()) if w not in STOPWORDS}


def docstring_win(answer: str, true_doc: str, other_doc: str, exclude: set[str] = frozenset()) -> tuple[bool, int, int]:
    """Whether `answer` shares more words with `true_doc` than with `other_doc` (ties lose); the two overlaps."""
    a = words(answer) - set(exclude)
    t, o = len(a & words(true_doc)), len(a & words(other_doc))
    return t > o, t, o


def pick_functions(items: list[DocItem], train_text: str, n: int = 30, seed: int = 0,
                   per_file: int = 4) -> list[DocItem]:
    """`n` held-out functions and methods (seeded; at most `per_file` from one file, so one big module does not make
    the test; in name order) whose docstring's first 60 characters appear in no training file (so the answer cannot
    come from memorised training text)."""
    cands = sorted((i for i in items if i.kind in ("function", "method") and i.doc[:60] not in train_text),
                   key=lambda i: i.name)
    rng = np.random.default_rng([seed, 30])
    picked: list[DocItem] = []
    taken: Counter[str] = Counter()
    for j in rng.permutation(len(cands)):
        if len(picked) < n and taken[cands[j].file] < per_file:
            picked.append(cands[j])
            taken[cands[j].file] += 1
    return sorted(picked, key=lambda i: i.name)


def selection_functions(items: list[DocItem], train_text: str, n: int = 30, seed: int = 0) -> list[DocItem]:
    """`n` held-out functions and methods that pass the test's rule (docstring in no training file) but that the test
    never asks about at this seed, whatever its size: the test takes at most 4 per file, these are the rest (124 of
    the 197 on Python 3.11). Seeded, in name order; a second, disjoint set for choosing between checkpoints."""
    test = {i.name for i in pick_functions(items, train_text, len(items), seed)}
    rest = sorted((i for i in items if i.kind in ("function", "method") and i.doc[:60] not in train_text
                   and i.name not in test), key=lambda i: i.name)
    order = np.random.default_rng([seed, 32]).permutation(len(rest))[:n]
    return sorted((rest[j] for j in order), key=lambda i: i.name)


def derangement(n: int, seed: int) -> list[int]:
    """A seeded permutation of range(n) with no fixed point (each function gets another one's docstring)."""
    rng = np.random.default_rng([seed, 31])
    while True:
        p = rng.permutation(n)
        if n < 2 or not (p == np.arange(n)).any():
            return p.tolist()


def greedy_answer(model, tok, question: str, max_tokens: int, processors=None) -> str:
    """The model's greedy reply to one user message, in its chat template."""
    from mlx_lm import generate

    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     tokenize=False)
    return generate(model, tok, tok.encode(prompt, add_special_tokens=False), max_tokens=max_tokens,
                    logits_processors=processors)


def docstring_test(model, tok, picked: list[DocItem], seed: int = 0, max_tokens: int = 96,
                   question: str = QUESTION, repetition_penalty: float | None = None) -> dict:
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(repetition_penalty=repetition_penalty) if repetition_penalty else None

    others = derangement(len(picked), seed)
    rows = []
    for item, j in zip(picked, others):
        q = question.format(name=item.name)
        reply = greedy_answer(model, tok, q, max_tokens, processors)
        win, t, o = docstring_win(reply, item.doc, picked[j].doc)
        win_strict, ts, os_ = docstring_win(reply, item.doc, picked[j].doc, exclude=words(q))
        rows.append({"name": item.name, "other": picked[j].name, "answer": reply, "named": item.name in reply,
                     "true_overlap": t,
                     "other_overlap": o, "win": win, "win_without_question_words": win_strict,
                     "true_overlap_without_question_words": ts, "other_overlap_without_question_words": os_})
    n = max(len(rows), 1)
    rate = sum(r["win"] for r in rows) / n
    return {"functions": len(rows), "question": question, "max_tokens": max_tokens,
            **({"repetition_penalty": repetition_penalty} if repetition_penalty else {}),
            "answers_naming_the_function": sum(r["named"] for r in rows),
            "win_rate": round(rate, 4),
            "win_rate_standard_error": round(math.sqrt(rate * (1 - rate) / n), 4),
            "win_rate_without_question_words": round(sum(r["win_without_question_words"] for r in rows) / n, 4),
            "ties": sum(r["true_overlap"] == r["other_overlap"] for r in rows), "rows": rows}


def copy_probe(model, tok, items: list[DocItem], seed: int = 0, max_tokens: int = 32) -> dict:
    """Whether the model copies a name from the question: each of `items` (training functions, whose real names it
    has memorised) asked "What does {name} do?" under its real name and under a made-up module path
    (training.conversations.renamed / pseudo_module, seeded); per answer, whether it writes the asked name, and
    for the made-up ones whether it writes the real name instead (recall rather than copying)."""
    from training.conversations import pseudo_module, renamed

    rng = np.random.default_rng([seed, 33])
    rows = []
    for item in items:
        fake = renamed(item, pseudo_module(rng))
        row = {"name": item.name, "renamed": fake.name}
        for key, asked in (("real", item), ("made_up", fake)):
            reply = greedy_answer(model, tok, QUESTION.format(name=asked.name), max_tokens)
            row[f"{key}_answer"] = reply
            row[f"{key}_named"] = asked.name in reply
        row["made_up_answer_names_the_real_one"] = item.name in row["made_up_answer"]
        rows.append(row)
    n = max(len(rows), 1)
    return {"functions": len(rows), "max_tokens": max_tokens,
            "real_named": round(sum(r["real_named"] for r in rows) / n, 4),
            "made_up_named": round(sum(r["made_up_named"] for r in rows) / n, 4),
            "made_up_answered_with_the_real_name": round(sum(r["made_up_answer_names_the_real_one"] for r in rows) / n,
                                                         4),
            "rows": rows}


def paired_docstring(base: dict, other: dict, names: set[str] | None = None) -> dict:
    """Two models' docstring tests on the same functions (and the same other docstrings): how many each wins that the
    other does not, and the two-sided exact sign test on those (the chance of a split at least this uneven if
    neither model were better). Different numbers of wins on 30 functions are often within chance. `names`: only
    those functions."""
    a = {r["name"]: r["win"] for r in base["rows"]}
    b = {r["name"]: r["win"] for r in other["rows"]}
    if a.keys() != b.keys():
        raise ValueError("paired_docstring: the two tests asked about different functions")
    if names is not None:
        a, b = ({k: v for k, v in d.items() if k in names} for d in (a, b))
    only_base = sum(a[k] and not b[k] for k in a)
    only_other = sum(b[k] and not a[k] for k in a)
    n, low = only_base + only_other, min(only_base, only_other)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2 ** n) if n else 1.0
    return {"functions": len(a), "both": sum(a[k] and b[k] for k in a), "neither": sum(not a[k] and not b[k] for k in a),
            "only_base": only_base, "only_other": only_other, "sign_test_p": round(p, 4)}


# ---- routing --------------------------------------------------------------------------------------------------------


def covering(counts: np.ndarray, share: float) -> int:
    from training.modelstats import experts_covering

    return experts_covering(counts, share)


def skew_row(counts: np.ndarray) -> dict:
    """One layer's counts: experts for 50/80/90%, the 80% cover as a share of the experts, the hottest 4%'s share."""
    E = len(counts)
    share = np.sort(counts)[::-1] / max(counts.sum(), 1)
    return {**{f"experts_for_{round(s * 100)}pct": covering(counts, s) for s in SHARES},
            "cover80_share_of_experts": round(covering(counts, 0.8) / E, 4),
            "hottest4pct_share": round(float(share[: math.ceil(0.04 * E)].sum()), 4),
            "unused": int((counts == 0).sum())}


def window_jaccard(trace: np.ndarray, window: int) -> np.ndarray:
    """Per layer, the mean Jaccard overlap of consecutive tokens' expert sets within windows (a window's first token
    has no predecessor: each window starts from an empty context)."""
    L, n, k = trace.shape
    t = trace[:, : n // window * window].reshape(L, -1, window, k)
    a, b = t[:, :, :-1], t[:, :, 1:]
    inter = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)
    return (inter / (2 * k - inter)).mean(axis=(1, 2))


def hot_set(counts: np.ndarray, size: int) -> set[int]:
    """The `size` hottest experts (ties: the lower id)."""
    return set(np.argsort(-counts, kind="stable")[:size].tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(len(a | b), 1)


def served(counts: np.ndarray, hot: set[int]) -> float:
    """The share of the routings in `counts` that a cache holding `hot` serves."""
    return float(counts[sorted(hot)].sum() / max(counts.sum(), 1))


def domain_counts(trace_layer: np.ndarray, segs: list[tuple[int, int]], E: int, half: int | None = None) -> np.ndarray:
    """Routing counts of one layer over a domain's segments; with `half` 0 or 1, of the first or second half of its
    tokens (in stream order)."""
    rows = np.concatenate([trace_layer[s:e] for s, e in segs]) if segs else np.zeros((0, 1), np.int16)
    if half is not None:
        mid = len(rows) // 2
        rows = rows[:mid] if half == 0 else rows[mid:]
    return np.bincount(rows.reshape(-1), minlength=E)


def hot_set_overlap(trace: np.ndarray, segments: dict[str, list[tuple[int, int]]], E: int,
                    fraction: float = HOT_FRACTION) -> dict:
    """Per layer: the mean Jaccard overlap of the hot sets of two halves of one domain's text, and of two different
    domains' hot sets; and, for a domain's second half, the share of its routings a hot set serves when learned on its
    first half (a per-domain profile), on the other domains (a profile of other text), on itself (the oracle), against
    `fraction` for uniform routing. Domains with fewer than `MIN_DOMAIN_TOKENS` tokens are left out."""
    size = max(1, round(fraction * E))
    doms = sorted(d for d, segs in segments.items() if sum(e - s for s, e in segs) >= MIN_DOMAIN_TOKENS)
    layers = []
    for t in trace:
        whole = {d: domain_counts(t, segments[d], E) for d in doms}
        halves = {d: (domain_counts(t, segments[d], E, 0), domain_counts(t, segments[d], E, 1)) for d in doms}
        within = [jaccard(hot_set(a, size), hot_set(b, size)) for a, b in halves.values()]
        across = [jaccard(hot_set(whole[x], size), hot_set(whole[y], size))
                  for i, x in enumerate(doms) for y in doms[i + 1:]]
        same, other, oracle = [], [], []
        for d in doms:
            first, second = halves[d]
            rest = sum((whole[x] for x in doms if x != d), np.zeros(E, np.int64))
            same.append(served(second, hot_set(first, size)))
            other.append(served(second, hot_set(rest, size)))
            oracle.append(served(second, hot_set(second, size)))
        layers.append({"halves_jaccard": round(float(np.mean(within)), 4) if within else None,
                       "domains_jaccard": round(float(np.mean(across)), 4) if across else None,
                       "served_by_own_first_half": round(float(np.mean(same)), 4) if same else None,
                       "served_by_other_domains": round(float(np.mean(other)), 4) if other else None,
                       "served_by_oracle": round(float(np.mean(oracle)), 4) if oracle else None})
    rng = np.random.default_rng(0)  # two random hot sets of this size
    rand = float(np.mean([jaccard(set(rng.choice(E, size, replace=False).tolist()),
                                  set(rng.choice(E, size, replace=False).tolist())) for _ in range(200)]))
    return {"hot_set_size": size, "domains": doms, "uniform_served": round(size / E, 4),
            "random_sets_jaccard": round(rand, 4), "layers": layers}


def routing_report(trace: np.ndarray, sources: dict[str, tuple[int, int]],
                   segments: dict[str, list[tuple[int, int]]], E: int, layer_ids: list[int], window: int) -> dict:
    """Routing statistics of one model's trace over all evaluated texts (`sources`: name -> (start, end) in the
    trace; `segments`: domain -> its (start, end) pieces)."""
    from training.modelstats import random_jaccard

    k = trace.shape[-1]
    counts = np.stack([np.bincount(t.reshape(-1), minlength=E) for t in trace])
    jac = window_jaccard(trace, window)
    overall = [{"layer": lid, **skew_row(c), "jaccard_consecutive": round(float(j), 4)}
               for lid, c, j in zip(layer_ids, counts, jac)]
    per_source = {}
    for name, (s, e) in sources.items():
        c = np.stack([np.bincount(t[s:e].reshape(-1), minlength=E) for t in trace])
        rows = [skew_row(x) for x in c]
        per_source[name] = {"tokens": e - s, "layers": rows,
                            "jaccard_consecutive": [round(float(v), 4) for v in window_jaccard(trace[:, s:e], window)]}
    per_domain = {}
    for d, segs in sorted(segments.items()):
        n = sum(e - s for s, e in segs)
        if n < MIN_DOMAIN_TOKENS:
            continue
        rows = [skew_row(domain_counts(t, segs, E)) for t in trace]
        per_domain[d] = {"tokens": n, **{key: [r[key] for r in rows] for key in rows[0]}}
    mean_domain = {key: [round(float(np.mean([v[key][i] for v in per_domain.values()])), 3)
                         for i in range(len(trace))]
                   for key in ("experts_for_50pct", "experts_for_80pct", "experts_for_90pct",
                               "cover80_share_of_experts", "hottest4pct_share")} if per_domain else {}
    return {"num_experts": E, "top_k": k, "tokens": int(trace.shape[1]),
            "uniform": {f"experts_for_{round(s * 100)}pct": math.ceil(s * E) for s in SHARES},
            "jaccard_random": round(random_jaccard(E, k), 4),
            "overall": overall, "per_source": per_source, "per_domain_mean": mean_domain, "per_domain": per_domain,
            "hot_sets": hot_set_overlap(trace, segments, E)}


# ---- one model ------------------------------------------------------------------------------------------------------


def evaluate_model(path: Path, a: argparse.Namespace, items: list[DocItem], picked: list[DocItem]) -> dict:
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    eos = config["eos_token_id"]
    E = text["num_experts"]
    enc = load_encoding(path)
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    t0 = time.time()
    model, tok = load_model(path, a.experts)
    log(f"{path}: {E} experts top-{text['num_experts_per_token']}, loaded in {time.time() - t0:.1f} s")

    _, val_items = split_items(items)
    streams = {"heldout_code": code_stream(enc, eos), "third_party": third_party_stream(enc, eos),
               "heldout_chat": chat_stream(enc, val_items, template, a.seed)}
    out: dict = {"path": str(path), "num_experts": E, "top_k": text["num_experts_per_token"],
                 "experts": a.experts, "window": a.window, "perplexity": {}}
    traces, sources, segments, pos = [], {}, {}, 0
    for name, st in streams.items():
        limit = a.limit if a.limit else None
        t0 = time.time()
        nll, trace = forward_pass(model, st.tokens, a.window, a.batch, limit)
        n = len(nll)
        segs = st.segments(n)
        out["perplexity"][name] = {**loss_summary(nll), "per_domain": per_domain_loss(nll, segs)}
        log(f"  {name}: {out['perplexity'][name]['perplexity']} over {n:,} tokens ({time.time() - t0:.0f} s)")
        traces.append(trace)
        sources[name] = (pos, pos + n)
        prefix = "chat:" if name == "heldout_chat" else ""
        for d, ss in segs.items():
            segments.setdefault(prefix + d, []).extend((s + pos, e + pos) for s, e in ss)
        pos += n
    trace = np.concatenate(traces, axis=1)
    layer_ids = [i for i in range(text["num_hidden_layers"]) if i >= text.get("first_k_dense_replace", 0)]
    out["routing"] = routing_report(trace, sources, segments, E, layer_ids, a.window)
    if a.trace_dir:
        a.trace_dir.mkdir(parents=True, exist_ok=True)
        np.save(a.trace_dir / f"{path.name}-routing-trace.npy", trace)
    t0 = time.time()
    out["docstring_test"] = docstring_test(model, tok, picked, a.seed, a.max_tokens, a.question,
                                           a.repetition_penalty)
    log(f"  docstring test: {out['docstring_test']['win_rate']:.0%} wins "
        f"({out['docstring_test']['win_rate_without_question_words']:.0%} without the question's words), "
        f"{out['docstring_test']['answers_naming_the_function']} answers name the function, "
        f"in {time.time() - t0:.0f} s")
    if a.copy_probe:
        t0 = time.time()
        probe = pick_functions(split_items(items)[0], "", a.copy_probe, a.seed)
        c = out["copy_probe"] = copy_probe(model, tok, probe, a.seed)
        log(f"  copy probe ({c['functions']} training functions): the asked name written {c['real_named']:.0%} under "
            f"its real module, {c['made_up_named']:.0%} under a made-up one (the real name instead: "
            f"{c['made_up_answered_with_the_real_name']:.0%}), in {time.time() - t0:.0f} s")
    return out


def summary_lines(name: str, r: dict) -> list[str]:
    p = r["perplexity"]
    ro = r["routing"]
    lines = [f"{name}: perplexity held-out code {p['heldout_code']['perplexity']}, third-party "
             f"{p['third_party']['perplexity']}, held-out chat {p['heldout_chat']['perplexity']}; docstring test "
             f"{r['docstring_test']['win_rate']:.0%} +- {r['docstring_test'].get('win_rate_standard_error', 0):.0%} "
             f"({r['docstring_test']['win_rate_without_question_words']:.0%} without the question's words)"]
    lines.append(f"  experts for 50/80/90% per layer (uniform {ro['uniform']}): " + "; ".join(
        f"{x['experts_for_50pct']}/{x['experts_for_80pct']}/{x['experts_for_90pct']}" for x in ro["overall"]))
    if ro["per_domain_mean"]:
        m = ro["per_domain_mean"]
        lines.append("  per domain (mean over domains): " + "; ".join(
            f"{a}/{b}/{c}" for a, b, c in zip(m["experts_for_50pct"], m["experts_for_80pct"], m["experts_for_90pct"])))
    lines.append(f"  Jaccard consecutive (random {ro['jaccard_random']}): "
                 + " ".join(str(x["jaccard_consecutive"]) for x in ro["overall"]))
    h = ro["hot_sets"]
    lines.append(f"  hot sets ({h['hot_set_size']} experts, {len(h['domains'])} domains; random sets "
                 f"{h['random_sets_jaccard']}): halves / domains Jaccard " + " ".join(
                     f"{x['halves_jaccard']}/{x['domains_jaccard']}" for x in h["layers"]))
    lines.append(f"  served (uniform {h['uniform_served']}) own half / other domains / oracle: " + " ".join(
        f"{x['served_by_own_first_half']}/{x['served_by_other_domains']}/{x['served_by_oracle']}" for x in h["layers"]))
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a checkpoint to measure (repeat to compare several on the same texts)")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "demo-eval" / "eval.json")
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--limit", type=int, default=0, help="windows per text (0: all); for a quick look")
    p.add_argument("--functions", type=int, default=TEST_FUNCTIONS)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="the docstring test's answers with mlx-lm's repetition penalty (still the most likely token "
                        "at each step, after the penalty); default: plain greedy, as the issue's test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=["auto", "float", "quantized"], default="auto",
                   help="auto: float32 experts on a CPU (the same values; MLX's CPU gather_mm is float32-only)")
    p.add_argument("--trace-dir", type=Path, default=None, help="also save each model's routing trace here")
    p.add_argument("--question", default=QUESTION, help="the docstring test's question ({name}: the function)")
    p.add_argument("--copy-probe", type=int, default=0, metavar="N",
                   help="also ask about N training functions under their real and a made-up module path: how often "
                        "the answer copies the asked name (0: not run)")
    p.add_argument("--docstring-items", choices=["heldout", "train", "selection"], default="heldout",
                   help="ask about held-out functions (the test), training ones (a probe of recall), or held-out "
                        "functions the test never asks about (selection: for choosing between checkpoints of one "
                        "run without looking at the test)")
    a = p.parse_args(argv)
    if a.copy_probe < 0:
        raise SystemExit(f"--copy-probe: a number of functions (0: none), not {a.copy_probe}")
    if a.repetition_penalty is not None and a.repetition_penalty <= 0:
        raise SystemExit(f"--repetition-penalty: a positive factor (1.0: none), not {a.repetition_penalty}")

    root = stdlib_root()
    files = corpus_files(root)
    t0 = time.time()
    items = mine_stdlib(root, files)
    train_text = "".join((root / f).read_text(encoding="utf-8") for f in files if not is_heldout(f))
    train_items, val_items = split_items(items)
    if a.docstring_items == "train":  # a recall probe: functions the model was trained on
        picked = pick_functions(train_items, "", a.functions, a.seed)
    elif a.docstring_items == "selection":
        picked = selection_functions(val_items, train_text, a.functions, a.seed)
    else:
        picked = pick_functions(val_items, train_text, a.functions, a.seed)
    log(f"{len(items)} documented items, {len(val_items)} held out; {len(picked)} functions for the docstring test "
        f"({time.time() - t0:.0f} s)")
    results = {}
    for spec in a.model:
        name, _, path = spec.rpartition("=")
        path = Path(path)
        results[name or path.name] = evaluate_model(path, a, items, picked)
    names = list(results)
    paired = {f"{names[0]} vs {n}": paired_docstring(results[names[0]]["docstring_test"], results[n]["docstring_test"])
              for n in names[1:]}
    split = {}
    if a.docstring_items == "heldout" and len(picked) > TEST_FUNCTIONS:
        # More than the test asks: the pairs also on the test's own functions (the first TEST_FUNCTIONS of the same
        # draw) and on the others apart. Earlier choices were made on the test's functions, so a model kept for
        # winning there is favoured there; the others show whether the lead holds where no choice looked.
        test = {i.name for i in pick_functions(val_items, train_text, TEST_FUNCTIONS, a.seed)}
        rest = {i.name for i in picked} - test
        split = {pair: {part: paired_docstring(results[names[0]]["docstring_test"], results[n]["docstring_test"], s)
                        for part, s in (("test", test), ("others", rest))}
                 for pair, n in zip(paired, names[1:])}
    doc = {"schema": "tqbench.demo-eval/1", "python": sys.version.split()[0], "limit_windows": a.limit or None,
           "third_party": {pkg: importlib.util.find_spec(pkg) and _version(pkg) for pkg in THIRD_PARTY},
           "docstring_functions": [i.name for i in picked], "models": results, "docstring_paired": paired,
           "docstring_paired_split": split}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump_json(doc))
    for name, r in results.items():
        for line in summary_lines(name, r):
            print(line)
    for pair, d in paired.items():
        print(f"docstring test, {pair}: {d['only_base']} won by the first only, {d['only_other']} by the second only "
              f"({d['both']} both, {d['neither']} neither); sign test p = {d['sign_test_p']}")
        for part, x in split.get(pair, {}).items():
            label = f"the test's {x['functions']}" if part == "test" else f"the other {x['functions']}"
            print(f"  on {label}: {x['only_base']} to {x['only_other']}; sign test p = {x['sign_test_p']}")
    log(f"wrote {a.out}")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    main()

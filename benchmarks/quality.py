#!/usr/bin/env python3
"""What each recipe costs in quality on the demo model: every recipe kind converted from the shipped demo and
evaluated against it with `tqbench eval`'s engine (tqbench.eval), and the source at fewer active experts against its
native routing. Quality is deterministic on one machine (the timings are not: they are recorded, not compared).

    python benchmarks/quality.py --out bench-results/quality.json            # ~25 min on 2 CPU cores
    python benchmarks/quality.py --quick --out bench-results/quality.json    # 3 recipes, 512 tokens
    python benchmarks/quality.py --recipe tq3-g64 --recipe tq3-g64-cal --recipe tq3-g64-cal@training ...

A `cal` recipe (calibrated rounding) is calibrated on the demo's held-out texts, the texts eval scores (4 of its 16
windows are among the calibration's); `NAME@training` calibrates it on text of the demo's training split instead
(standard-library files and conversations the held-out texts exclude, as much of each kind as the held-out texts
hold), which shows whether the gain is the codes or the overlap.

Per row: the recipe, its bits per weight as `tqbench plan` counts them (every stored byte: codes, scales, biases,
codebooks, signs) over the Linear layers a recipe quantizes (the table's column) and over the whole model, tensor MB, perplexity of the model and of
the source on the same tokens, KL(source || model), top-1 agreement, top-5 overlap and greedy agreement.
Writes JSON (--out) and prints a Markdown table (the README's)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (add_size_options, dump_json, log, machine_info, peak_rss_bytes, sizes,  # noqa: E402
                                with_openblas)

# Every recipe kind, and pairs at equal bits per weight: TurboQuant's codes take b bits (3.2 at 3-bit: ten codes a
# word) plus a float16 scale per group, MLX affine's b bits plus a float16 scale and bias per group, so tq4-g64 and
# affine4-g128 both cost 4.25 bits, tq4-g32 and affine4-g64 4.5; tq3-g64 3.45 against affine3-g64's 3.5. The -rms
# rows are TurboQuant-MLX's scale rule.
RECIPES = ["src", "srca-mxfp4e", "tq4", "tq4-rms", "tq4-g32", "affine4", "affine4-g128", "tq3", "tq3-rms", "tq3-g128",
           "affine3", "affine3-g128", "tq2", "affine2", "tq4a-tqTe", "tq3a-tqTe-down4-g64", "tq4-g64-cal",
           "tq3-g64-cal", "tq3a-tqTe-down4-g64-cal", "tq4-g64-cal@training", "tq3-g64-cal@training",
           "tq3a-tqTe-down4-g64-cal@training"]
TRAINING = "@training"  # a cal recipe calibrated on training-split text (training_text)
LINEARS = ("attention", "dense_mlp", "shared_expert", "routed_expert", "latent_proj", "lm_head")
DEFAULTS = dict(tokens=4096, window=256, prompts=4, generate=32)
QUICK = dict(tokens=512, window=256, prompts=1, generate=8)
QUICK_RECIPES = ["srca-mxfp4e", "tq4", "affine4"]
# (a, b) compared per window: the KL difference a - b with its spread over the windows both scored
PAIRS = [("tq4-g64", "affine4-g128"), ("tq4-g32", "affine4-g64"), ("tq3-g64", "affine3-g64"),
         ("tq3-g128", "affine3-g128"), ("tq4-g64", "tq4-g64-rms"), ("tq3-g64", "tq3-g64-rms"),
         ("tq4-g64-cal", "tq4-g64"), ("tq3-g64-cal", "tq3-g64"), ("tq3a-tqTe-down4-g64-cal", "tq3a-tqTe-down4-g64"),
         ("tq4-g64-cal@training", "tq4-g64"), ("tq3-g64-cal@training", "tq3-g64"),
         ("tq3a-tqTe-down4-g64-cal@training", "tq3a-tqTe-down4-g64"), ("tq3-g64-cal", "affine3-g64")]


def plan_figures(source: Path, recipe: str) -> dict:
    from tqbench.recipe import Recipe, group_sources, make_plan
    from tqbench.source.opening import open_checkpoint

    ckpt = open_checkpoint(source)
    p = make_plan(group_sources(ckpt), Recipe.parse(recipe))
    linears = [r for r in p.by_role if r.role in LINEARS]
    return dict(recipe=p.recipe.name, bits_per_weight=p.bits_per_weight, tensor_bytes=p.total_bytes,
                linear_bits_per_weight=8 * sum(r.bytes for r in linears) / sum(r.params for r in linears),
                kept_modules=sum(k.modules for k in p.kept), kept_bytes=sum(k.bytes for k in p.kept),
                by_role={r.role: r.bits_per_weight for r in p.by_role})


TRAINING_CHARS = 144_000  # the training text's default size: two thirds code, one third chat


def training_text(path: Path, chars: int = TRAINING_CHARS) -> Path:
    """Calibration text from the demo's training split (written once to `path`): standard-library files and
    conversations that scripts/make_eval_texts.py's held-out texts exclude, about `chars` characters, two thirds of
    code and one third of chat (96,000 and 48,000 by default), taken the way it takes its own."""
    if path.is_file():
        return path
    import json as _json

    from tqbench.demo import SHIPPED_DEMO
    from training.conversations import build_conversations, mine_stdlib, render, split_items
    from training.corpus import corpus_files, is_heldout, stdlib_root

    root = stdlib_root()
    files = corpus_files(root)
    code, total = [], 0
    kept = [f for f in files if not is_heldout(f)]
    for f in kept[::7] + [f for i, f in enumerate(kept) if i % 7]:  # every 7th file first, as before
        text = (root / f).read_text(encoding="utf-8")
        if total >= chars * 2 // 3:
            break
        if len(text) <= 32_000:
            code.append(text)
            total += len(text)
    template = _json.loads((SHIPPED_DEMO / "tokenizer_config.json").read_text())["chat_template"]
    train_items, _ = split_items(mine_stdlib(root, files))
    chat, total = [], 0
    for c in build_conversations(train_items, 1, passes=1):
        if total >= chars // 3:
            break
        chat.append(render(c.messages, template))
        total += len(chat[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(code + chat), encoding="utf-8")
    return path


def convert_row(source: Path, name: str, work: Path, tokens: int | None = None,
                chars: int = TRAINING_CHARS) -> tuple[Path, float | None]:
    """The recipe `name` (a recipe name, or a cal recipe's NAME@training) converted into `work`, once: its output and
    the seconds the conversion took (None: converted by an earlier run). `tokens`: a cal recipe's calibration tokens
    (None: the default); `chars`: the training text's size."""
    from tqbench.convert import convert
    from tqbench.convert.calibration_request import DEFAULT_TOKENS, CalibrationRequest
    from tqbench.layout.names import INDEX_FILE
    from tqbench.recipe import Recipe

    recipe_name, _, on = name.partition("@")
    recipe = Recipe.parse(recipe_name)
    tokens = tokens if recipe.calibrate and tokens not in (None, DEFAULT_TOKENS) else None
    more = on == "training" and chars != TRAINING_CHARS
    dest = work / (recipe.name + (f"@{on}" if on else "") + (f"-t{tokens}" if tokens else "")
                   + (f"-c{chars}" if more else ""))
    if (dest / INDEX_FILE).is_file():
        return dest, None
    text = work / (f"training-text-{chars}.txt" if more else "training-text.txt")
    texts = (str(training_text(text, chars)),) if on == "training" else ()
    log(f"converting the demo with {name}")
    t0 = time.perf_counter()
    calibration = CalibrationRequest(texts=texts, tokens=tokens or DEFAULT_TOKENS) if recipe.calibrate else None
    list(convert(source, dest, recipe, calibration=calibration))
    return dest, time.perf_counter() - t0


def evaluate(model: Path, against: Path, size: dict, active: int = 0) -> dict:
    from tqbench.eval import EvalReport, EvalRequest, evaluate as run
    from tqbench.eval.report import report_dict

    req = EvalRequest(model=str(model), against=str(against), tokens=size["tokens"], window=size["window"],
                      prompts=size["prompts"], generate=size["generate"], max_active_experts=active)
    report = [ev for ev in run(req) if isinstance(ev, EvalReport)][-1]
    return report_dict(report)


def row_line(r: dict) -> str:
    t = r["eval"]["total"]
    g = r["eval"]["greedy"]
    bpw = f"{r['plan']['linear_bits_per_weight']:.2f}" if r.get("plan") else ""
    kept = f"{r['plan']['kept_modules']}" if r.get("plan") else ""
    mb = f"{r['plan']['tensor_bytes'] / 1e6:.2f}" if r.get("plan") else ""
    change = t["perplexity"] / t["reference_perplexity"] - 1
    return (f"| `{r['name']}` | {bpw} | {kept} | {mb} | {t['perplexity']:.3f} | {change:+.1%} | {t['kl']:.4f} | "
            f"{t['top1_agreement']:.3f} | {t['top5_overlap']:.3f} | {g['share_alike']:.2f} |")


def paired(rows: list[dict], a: str, b: str) -> dict | None:
    """KL(a) - KL(b) per token, as the mean over the windows both scored, with a 95% interval from the spread of the
    per-window differences (the windows are the same tokens for both, so the text's own variation cancels)."""
    import statistics

    by = {r["name"]: r["eval"] for r in rows}
    if a not in by or b not in by or by[a]["text_sha256"] != by[b]["text_sha256"]:
        return None
    ka = [k for t in by[a]["texts"] for k in t["kl_windows"]]
    kb = [k for t in by[b]["texts"] for k in t["kl_windows"]]
    window = by[a]["window"]
    d = [(x - y) / window for x, y in zip(ka, kb)]
    mean = statistics.fmean(d)
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return dict(a=a, b=b, windows=len(d), kl_a=by[a]["total"]["kl"], kl_b=by[b]["total"]["kl"], difference=mean,
                interval=[mean - half, mean + half], relative=mean / by[b]["total"]["kl"])


def print_tables(rows: list[dict], pairs: list[dict]) -> None:
    print("| recipe | bits/weight (Linears) | kept at source | tensor MB | perplexity | vs source | KL | top-1 agree | "
          "top-5 overlap | greedy alike |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(row_line(r))
    if pairs:
        bpw = {r["name"]: r["plan"]["linear_bits_per_weight"] for r in rows if r.get("plan")}
        print()
        print("| a | b | bits/weight a / b | KL a / b | KL a - b (95% interval over windows) | relative |")
        print("|---|---|---|---|---|---|")
        for p in pairs:
            lo, hi = p["interval"]
            print(f"| `{p['a']}` | `{p['b']}` | {bpw[p['a']]:.2f} / {bpw[p['b']]:.2f} | {p['kl_a']:.4f} / "
                  f"{p['kl_b']:.4f} | {p['difference']:+.4f} ({lo:+.4f} .. {hi:+.4f}) | {p['relative']:+.1%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--recipe", action="append", help="only these recipes (repeat; a cal recipe as NAME@training: "
                                                     "calibrated on training-split text); default: every kind and "
                                                     "the source at fewer experts")
    p.add_argument("--work", type=Path, default=Path("build/quality"), help="conversions go here (kept: reruns "
                                                                             "reuse them)")
    p.add_argument("--out", type=Path, default=Path("bench-results/quality.json"))
    p.add_argument("--calibrate-tokens", type=int, metavar="N", help="cal recipes calibrate on about N tokens "
                                                                      "(rows named NAME (N tokens), compared with "
                                                                      "NAME's uncalibrated recipe)")
    p.add_argument("--training-chars", type=int, default=TRAINING_CHARS, metavar="N",
                   help="NAME@training calibrates on about N characters of training-split text")
    p.add_argument("--no-openblas", action="store_true")
    p.add_argument("--tables", type=Path, metavar="JSON", help="print the tables of an earlier run's JSON and exit")
    a = p.parse_args(argv)
    if a.tables:
        doc = json.loads(a.tables.read_text())
        print_tables(doc["rows"], doc.get("pairs", []))
        return 0
    with_openblas()
    from tqbench.demo import SHIPPED_SPEC, ensure_demo
    from tqbench.recipe import Recipe

    size = sizes(a, DEFAULTS, QUICK)
    recipes = a.recipe or (QUICK_RECIPES if a.quick else RECIPES)
    source = ensure_demo()
    t0 = time.perf_counter()
    rows = []
    for name in recipes:
        recipe_name, at, on = name.partition("@")
        recipe = Recipe.parse(recipe_name)
        label = recipe.name + at + on + (f" ({a.calibrate_tokens} tokens)" if recipe.calibrate and a.calibrate_tokens
                                         else "")
        if on == "training" and a.training_chars != TRAINING_CHARS:
            label = label.replace(at + on, f"{at}{on} ({a.training_chars:,} characters)")
        dest, seconds = convert_row(source, name, a.work, a.calibrate_tokens, a.training_chars)
        log(f"evaluating {label}")
        rows.append(dict(name=label, plan=plan_figures(source, recipe_name), eval=evaluate(dest, source, size),
                         convert_seconds=seconds))
        log(row_line(rows[-1]))
    native = SHIPPED_SPEC.num_experts_per_token
    for k in ([] if a.recipe else [native // 2, native // 4] if not a.quick else [native // 2]):  # full runs only
        log(f"evaluating the source at {k} of {native} experts")
        rows.append(dict(name=f"source, {k} of {native} experts", plan=None, eval=evaluate(source, source, size, k)))
        log(row_line(rows[-1]))
    extra = [(r["name"], r["name"].split("@")[0].split(" (")[0].replace("-cal", "")) for r in rows
             if " tokens)" in r["name"] or " characters)" in r["name"]]
    pairs = [p for p in (paired(rows, x, y) for x, y in PAIRS + extra) if p is not None]
    doc = dict(schema="tqbench.bench.quality/1", command=" ".join(sys.argv), size=size,
               machine=machine_info(a.work, ("tqbench",)), rows=rows, pairs=pairs, seconds=time.perf_counter() - t0,
               peak_rss=peak_rss_bytes())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump_json(doc))
    print_tables(rows, pairs)
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

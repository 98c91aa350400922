"""Make the demo model's shipped hot-expert profile: `profiles/demo-<recipe>.json` (default recipe tq4, the one
`tqbench chat` converts the demo with).

    python scripts/make_demo_profile.py                 # profiles/demo-tq4.json
    python scripts/make_demo_profile.py --recipe tq3 --tokens 96

What it does, all through the engine a `tqbench chat` session uses:
1. converts the demo (`tqbench.demo.ensure_demo()`: the shipped checkpoint, whichever generation it is) with the
   recipe into a temporary directory, as `tqbench chat` does the first time;
2. opens it with learning on (`tqbench.chat.session.ChatSession`, a temporary profile store) and, for every
   held-out file of the demo corpus (`tqbench.demo.is_heldout`: text the model never trained on), sends the file's
   first lines as a plain-text prompt (no chat template) and decodes up to --tokens greedy tokens, starting a new
   conversation for each file; then, in a second session with the chat template, asks --questions "What does NAME
   do?" about held-out functions and methods, one conversation each (the demo is a chat model too: a profile of code
   prompts alone cost chat sessions hits);
3. writes the learned profile (tqbench's schema, keyed by the conversion's fingerprint) with `made_by` recording
   this command and the text.

Rerun it whenever the demo changes (retrained, another spec) or the fingerprint does (a conversion or layout change):
the file is replaced, and until then the stale one is simply never chosen (its fingerprint names another model).
`tests/test_profile.py` checks that a fresh conversion picks the file up as "shipped".
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(max_chars: int, max_lines: int) -> list[tuple[str, str]]:
    """(file, its first lines) for each held-out file of the demo corpus (the running interpreter's stdlib)."""
    from training.corpus import corpus_files, is_heldout, stdlib_root

    root = stdlib_root()
    out = []
    for rel in corpus_files(root):
        if not is_heldout(rel):
            continue
        lines = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)[:max_lines]
        text = "".join(lines)[:max_chars]
        if text.strip():
            out.append((rel, text))
    return out


def questions(n: int) -> list[str]:
    """`n` seeded chat questions about documented functions and methods of the held-out files."""
    import numpy as np

    from training.conversations import mine_stdlib, question
    from training.corpus import corpus_files, is_heldout, stdlib_root

    if n <= 0:
        return []
    root = stdlib_root()
    items = [i for i in mine_stdlib(root, [f for f in corpus_files(root) if is_heldout(f)])
             if i.kind in ("function", "method")]
    pick = np.random.default_rng(0).choice(len(items), min(n, len(items)), replace=False)
    return [question(items[i], "What does {name} do?") for i in sorted(pick)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="tq4", help="Conversion recipe (default tq4, tqbench chat's demo default).")
    ap.add_argument("--tokens", type=int, default=64, help="Greedy tokens decoded per held-out file.")
    ap.add_argument("--lines", type=int, default=40, help="Prompt: a file's first lines ...")
    ap.add_argument("--chars", type=int, default=1500, help="... cut at this many characters.")
    ap.add_argument("--questions", type=int, default=96,
                    help="Then this many chat questions about held-out functions (0: code prompts only).")
    ap.add_argument("--out", type=Path, default=None, help="Output file (default profiles/demo-<recipe>.json).")
    args = ap.parse_args()
    out = args.out or ROOT / "profiles" / f"demo-{args.recipe}.json"

    from tqbench.convert import convert
    from tqbench.atomic import write_bytes
    from tqbench.demo import demo_path, ensure_demo
    from tqbench.chat.request import ChatRequest, ProfileOptions
    from tqbench.chat.session import ChatSession
    from tqbench.profile import ProfileStore, identify
    from tqbench.profile.profile import dumps
    from tqbench.recipe import Recipe
    from tqbench.runtime.conversation import Sampling

    texts = prompts(args.chars, args.lines)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tqbench-demo-profile-") as tmp:
        model = Path(tmp) / f"demo-{args.recipe}"
        list(convert(ensure_demo(), model, Recipe.parse(args.recipe)))
        fp, geo = identify(model)
        store_dir = Path(tmp) / "store"
        session = ChatSession()
        try:
            opts = ProfileOptions(store=str(store_dir), pin_share=0.0)
            with session.open(ChatRequest(model=str(model), chat_template=False, profile=opts)) as job:
                job.result()
            sampling = Sampling(max_tokens=args.tokens)
            for i, (rel, text) in enumerate(texts):
                session.reset()
                with session.reply(text, sampling) as job:
                    done = job.result()[-1]
                print(f"[{i + 1}/{len(texts)}] {rel}: {done.prompt_tokens} prompt tokens, {done.generated_tokens} "
                      f"generated", file=sys.stderr)
            # the demo is a chat model too: a second session (the store decays the first one's counts once, by
            # DECAY) asks about held-out functions in its chat template, one question per conversation
            asked = questions(args.questions)
            if asked:
                with session.open(ChatRequest(model=str(model), chat_template=True, profile=opts)) as job:
                    job.result()
                for i, q in enumerate(asked):
                    session.reset()
                    with session.reply(q, sampling) as job:
                        job.result()
                    if (i + 1) % 16 == 0:
                        print(f"[{i + 1}/{len(asked)}] questions", file=sys.stderr)
        finally:
            session.close()  # the learner's last save
        store = ProfileStore(store_dir)
        p = store.load(fp, geo)
        store.close()
    doc = p.to_dict()
    doc["made_by"] = {
        "command": f"python scripts/make_demo_profile.py --recipe {args.recipe} --tokens {args.tokens} "
                   f"--lines {args.lines} --chars {args.chars} --questions {args.questions}",
        "model": f"{demo_path().name} converted with {args.recipe}",
        "text": f"the first {args.lines} lines (at most {args.chars} characters) of the {len(texts)} held-out files "
                f"of the demo corpus (Python {platform.python_version()}'s standard library), as plain-text "
                f"prompts; then, in a second session, {len(asked)} chat questions 'What does NAME do?' about "
                f"held-out functions and methods; {args.tokens} greedy tokens each",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(out, dumps(doc).encode())
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    print(f"wrote {shown}: fingerprint {fp}, {p.routings:,.0f} routings over {len(texts)} code prompts and "
          f"{len(asked)} questions "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

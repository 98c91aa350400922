#!/usr/bin/env python3
"""The demo's held-out evaluation texts, shipped with tqbench (`tqbench/eval/heldout.jsonl`), so `tqbench eval` has
text no demo model trained on wherever it is installed:

    python scripts/make_eval_texts.py

- code: held-out standard-library files (`training.corpus.is_heldout`: their sha256 puts them outside the training
  split), whole files, taken in sorted order at an even stride until CODE_BYTES;
- chat: the held-out conversations (one pass over the held-out items, seed 0, as `train_demo.py prepare` builds
  its validation conversations), rendered with the demo's chat template, until CHAT_BYTES.

One JSON object per line: {"kind": "code" | "chat", "source": ..., "text": ...}. The files are CPython 3.11.7's
standard library (PSF licence); rerunning on that Python rewrites the file byte for byte."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from training.conversations import build_conversations, mine_stdlib, render, split_items
from training.corpus import corpus_files, is_heldout, stdlib_root

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tqbench" / "eval" / "heldout.jsonl"
CODE_BYTES = 96_000
CHAT_BYTES = 48_000
SEED = 0


def code_docs(root: Path) -> list[dict]:
    files = [f for f in corpus_files(root) if is_heldout(f)]
    texts = {f: (root / f).read_text(encoding="utf-8") for f in files}
    docs, total = [], 0
    order = files[::3] + files[1::3] + files[2::3]  # spread over the alphabet: not only the first packages
    for f in order:
        if total >= CODE_BYTES:
            break
        if len(texts[f]) > CODE_BYTES // 3:  # one long module would be the whole text
            continue
        docs.append(dict(kind="code", source=f"Lib/{f}", text=texts[f]))
        total += len(texts[f])
    return docs


def chat_docs(root: Path) -> list[dict]:
    from tqbench.demo import SHIPPED_DEMO

    template = json.loads((SHIPPED_DEMO / "tokenizer_config.json").read_text())["chat_template"]
    files = corpus_files(root)
    _, val_items = split_items(mine_stdlib(root, files))
    docs, total = [], 0
    for c in build_conversations(val_items, SEED, passes=1):
        if total >= CHAT_BYTES:
            break
        text = render(c.messages, template)
        docs.append(dict(kind="chat", source=f"conversation about {c.domain}", text=text))
        total += len(text)
    return docs


def main() -> None:
    if platform.python_version() != "3.11.7":
        print(f"note: Python {platform.python_version()}, not 3.11.7: the texts will differ from the shipped ones")
    root = stdlib_root()
    docs = code_docs(root) + chat_docs(root)
    OUT.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    for kind in ("code", "chat"):
        part = [d for d in docs if d["kind"] == kind]
        print(f"{kind}: {len(part)} documents, {sum(len(d['text']) for d in part):,} characters")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

"""The shipped demo's training corpus: the Python standard library's own `.py` source, split into training and
held-out files by a hash of each file's relative path (`scripts/train_demo.py` trains on it, `scripts/demo_stats.py`
measures on the held-out part)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

# Skipped besides site-packages: test suites, and generated data rather than code (codec tables, pydoc's topic texts,
# the build's sysconfig data and config directory).
CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                              "pydoc_data"})
HELDOUT_EVERY = 20  # one file in 20 (by a hash of its relative path) is held out for validation


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """The corpus: every `.py` file of the standard library at `root` (default: the running interpreter's) outside
    the skipped directories, as sorted relative POSIX paths."""
    root = Path(root or stdlib_root())
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        dirs = rel.split("/")[:-1]
        if any(d in CORPUS_SKIP_DIRS or d.startswith("config-") for d in dirs) or rel.startswith("_sysconfigdata"):
            continue
        if f.is_file():
            out.append(rel)
    return sorted(out)


TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def test_files(root: Path | None = None) -> list[str]:
    """The standard library's own test suites (`.py` files under a `test`, `tests` or `idle_test` directory outside
    site-packages), sorted, skipping files that are not UTF-8 text (some tests carry deliberately broken encodings):
    more code to train on (`scripts/train_demo.py --code-tests`), never part of the held-out evaluation."""
    root = Path(root or stdlib_root())
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        dirs = rel.split("/")[:-1]
        if not TEST_DIRS & set(dirs) or {"site-packages", "dist-packages"} & set(dirs) or not f.is_file():
            continue
        try:
            f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(rel)
    return sorted(out)


def is_heldout(rel: str) -> bool:
    """Whether a corpus file belongs to the validation split: decided by its relative path alone."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % HELDOUT_EVERY == 0


def encode_files(encoding, root: Path, files: list[str], eos: int) -> np.ndarray:
    """Token ids of `files` (UTF-8 text, in order), each followed by `eos`, as one uint32 stream."""
    ids: list[int] = []
    for rel in files:
        ids += encoding.encode_ordinary((Path(root) / rel).read_text(encoding="utf-8"))
        ids.append(eos)
    return np.array(ids, dtype=np.uint32)

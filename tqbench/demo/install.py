"""The shipped demo checkpoint (trained on the Python standard library, see docs/demo-model.md) and its copy in the user
cache, which is what `tqbench demo` and the TUI open."""

from __future__ import annotations

import shutil
from pathlib import Path

from tqbench.demo.writer import build_atomically
from tqbench.paths import cache_dir

# bump whenever the shipped demo's bytes change: the cached copy is found by this name (7 named a candidate that
# was never shipped)
DEMO_VERSION = 8
SHIPPED_DEMO = Path(__file__).parent / "checkpoint"  # the trained demo checkpoint inside the package


def demo_path() -> Path:
    return cache_dir() / "demo" / f"kimi-k3-demo-v{DEMO_VERSION}"


def ensure_demo(force: bool = False) -> Path:
    """The demo checkpoint in the cache: a copy of the shipped trained one, made first if missing (again if `force`).

    A copy, not the package folder itself, so that the path is writable and stable across reinstalls and tools that
    write next to a checkpoint never touch the installed package (or, in an editable install, the source tree)."""
    path = demo_path()
    if force or not path.is_dir():
        if not (SHIPPED_DEMO / "config.json").is_file():
            raise FileNotFoundError(f"the shipped demo model is missing: {SHIPPED_DEMO}")
        build_atomically(path, lambda tmp: _copy_files(SHIPPED_DEMO, tmp), replace=force)
    return path


def _copy_files(src: Path, dest: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith((".", "__")):
            shutil.copyfile(f, dest / f.name)

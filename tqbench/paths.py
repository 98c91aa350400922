"""Where tqbench keeps its files: the user cache directory and the shipped profiles."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory (`$TQBENCH_CACHE_DIR` overrides it)."""
    if env := os.environ.get("TQBENCH_CACHE_DIR"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "tqbench"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tqbench"


def state_file() -> Path:
    """A small JSON file remembering UI state (the checkpoint opened last)."""
    return cache_dir() / "state.json"


def shipped_profiles() -> Path:
    """The `profiles/` folder: inside an installed wheel, or at the root of a source checkout."""
    installed = Path(__file__).parent / "_profiles"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "profiles"

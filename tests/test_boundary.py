"""One engine: no module under tqbench/ (outside tqbench/cli/) may import textual, rich or typer."""

from __future__ import annotations

import json
import re
import pkgutil
import subprocess
import sys
from pathlib import Path

import tqbench

ROOT = Path(tqbench.__file__).parent


def engine_modules() -> list[str]:
    names = ["tqbench"]
    for m in pkgutil.walk_packages([str(ROOT)], prefix="tqbench."):
        if not m.name.startswith("tqbench.cli") and m.name != "tqbench.__main__":
            names.append(m.name)
    return names


def test_engine_modules_are_found():
    mods = engine_modules()
    assert {"tqbench.source.checkpoint", "tqbench.source.naming", "tqbench.writer", "tqbench.events"} <= set(mods)


def test_engine_never_imports_ui_libraries():
    code = (
        "import importlib, json, sys\n"
        f"for m in {engine_modules()!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in ('textual', 'rich', 'typer'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []


def test_engine_never_imports_the_tui():
    """`tqbench/` imports `tui` in one place only: where the `tqbench` command opens the UI."""
    pattern = re.compile(r"^\s*(import|from)\s+tui\b", re.M)
    importers = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py") if pattern.search(p.read_text()))
    assert importers == ["tqbench/cli/main.py"]


def test_one_engine_thread_module():
    """Both faces run MLX work through tqbench.engine; the TUI keeps no thread machinery of its own."""
    tui = ROOT.parent / "tui"
    assert not (tui / "background.py").exists()
    users = sorted(str(p.relative_to(ROOT.parent)) for p in [*tui.rglob("*.py"), *(ROOT / "cli").rglob("*.py")]
                   if "tqbench.engine" in p.read_text())
    assert "tqbench/cli/convert.py" in users and "tui/screens/convert.py" in users

"""One engine: no module under tqbench/ (outside tqbench/cli/) may import textual, rich or typer."""

from __future__ import annotations

import ast
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
    assert {"tqbench.source.checkpoint", "tqbench.source.naming", "tqbench.shards.writer", "tqbench.events",
            "tqbench.layout.shard_units", "tqbench.engine"} <= set(mods)


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
    assert "tqbench/cli/convert.py" in users and "tui/screens/convert_run.py" in users


def _imports(path: Path) -> set[str]:
    """tqbench modules a file imports (TYPE_CHECKING blocks included: a cycle there is a cycle in the design)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("tqbench")}


def test_no_import_cycles_between_engine_packages():
    """Packages of the engine import each other in one direction only (tqbench.x.* -> tqbench.y.*, never back)."""
    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module.startswith("tqbench.cli"):
            continue
        src = package(module)
        for target in _imports(path):
            dst = package(target)
            if dst != src and dst in {package(m) for m in engine_modules()}:
                edges.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and not seen.add(n) and reaches(n, b, seen)) for n in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if reaches(b, a, set()))
    assert cycles == []


def test_no_import_cycles_inside_a_package():
    """Within one package, modules import each other in one direction only (recipe/files <-> recipe/plan was one)."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if path.name == "__init__.py":
            continue  # a package's __init__ re-exports its modules
        edges[module] = {t for t in _imports(path) if t != module and (ROOT.parent / (t.replace(".", "/") + ".py")).is_file()}

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and not seen.add(n) and reaches(n, b, seen)) for n in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if reaches(b, a, set()))
    assert cycles == []

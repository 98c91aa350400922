"""Rooms stay small: no module of tqbench/ or tui/ over 600 lines, no function (or method) over 100 lines; records
are keyword-only dataclasses and no call passes more than 5 positional arguments."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE_LINES = 600
FUNCTION_LINES = 100
POSITIONAL = 5

# The one exception: the generated kernels' source is one template, read top to bottom.
LONG_FUNCTIONS = {"tqbench/runtime/kernel_source.py:kernel_source"}

# Files being reworked on another branch (the chat path) that are over a limit now, until that work lands: none today.
PENDING: set[str] = set()


def _modules() -> list[Path]:
    return sorted(p for top in ("tqbench", "tui") for p in (ROOT / top).rglob("*.py"))


def _too_long() -> tuple[dict[str, int], dict[str, int]]:
    """Modules over MODULE_LINES and functions over FUNCTION_LINES (`path` and `path:name`), with their lines."""
    modules, functions = {}, {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    functions[f"{rel}:{node.name}"] = lines
    return modules, functions


def test_the_scan_reads_both_trees():
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"tqbench/stream/streamer.py", "tui/app.py", "tqbench/runtime/kernel_source.py"} <= names


def test_no_module_is_over_600_lines():
    modules, _ = _too_long()
    assert {m: n for m, n in modules.items() if m not in PENDING} == {}


def test_no_function_is_over_100_lines():
    _, functions = _too_long()
    allowed = LONG_FUNCTIONS | {f for f in functions if f.split(":")[0] in PENDING}
    assert {f: n for f, n in functions.items() if f not in allowed} == {}


def test_every_exception_is_still_needed():
    """An exception or pending file that fits again leaves its list."""
    modules, functions = _too_long()
    assert LONG_FUNCTIONS <= set(functions)
    assert {p for p in PENDING if p not in modules and not any(f.startswith(p + ":") for f in functions)} == set()


def _trees() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in _modules()}


def test_every_record_is_keyword_only():
    """A dataclass is made by naming its fields: a field added or moved cannot shift a positional construction."""
    def kw_only(dec: ast.expr) -> bool:
        return isinstance(dec, ast.Call) and any(k.arg == "kw_only" and getattr(k.value, "value", None) is True
                                                 for k in dec.keywords)

    records, loose = 0, []
    for rel, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for dec in node.decorator_list:
                    if "dataclass" in ast.unparse(dec.func if isinstance(dec, ast.Call) else dec):
                        records += 1
                        if not kw_only(dec):
                            loose.append(f"{rel}:{node.lineno} {node.name}")
    assert records > 150 and loose == []


def test_no_call_passes_more_than_five_positional_arguments():
    """Past five, a call names its arguments (a starred tuple of cells or columns counts as one)."""
    long = [f"{rel}:{node.lineno} {ast.unparse(node.func)}" for rel, tree in _trees().items()
            for node in ast.walk(tree) if isinstance(node, ast.Call)
            and sum(not isinstance(a, ast.Starred) for a in node.args) > POSITIONAL]
    assert long == []

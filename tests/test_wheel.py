"""The built wheel holds every module and data file, and works outside the source tree."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the wheel and installs it in a fresh venv

ROOT = Path(__file__).resolve().parent.parent
# The code that trained the demo, now the top-level training/ package, and where its modules were before.
TRAINING_MODULES_BEFORE = ("tqbench/modelstats.py", "tqbench/demo/conversations.py", "tqbench/demo/corpus.py",
                           "tqbench/demo/delta.py", "tqbench/demo/flat_adamw.py")


def _package_files() -> set[str]:
    out = set()
    for pkg in ("tqbench", "tui"):
        for p in (ROOT / pkg).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                out.add(str(p.relative_to(ROOT)))
    for p in (ROOT / "profiles").rglob("*"):
        if p.is_file():
            out.add(str(Path("tqbench/_profiles") / p.relative_to(ROOT / "profiles")))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True)
    if done.returncode != 0 and "No module named 'hatchling'" in done.stderr:
        pytest.skip("hatchling is not installed here (the test extra installs it)")
    assert done.returncode == 0, done.stderr
    return next(out.glob("tqbench-*.whl"))


def test_wheel_holds_every_package_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _package_files() - names
    assert not missing, sorted(missing)[:20]


def _imported_packages(source: bytes) -> set[str]:
    """The top-level packages a module's absolute imports name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_wheel_leaves_the_training_code_out(wheel):
    """The demo's training code stays in the repository: the wheel has no training/ and none of its modules' old
    paths, nothing in the wheel imports it, and the wheel still has the shipped checkpoint and what installs it."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    assert (ROOT / "training" / "__init__.py").is_file()
    assert not [n for n in names if n.startswith("training/")]
    assert not names & set(TRAINING_MODULES_BEFORE)
    assert not [n for n in names if n.endswith(".py") and "training" in _imported_packages(archive.read(n))]
    checkpoint = {f.relative_to(ROOT).as_posix() for f in (ROOT / "tqbench" / "demo" / "checkpoint").iterdir()
                  if f.is_file()}
    assert "tqbench/demo/checkpoint/config.json" in checkpoint and checkpoint <= names
    assert {"tqbench/demo/__init__.py", "tqbench/demo/install.py", "tqbench/cli/main.py"} <= names


def test_wheel_stays_under_30_mb(wheel):
    """The shipped demo checkpoint (since demo v4 about 21 MB, 448 experts x 7 layers) is most of the package: the
    wheel and what it installs stay under 30 MB."""
    installed = sum(i.file_size for i in zipfile.ZipFile(wheel).infolist())
    assert wheel.stat().st_size < 30e6 and installed < 30e6


def test_wheel_runs_outside_the_source_tree(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "TQBENCH_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import tqbench, tqbench.paths as p, tui.app; "
            "print(tqbench.__file__); print(p.shipped_profiles())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    module_file, profiles = done.stdout.split()
    assert module_file.startswith(str(site)) and profiles == str(site / "tqbench" / "_profiles")
    demo = subprocess.run([sys.executable, "-m", "tqbench", "demo"], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr
    inspect = subprocess.run([sys.executable, "-m", "tqbench", "inspect", demo.stdout.strip(), "--json"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
    assert inspect.returncode == 0, inspect.stderr
    assert '"model_type": "kimi_k3"' in inspect.stdout


@pytest.mark.skipif(not (ROOT / "profiles" / "demo-tq4.json").is_file(),
                    reason="profiles/demo-tq4.json is not there yet: make it with python scripts/make_demo_profile.py")
def test_wheel_ships_the_demo_profile(wheel, tmp_path):
    """profiles/ lands in the wheel as tqbench/_profiles, and from there a fresh tq4 conversion of the demo picks its
    shipped hot-expert profile (profiles/demo-tq4.json, scripts/make_demo_profile.py)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "TQBENCH_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from tqbench.convert import convert; from tqbench.demo import ensure_demo; "
            "from tqbench.recipe import Recipe; from tqbench.profile import choose; "
            "list(convert(ensure_demo(), sys.argv[1], Recipe.parse('tq4'))); c = choose(sys.argv[1]); "
            "print(c.source, c.where)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tq4")], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["shipped", str(site / "tqbench" / "_profiles" / "demo-tq4.json")]

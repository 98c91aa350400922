"""What `tqbench profile` prints of a profile with more than a thousand experts (a conversion with Kimi K3's 896
experts per layer, 2 MoE layers): every count with thousands separators, in the coverage and diff tables and the
lines of export and merge; the file written named by its absolute path, one that cannot be written as it was
given."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import tqbench
from conftest import converted
from tqbench.demo import DemoSpec
from tqbench.profile import Profile, ProfileStore, identify, summary
from tqbench.profile.report import number


@pytest.fixture(scope="module")
def wide() -> Path:
    """A tq4 conversion with Kimi K3's 896 experts per layer (2 MoE layers), shared with test_tui_profile (read-only)."""
    return converted("tq4", DemoSpec(num_experts=896, num_hidden_layers=3))


def every_expert_routed(model: Path) -> Profile:
    """Seeded counts, every expert routed at least once, two sessions."""
    fp, geo = identify(model)
    rng = np.random.default_rng(1)
    p = Profile.empty(fp, geo)
    for n in geo.layers:
        p.decode[n] = rng.integers(1, 40, geo.experts).astype(float)
        p.prefill[n] = rng.integers(0, 12, geo.experts).astype(float)
    p.routings = float(sum(p.decode[n].sum() + p.prefill[n].sum() for n in geo.layers))
    p.sessions = 2
    store = ProfileStore()
    try:
        store.put(p)
    finally:
        store.close()
    return p


def cells(line: str) -> list[str]:
    return line.split()


def test_coverage_table_counts_have_separators(wide, capsys, monkeypatch):
    p = every_expert_routed(wide)
    s = summary(p, top=2)
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", wide, "--top", "2")
    assert r.code == 0, r.err
    total = next(line for line in r.out.splitlines() if line.lstrip().startswith("all "))
    used = f"{s.experts_used:,}"
    assert s.experts_used == 2 * 896 and used == "1,792"
    assert cells(total)[:7] == ["all", number(s.decode), number(s.prefill), used,
                                *(f"{c.experts:,}" for c in s.coverage)]
    assert any(c.experts >= 1000 for c in s.coverage)  # the 80% and 90% columns need their separator too
    assert "learned (" in r.out and f"{number(p.routings)} routings" in r.out and ", 2 sessions" in r.out
    table = r.out[r.out.index("layer "):]
    assert not re.search(r"(?<![\d,.])\d{4,}", table), table  # no count of 4 digits or more without its comma


def test_diff_export_and_merge_lines(wide, tmp_path, capsys, monkeypatch):
    p = every_expert_routed(wide)
    monkeypatch.chdir(tmp_path)
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", wide, "-o", "a.json")
    pins = len(p.ranked())
    assert pins == 1792
    assert (r.code, r.out) == (0, "")
    assert r.err == (f"wrote {tmp_path / 'a.json'}: the learned profile of {wide} ({number(p.routings)} routings, "
                     f"2 sessions, 1,792 ranked pins)\n")
    # A directory that is not there: the file as given (not the temporary file beside it), nothing written.
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", wide, "-o", "missing/a.json")
    assert (r.code, r.err) == (1, "tqbench: error: missing: no such directory\n")
    r = tqbench(capsys, monkeypatch, "profile", "merge", "a.json", "a.json", "-o", "sub/../c.json")
    assert (r.code, r.err) == (1, "tqbench: error: sub/..: no such directory\n")
    (tmp_path / "adir").mkdir()
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", wide, "-o", "adir")
    assert (r.code, r.err) == (1, "tqbench: error: adir: this is a directory; give a file\n")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.json", "adir"] and not any((tmp_path / "adir").iterdir())
    r = tqbench(capsys, monkeypatch, "profile", "merge", "a.json", "a.json", "-o", "c.json")
    assert r.err == (f"wrote {tmp_path / 'c.json'}: 1 x a.json ({number(p.routings)} routings) + 1 x a.json "
                     f"({number(p.routings)}) = {number(2 * p.routings)} routings\n")
    r = tqbench(capsys, monkeypatch, "profile", "diff", "a.json", "c.json")
    assert r.code == 0, r.err
    total = next(line for line in r.out.splitlines() if line.lstrip().startswith("all "))
    hot = sum(p.coverage(n, 0.8) for n in p.geometry.layers)
    assert hot >= 1000 and cells(total)[:4] == ["all", f"{hot:,}", f"{hot:,}", f"{hot:,}"]

"""benchmarks/grammar_cost.py --quick: every way ran on the real demo and the K3-sized vocabulary's grammars took
every token fed to them (the script stops otherwise); the shares it writes are its own timings divided as it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_run_writes_what_it_measured(tmp_path):
    out = tmp_path / "g.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grammar_cost.py"), "--quick", "--work",
                        str(tmp_path / "w"), "--out", str(out), "--k3-token-ms", "20", "200"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    rows = d["demo"]["rows"]
    assert set(rows) == {"free", "schema", "required", "json"} and rows["free"]["mask_us"] is None
    for way in ("schema", "required", "json"):
        r = rows[way]
        assert r["mask_us"] > 0 and r["mask_share"] == pytest.approx(r["mask_us"] / 1000 / r["token_ms"], rel=0.02)
    assert rows["required"]["tokens"][0] > 10  # a call was forced: more than a few tokens of it
    k3 = d["k3_vocab"]
    assert k3["vocab"] == 20_000 and set(k3["rows"]) == {"schema: text then calls", "json"}
    worst = max(r["mask_us_median"] + r["apply_us_median"] for r in k3["rows"].values())
    assert k3["share_of_k3_token"] == {"20.0": round(worst / 1000 / 20, 4), "200.0": round(worst / 1000 / 200, 4)}
    assert all(r["masks"] >= 40 and r["tokens_fed"] > 20 for r in k3["rows"].values())

"""benchmarks/quality.py's paired comparison: the per-window KL difference of two recipes scored on the same windows."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from conftest import load_script

quality = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "quality.py")


def row(name: str, kl_windows: list[float], digest: str = "d", window: int = 4) -> dict:
    tokens = window * len(kl_windows)
    return {"name": name, "eval": {"text_sha256": digest, "window": window,
                                   "total": {"kl": sum(kl_windows) / tokens},
                                   "texts": [{"kl_windows": kl_windows[:2]}, {"kl_windows": kl_windows[2:]}]}}


def test_paired_difference_and_interval():
    a, b = [1.0, 2.0, 3.0, 6.0], [2.0, 2.0, 4.0, 4.0]
    p = quality.paired([row("a", a), row("b", b)], "a", "b")
    d = [(x - y) / 4 for x, y in zip(a, b)]  # per token, window by window
    assert p["windows"] == 4 and p["difference"] == pytest.approx(statistics.fmean(d)) == pytest.approx(-0.0)
    half = 1.96 * statistics.stdev(d) / 2
    assert p["interval"] == pytest.approx([-half, half])
    assert (p["kl_a"], p["kl_b"]) == (12 / 16, 12 / 16)


def test_pairs_on_different_tokens_are_not_compared():
    assert quality.paired([row("a", [1.0, 2.0], "x"), row("b", [1.0, 2.0], "y")], "a", "b") is None
    assert quality.paired([row("a", [1.0, 2.0])], "a", "b") is None

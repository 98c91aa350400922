"""benchmarks/cache_routing.py's comparison at equal bytes: the K curve interpolated at a margin's misses per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_script

bench = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "cache_routing.py")


def k_row(k: int, misses: float, kl: float, ppl: float) -> dict:
    return dict(k=k, misses_per_token=misses, kl=kl, ppl_increase=ppl)


CURVE = [k_row(8, 40.0, 0.0, 0.0), k_row(6, 30.0, 0.1, 0.02), k_row(4, 20.0, 0.3, 0.1)]


def test_the_k_curve_is_interpolated_at_the_same_misses():
    got = bench.at_equal_bytes(dict(misses_per_token=25.0), CURVE[::-1])  # any order
    assert got == pytest.approx(dict(k=5.0, kl=0.2, ppl_increase=0.06))
    assert bench.at_equal_bytes(dict(misses_per_token=40.0), CURVE) == pytest.approx(dict(k=8, kl=0, ppl_increase=0))


def test_misses_outside_the_curve_have_no_counterpart():
    assert bench.at_equal_bytes(dict(misses_per_token=19.9), CURVE) is None
    assert bench.at_equal_bytes(dict(misses_per_token=41.0), CURVE) is None

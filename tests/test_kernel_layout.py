"""Kernel layouts per backend (tqbench.runtime.kernel_layout): the register estimate against ptxas's counts on the
H200, the H200's layouts kept on CUDA, and Metal's within Apple's register budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tqbench.runtime import kernel_layout as L
from tqbench.runtime import kernels as K
from tqbench.runtime.kernel_source import offset_type

K3_SHAPES = [(7168, 4096), (4096, 7168), (3072, 3584), (3584, 3072), (3072, 7168), (7168, 3072)]  # (out, in)


@pytest.mark.parametrize("levels,measured", L.MEASURED_CUDA_REGISTERS)
def test_estimate_is_within_10_percent_of_ptxas_on_the_h200(levels, measured) -> None:
    spec = K.make_spec(levels, 64, 4096, 7168, 1, 1, False)
    assert abs(L.registers(spec, "cuda") - measured) <= 0.1 * measured


def test_cuda_keeps_the_h200_layouts_at_every_batch() -> None:
    for levels in (3, 4, 8, 16):
        for out, n in K3_SHAPES:
            for batch in range(1, 5):
                assert L.choose_layout(levels, n, out, batch=batch) == L.cuda_layout(levels, n)
            assert L.kernel_batch(levels, n, out, 384) == 4


def test_h200_layouts_would_spill_on_an_apple_gpu() -> None:
    """What the issue estimated: 4-bit at 2-4 rows of x in the H200's layout holds ~150-190 registers."""
    got = [L.registers(K.make_spec(16, 64, 4096, 7168, 1, b, False), "cuda") for b in range(1, 5)]
    assert got == [128, 150, 172, 194]


@pytest.mark.parametrize("levels", [3, 4, 8, 16])
def test_metal_layouts_fit_the_register_budget(levels) -> None:
    for out, n in K3_SHAPES:
        for experts, gather in ((1, False), (384, True)):
            top = L.kernel_batch(levels, n, out, experts, "metal")
            for batch in range(1, top + 1):
                spec = K.make_spec(levels, 64, n, out, experts, batch, gather, xdiv=1 if gather else 0,
                                   backend="metal")
                assert L.registers(spec, "metal") <= L.METAL_REGISTER_BUDGET < 128
                assert offset_type(spec, "metal") == "tq_u32"  # K3's tensors all fit 32-bit offsets
    # at one row of x Metal keeps the H200's layout; ternary takes at most 3 rows of x a launch there
    assert L.choose_layout(levels, 4096, 7168, batch=1, backend="metal") == L.cuda_layout(levels, 4096)
    assert L.kernel_batch(levels, 4096, 7168, 1, "metal") == (3 if levels == 3 else 4)


def test_metal_4_bit_takes_fewer_rows_per_lane_from_two_rows_of_x() -> None:
    assert L.choose_layout(16, 4096, 7168, batch=1, backend="metal")["rows"] == 8
    assert L.choose_layout(16, 4096, 7168, batch=2, backend="metal")["rows"] == 4
    assert [s.batch for s in K.matmul_specs(8, 3, 64, 4096, 7168, "float16", "float16", "metal")] == [3, 3, 2]
    assert [s.batch for s in K.matmul_specs(8, 3, 64, 4096, 7168, "float16", "float16")] == [4, 4]


RECORD = Path(__file__).resolve().parent.parent / "results" / "kernel-registers-sm90.json"


def test_recorded_ptxas_run_matches_today_s_layouts_and_backs_metal_s_choice() -> None:
    """scripts/kernel_registers.py's run (ptxas for sm_90, each kernel also capped at 128 registers as on an Apple
    GPU): its layouts and estimates are today's; Metal's layouts spill nothing at 128 registers but ternary's few bytes
    (its mulhi step: docs/metal.md), while the H200's layouts spill 8-248 bytes exactly where Metal chose otherwise
    (2- and 4-bit at 3-4 rows of x, ternary at 4)."""
    rec = json.loads(RECORD.read_text())
    seen = set()
    for r in rec["rows"]:
        backend = "metal" if r["variant"] == "metal" else "cuda"
        spec = K.make_spec(r["levels"], 64, rec["n"], rec["out"], 1, r["batch"], False, backend=backend,
                           wide=r["variant"] == "h200")
        assert (spec.rows, spec.lanes, spec.tiles, spec.prefetch) == (r["rows"], r["lanes"], r["tiles"], r["prefetch"])
        assert L.registers(spec, backend) == r["estimate"]
        if backend == "metal":
            assert r["spill_bytes_at_128"] <= (16 if r["levels"] == 3 else 0), r
        seen.add((r["levels"], r["batch"], r["variant"]))
    for levels in (3, 4, 8, 16):
        top = L.kernel_batch(levels, rec["n"], rec["out"], 1, "metal")
        assert {b for lv, b, v in seen if lv == levels and v == "metal"} == set(range(1, top + 1))
    spilled = {(r["levels"], r["batch"]) for r in rec["rows"] if r["variant"] == "h200" and r["spill_bytes_at_128"]}
    assert spilled == {(4, 3), (4, 4), (16, 3), (16, 4), (3, 4)}

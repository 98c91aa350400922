"""Recipes: names <-> flags, normalisation, invalid combinations; and the role rules."""

from __future__ import annotations

import itertools

import pytest

from tqbench.errors import ExitCode, TqbenchError
from tqbench.recipe.recipe import Format, Recipe, RecipeError
from tqbench.recipe.rules import choose
from tqbench.source.naming import classify

CANONICAL = [
    "tq3a-tqTe-down4-g64", "tq3a-tqTe-down3-g64", "tq3a-tqTe-down2-g64", "tq3a-tqTe-g64", "tq3a-tqTe-g64-mlpg128",
    "tq3a-tq2e-g64", "tq3-g64", "tq4-g32", "tq2-g128", "tq4-tq3a-tqTe-g64", "tq4-tq2a-g64", "tq3a-down4-g64",
    "tq3a-mxfp4e-g64", "tq4a-srce-g64", "affine4-g64", "affine8a-tq4e-g64", "affine4a-tqTe-down4-g32",
    "affine6-affine4a-g128", "tq3a-affine2e-down8-g64", "src", "srca-tqTe-g64", "srca-tq4e-g64", "srca-mxfp4e",
    "tq3-g64-norot", "tq3-g64-seed7", "tq2a-tqTe-down4-g32-mlpg64-norot-seed1234", "tq3-g64-mlpg128",
    "tq3-g64-cal", "tq3a-tqTe-down4-g64-cal", "tq4-g64-rms-cal", "affine4a-tqTe-down4-g32-cal",
]


@pytest.mark.parametrize("name", CANONICAL)
def test_canonical_names_round_trip(name: str) -> None:
    r = Recipe.parse(name)
    assert r.name == name
    assert Recipe.parse(r.name) == r


def test_the_k3_build_name_is_its_flags() -> None:
    by_flags = Recipe.from_flags(bits=3, group_size=64, ternary_experts=True, expert_down_bits=4)
    assert by_flags == Recipe.parse("tq3a-tqTe-down4-g64")
    assert by_flags.name == "tq3a-tqTe-down4-g64"
    assert (by_flags.bits, by_flags.attention_bits, by_flags.group_size, by_flags.expert_group_size) == (3, 3, 64, 64)
    assert by_flags.ternary_experts and by_flags.expert_down_bits == 4
    assert by_flags.rotation and by_flags.seed == 42


@pytest.mark.parametrize("alias,canonical", [
    ("tqTe-down3-g64", "tq3a-tqTe-down3-g64"),  # no base part: tq3
    ("tqTe-mlpg128-g64", "tq3a-tqTe-g64-mlpg128"),
    ("tq2e-g64", "tq3a-tq2e-g64"),
    ("g64-down4-tqTe-tq3a", "tq3a-tqTe-down4-g64"),  # any order
    ("TQ3A-TQTE-DOWN4-G64", "tq3a-tqTe-down4-g64"),  # any case
    ("tq3a-tqTe-down4", "tq3a-tqTe-down4-g64"),  # group 64 by default
    ("tq3", "tq3-g64"),
    ("tq3-tqTe", "tq3a-tqTe-g64"),
    ("tq3-tq3a-tq3e-g64-mlpg64-seed42", "tq3-g64"),  # everything restated at its default
    ("tq4-tq4e-down4", "tq4-g64"),
    ("affine4-affine4e", "affine4-g64"),
    ("src-srce", "src"),
    ("tq4e", "tq3a-tq4e-g64"),
])
def test_aliases_normalise(alias: str, canonical: str) -> None:
    assert Recipe.parse(alias) == Recipe.parse(canonical)
    assert Recipe.parse(alias).name == canonical


def test_every_valid_flag_combination_round_trips() -> None:
    """Recipe -> name -> Recipe over a grid of flags; invalid combinations raise RecipeError, nothing else."""
    valid = 0
    grid = itertools.product(
        (2, 3, 4, 8), (32, 64, 128), (None, 2, 4), (None, 2, 3, 6), (False, True), (None, 2, 4), (None, 128),
        (True, False), ("turboquant", "affine", "source"), (None, "turboquant", "affine", "mxfp4", "source"))
    for bits, g, attn, mlp, ternary, down, mlpg, rot, fmt, efmt in grid:
        try:
            r = Recipe.from_flags(bits=bits, group_size=g, attn_bits=attn, mlp_bits=mlp, ternary_experts=ternary,
                                  expert_down_bits=down, mlp_group_size=mlpg, rotation=rot, format=fmt,
                                  expert_format=efmt)
        except RecipeError:
            continue
        valid += 1
        assert Recipe.parse(r.name) == r, r
        assert Recipe.parse(r.name).name == r.name
    assert valid > 500


def test_equal_meaning_is_equal_value() -> None:
    assert Recipe(bits=3, attn_bits=3, mlp_bits=3, mlp_group_size=64) == Recipe()
    assert Recipe(ternary_experts=True, mlp_bits=3) == Recipe(ternary_experts=True)
    assert Recipe(format=Format.AFFINE, bits=4, expert_format=Format.AFFINE) == Recipe(format=Format.AFFINE, bits=4)
    # with a source base tier, `bits` only matters as the experts' width: it moves there
    src = Recipe.from_flags(bits=4, format="source", expert_format="turboquant")
    assert (src.bits, src.expert_bits) == (3, 4) and src.name == "srca-tq4e-g64"


def test_calibration_is_a_part_and_a_flag() -> None:
    """`cal` (`--calibrate`) changes the codes only: the same tiers, and the name records it in any order."""
    r = Recipe.parse("cal-tq3a-g64-tqTe-down4")
    assert r.calibrate and r.name == "tq3a-tqTe-down4-g64-cal" and r.to_dict()["calibrate"] is True
    assert r == Recipe.from_flags(bits=3, group_size=64, ternary_experts=True, expert_down_bits=4, calibrate=True)
    plain = Recipe.parse("tq3a-tqTe-down4-g64")
    assert not plain.calibrate and "calibrate" not in plain.to_dict()  # a plain recipe's record is as before `cal`
    assert {k: v for k, v in r.to_dict().items() if k not in ("name", "calibrate")} == \
        {k: v for k, v in plain.to_dict().items() if k not in ("name", "calibrate")}


def test_effective_values() -> None:
    r = Recipe.parse("tq4-tq2a-tq3e-down4-g32-mlpg128")
    assert (r.bits, r.attention_bits, r.expert_bits, r.expert_down_bits) == (4, 2, 3, 4)
    assert (r.group_size, r.expert_group_size) == (32, 128)
    assert r.experts_format is Format.TURBOQUANT and r.uses_turboquant and r.quantizes
    d = r.to_dict()
    assert d["name"] == r.name and d["attn_bits"] == 2 and d["mlp_bits"] == 3 and d["mlp_group_size"] == 128
    assert Recipe.parse("tq3a-tqTe-g64").to_dict()["mlp_bits"] is None  # ternary has no bit width
    assert Recipe.parse("src").to_dict()["group_size"] is None


@pytest.mark.parametrize("name,message", [
    ("tq5", "bits 5 is out of range for turboquant"),
    ("tq1", "bits 1 is out of range for turboquant"),
    ("affine7", "bits 7 is out of range for affine"),
    ("tq3a-affine4e-down5", None),  # affine experts may take 5-bit down projections: valid
    ("tq3-tq5a", "attention bits 5"),
    ("affine4-tqTe-tq2e", "both set the expert tier"),
    ("affine4e-tqTe", "both set the expert tier"),
    ("tq3-g48", "group size 48 is not one of 32, 64, 128"),
    ("tq3-g256", "group size 256"),
    ("tq3-mlpg16", "expert group size 16"),
    ("tq3-bogus", "unknown part 'bogus'"),
    ("tq3--g64", "empty part"),
    ("", "empty recipe name"),
    ("tq3-tq4", "both set the base tier"),
    ("tq3-g64-g32", "both set the group size"),
    ("tq3a-affine4a", "both set the attention tier"),
    ("tq4-affine3a", "the attention part must use the base format"),
    ("src-srca", "`src` and `srca` both given"),
    ("src-g128", "nothing is quantized"),
    ("affine4-norot", "no tier uses TurboQuant"),
    ("affine4-seed3", "no tier uses TurboQuant"),
    ("tq3a-mxfp4e-down4", "routed experts are copied as mxfp4"),
    ("tq3a-srce-mlpg128", "routed experts are kept at source precision"),
    ("tq3a-affine4e-down3", None),
    ("tq3a-tqTe-down5", "expert down bits 5 is out of range for turboquant"),
    ("affine4-tqTe-seed99999999999", "seed must be in"),
    ("affine4-cal", "calibrated rounding (cal) given, but no tier uses TurboQuant"),
    ("tq3-cal-cal", "both set the calibration"),
])
def test_invalid_names_give_one_line_errors(name: str, message: str | None) -> None:
    if message is None:
        Recipe.parse(name)
        return
    with pytest.raises(RecipeError) as e:
        Recipe.parse(name)
    text = str(e.value)
    assert message in text and "\n" not in text
    assert isinstance(e.value, TqbenchError) and e.value.exit_code == ExitCode.BAD_INPUT


@pytest.mark.parametrize("flags,message", [
    (dict(ternary_experts=True, expert_format="affine"), "ternary experts are a TurboQuant codebook"),
    (dict(ternary_experts=True, mlp_bits=2), "contradict"),
    (dict(bits=9), "bits 9 is out of range"),
    (dict(bits=8), "bits 8 is out of range for turboquant"),
    (dict(format="affine", bits=8, expert_format="turboquant"), "expert bits 8 is out of range for turboquant"),
    (dict(format="bogus"), "unknown format 'bogus'"),
    (dict(format="mxfp4"), "routed experts only"),
    (dict(format="source", bits=4), "no tier uses them"),
    (dict(format="source", attn_bits=3, expert_format="turboquant"), "base tier is kept at source precision"),
    (dict(group_size=100), "group size 100"),
    (dict(format="affine", rotation=False), "no tier uses TurboQuant"),
    (dict(expert_format="mxfp4", mlp_bits=2), "copied as mxfp4"),
])
def test_invalid_flags(flags: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        Recipe.from_flags(**flags)


# --- rules ---------------------------------------------------------------------------------------------------------

K3 = "language_model.model.layers.5."
MOE = K3 + "block_sparse_moe."


def _choose(recipe: str, name: str, shape: tuple[int, int] | None, fmt: str = "bf16"):
    return choose(Recipe.parse(recipe), classify(name), shape, fmt)


@pytest.mark.parametrize("name,shape,reason", [
    ("language_model.model.embed_tokens.weight", (163840, 7168), "embedding"),
    (K3 + "input_layernorm.weight", None, "norm"),
    (MOE + "gate.weight", (896, 7168), "router"),
    (MOE + "gate.e_score_correction_bias", None, "router"),
    (K3 + "self_attention_res_proj.weight", (1, 7168), "AttnRes"),
    (K3 + "self_attn.q_conv1d.weight", None, "not a Linear"),
    (K3 + "self_attn.A_log", None, "not a Linear"),
    (K3 + "self_attn.kv_b_proj.weight", (24576, 512), "MLA kv_b_proj"),
    (K3 + "self_attn.b_proj.weight", (24, 7168), "dimension < 32"),
    (K3 + "self_attn.f_b_proj.weight", (12288, 96), "in % 64 != 0"),
])
def test_kept_at_source(name: str, shape, reason: str) -> None:
    c = _choose("tq3a-tqTe-down4-g64", name, shape)
    assert c.format is Format.SOURCE and c.reason == reason and not c.quantized


def test_tiers_of_the_k3_build() -> None:
    r = "tq4-tq3a-tqTe-down4-g64-mlpg128"
    attn = _choose(r, K3 + "self_attn.q_proj.weight", (12288, 7168))
    assert (attn.format, attn.bits, attn.group_size, attn.tier) == (Format.TURBOQUANT, 3, 64, "attention")
    for base in (MOE + "shared_experts.gate_proj.weight", MOE + "routed_expert_down_proj.weight",
                 "language_model.lm_head.weight", "language_model.model.layers.0.mlp.down_proj.weight"):
        c = _choose(r, base, (7168, 6144))
        assert (c.bits, c.ternary, c.group_size, c.tier) == (4, False, 64, "base"), base  # never the expert tier
    gate = _choose(r, MOE + "experts.7.w1.weight_packed", (3072, 3584), "mxfp4")
    assert (gate.ternary, gate.bits, gate.group_size, gate.tier) == (True, None, 128, "experts")
    down = _choose(r, MOE + "experts.7.w2.weight_packed", (3584, 3072), "mxfp4")
    assert (down.ternary, down.bits, down.group_size, down.tier) == (False, 4, 128, "expert down")
    assert gate.label == "ternary g128" and down.label == "tq4 g128" and attn.label == "tq3 g64"


def test_expert_bits_and_formats() -> None:
    up = MOE + "experts.0.w3.weight"
    assert _choose("tq4-tq2e-g64", up, (3072, 3584)).bits == 2
    assert _choose("tq4-g64", up, (3072, 3584)).bits == 4
    affine = _choose("tq3a-affine4e-down8-g64", MOE + "experts.0.w2.weight", (3584, 3072))
    assert (affine.format, affine.bits) == (Format.AFFINE, 8)
    assert _choose("tq3a-mxfp4e-g64", up, (3072, 3584), "mxfp4").format is Format.MXFP4
    assert _choose("tq3a-srce-g64", up, (3072, 3584), "mxfp4").reason == "recipe"
    assert _choose("src", K3 + "self_attn.q_proj.weight", (12288, 7168)).reason == "recipe"
    # a group that does not divide the experts' width keeps them at source precision (the plan lists it)
    assert _choose("tq3a-tqTe-g64", up, (3072, 96), "mxfp4").reason == "in % 64 != 0"
    assert _choose("tq3a-tqTe-g32", up, (3072, 96), "mxfp4").ternary


def test_recipes_that_cannot_apply_to_a_source() -> None:
    with pytest.raises(RecipeError, match="mxfp4e copies mxfp4 experts"):
        _choose("tq3a-mxfp4e-g64", MOE + "experts.0.w1.weight", (3072, 3584), "bf16")
    with pytest.raises(RecipeError, match="cannot re-quantize"):
        _choose("tq3-g64", K3 + "self_attn.q_proj.weight", (12288, 7168), "mlx-affine")
    # keeping an already-quantized tensor is fine
    assert _choose("src", K3 + "self_attn.q_proj.weight", (12288, 7168), "mlx-affine").format is Format.SOURCE

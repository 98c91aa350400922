"""The exact size preview on Kimi K3's real layout (header-only skeleton), against the published figures and against
sizes derived by hand from the reference formulas; and `tqbench plan` through Typer's CliRunner on a small model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tqbench.cli.plan import plan as plan_command
from tqbench.machine import GB, machine
from tqbench.recipe.fit import assess
from tqbench.recipe.plan import Sources, group_sources, make_plan
from tqbench.recipe.recipe import Format, Recipe
from tqbench.skeleton import K3_TEXT_CONFIG, k3_config, k3_tensor_specs, write_skeleton
from tqbench.source import open_checkpoint

GiB = 2**30
K3_BUILD = "tq3a-tqTe-down4-g64"


def tq(out: int, inp: int, bits: int | str, g: int = 64) -> int:
    """One TurboQuant Linear with its per-layer extras, from the reference formulas."""
    w, codebook = (20, 3) if bits == "T" else (32 // bits, 2**bits)
    return out * (4 * math.ceil(inp / w) + 2 * inp // g) + 2 * inp + 2 * codebook


@pytest.fixture(scope="module")
def k3(k3_skeleton: Path) -> Sources:
    """Kimi K3's full source layout (conftest's session skeleton: sparse, header-only shards), opened and grouped
    once for this module (~8 s)."""
    return group_sources(open_checkpoint(k3_skeleton))


@pytest.fixture(scope="module")
def k3_build(k3: Sources):
    return make_plan(k3, Recipe.parse(K3_BUILD))


@pytest.mark.slow
def test_k3_expert_page_is_the_published_one(k3_build) -> None:
    e = k3_build.experts
    page = e.page_by_projection
    assert page["gate"] + page["up"] == 2 * 3072 * (4 * 180 + 2 * 56) == 5_111_808
    assert page["down"] == 3584 * (4 * 384 + 2 * 48) == 5_849_088
    assert e.bytes_per_expert == 10_960_896 and e.uniform
    assert (e.moe_layers, e.experts_per_layer, e.expert_layers, e.top_k) == (92, 896, 82_432, 16)


@pytest.mark.slow
def test_k3_totals_of_the_published_build(k3_build) -> None:
    p = k3_build
    assert p.streamed_bytes == 82_432 * 10_960_896
    assert round(p.streamed_bytes / GB, 2) == 903.53
    assert 27.7 <= p.resident_bytes / GB < 27.8  # published: ~27.7 GB
    assert round(p.total_bytes / GiB) == 867  # published: 931.26 GB = 867 GiB
    assert round(p.total_bytes / GB, 2) == 931.30  # see the next test for the published 931.26
    assert p.shard_size == 5 * GiB and p.layout == "streaming"
    # Per-expert units pack shards as tightly as possible: ceil(total / 5 GiB).
    assert p.shards == math.ceil(p.total_bytes / (5 * GiB)) == 174


@pytest.mark.slow
def test_k3_stacked_layout_gives_the_published_shard_count(k3) -> None:
    """The seed's mlx-lm layout (one stacked tensor per layer and projection) splits into the published 186."""
    p = make_plan(k3, Recipe.parse(K3_BUILD), layout="stacked")
    assert p.shards == 186 and round(p.total_bytes / GB, 2) == 931.30


@pytest.mark.slow
def test_k3_published_total_leaves_out_vectors_and_conv_kernels(k3_build) -> None:
    """The published 931.26 GB is our total less 36 MB of 1-D and 3-D tensors: norms, AttnRes, the KDA conv kernels,
    A_log / dt_bias and the routers' e_score_correction_bias. Every other tensor agrees to the byte (next test)."""
    kept = {k.reason: k.bytes for k in k3_build.kept}
    small = kept["norm"] + kept["AttnRes"] + kept["not a Linear"] + 92 * 896 * 4
    assert round(small / 1e6) == 36
    assert round((k3_build.total_bytes - small) / GB, 2) == 931.26
    assert round((k3_build.resident_bytes - small) / GB, 2) == 27.73


@pytest.mark.slow
def test_k3_resident_bytes_by_hand(k3_build) -> None:
    """Every non-expert tensor of K3 at tq3a-tqTe-down4-g64, from docs/kimi-k3.md shapes and the reference formulas."""
    H, P, bf16, f32 = 7168, 12288, 2, 4
    embed = 163840 * H * bf16
    lm_head = tq(163840, H, 3)
    per_layer = 4 * H * bf16 + 2 * H * bf16  # four norms, two AttnRes projections [1, 7168]
    kda = (4 * tq(P, H, 3) + 3 * P * 4 * bf16 + tq(128, H, 3) + tq(P, 128, 3) + tq(96, H, 3) + 2 * P * f32
           + 128 * bf16 + tq(H, P, 3))
    mla = (tq(1536, H, 3) + 1536 * bf16 + tq(18432, 1536, 3) + tq(576, H, 3) + 512 * bf16
           + 24576 * 512 * bf16 + tq(P, H, 3) + tq(H, P, 3))  # kv_b_proj kept in bf16
    dense = 2 * tq(33792, H, 3) + tq(H, 33792, 3)
    moe = (896 * H * bf16 + 896 * f32 + tq(3584, H, 3) + tq(H, 3584, 3) + 3584 * bf16
           + 2 * tq(6144, H, 3) + tq(H, 6144, 3)
           + 2 * (2 * 3584 + 2 * 3) + 2 * 3072 + 2 * 16)  # the experts' per-layer signs and codebooks
    final = 3 * H * bf16  # output AttnRes projection and norm, model.norm
    expected = embed + lm_head + 93 * per_layer + 69 * kda + 24 * mla + dense + 92 * moe + final
    assert k3_build.resident_bytes == expected
    kept = {k.reason: (k.modules, k.bytes) for k in k3_build.kept}
    assert kept["MLA kv_b_proj"] == (24, 24 * 24576 * 512 * bf16)
    assert kept["embedding"] == (1, embed)
    assert kept["router"] == (92, 92 * (896 * H * bf16 + 896 * f32))


@pytest.mark.slow
@pytest.mark.parametrize("name,page,published", [
    ("tqTe-down3-g64", 2 * 3072 * (4 * 180 + 112) + 3584 * (4 * 308 + 96), 813.7),
    ("tqTe-down2-g64", 2 * 3072 * (4 * 180 + 112) + 3584 * (4 * 192 + 96), 676.6),
    ("tqTe-g64", 2 * 3072 * (4 * 180 + 112) + 3584 * (4 * 154 + 96), 631.7),
    ("tqTe-mlpg128-g64", 2 * 3072 * (4 * 180 + 56) + 3584 * (4 * 154 + 48), 589.2),
    ("tq2e-g64", 2 * 3072 * (4 * 224 + 112) + 3584 * (4 * 192 + 96), 765.8),
])
def test_k3_expert_tiers_of_other_recipes(k3: Sources, k3_build, name: str, page: int, published: float) -> None:
    p = make_plan(k3, Recipe.parse(name))
    assert p.experts.bytes_per_expert == page
    assert p.streamed_bytes == 82_432 * page
    assert round(p.streamed_bytes / GB, 1) == published
    # the expert tier touches nothing else: only the down projections' codebooks differ (3 entries, not 16)
    if name in ("tqTe-g64", "tqTe-mlpg128-g64"):
        assert p.resident_bytes == k3_build.resident_bytes - 92 * 2 * (16 - 3)
    if name == "tqTe-mlpg128-g64":
        assert round(p.total_bytes / GB) == 617  # published: ~617 GB total, the cheapest recipe


@pytest.mark.slow
def test_k3_outputs_of_one_source_tensor(k3_build) -> None:
    m = k3_build.module_for("language_model.model.layers.5.block_sparse_moe.experts.17.w2.weight_packed")
    assert m.name == "language_model.model.layers.5.block_sparse_moe.switch_mlp.down_proj"
    assert m.choice.label == "tq4 g64" and m.source.experts == 896 and m.source.shape == (3584, 3072)
    assert [(o.name.rpartition(".")[2], o.dtype, o.shape, o.streamed) for o in m.outputs] == [
        ("weight", "U32", (896, 3584, 384), True), ("scales", "F16", (896, 3584, 48), True),
        ("codebook", "F16", (16,), False), ("signs", "F16", (3072,), False)]
    assert len(m.source.tensors) == 2 * 896
    q = k3_build.module_for("language_model.model.layers.3.self_attn.q_a_proj.weight")  # an MLA layer
    assert [(o.name, o.dtype, o.shape) for o in q.outputs] == [
        ("language_model.model.layers.3.self_attn.q_a_proj.weight", "U32", (1536, 717)),
        ("language_model.model.layers.3.self_attn.q_a_proj.scales", "F16", (1536, 112)),
        ("language_model.model.layers.3.self_attn.q_a_proj.codebook", "F16", (8,)),
        ("language_model.model.layers.3.self_attn.q_a_proj.signs", "F16", (7168,))]
    assert [m.name for m in k3_build.select("*layers.7.*experts.*.w3.weight_scale")] == [
        "language_model.model.layers.7.block_sparse_moe.switch_mlp.up_proj"]


@pytest.mark.slow
def test_k3_bits_per_weight(k3_build) -> None:
    roles = {r.role: r for r in k3_build.by_role}
    expert = roles["routed_expert"]
    assert expert.params == 82_432 * 3 * 3584 * 3072  # 2.72 T
    assert expert.bits_per_weight == pytest.approx(10_960_896 * 8 / (3 * 3584 * 3072), rel=1e-5)
    assert roles["embedding"].bits_per_weight == 16.0
    assert roles["lm_head"].bytes == tq(163840, 7168, 3)
    assert k3_build.bits_per_weight == pytest.approx(k3_build.total_bytes * 8 / k3_build.params)


@pytest.mark.slow
def test_k3_mxfp4_passthrough_copies_the_source_bytes(k3: Sources) -> None:
    p = make_plan(k3, Recipe.parse("tq3a-mxfp4e-g64"))
    source_experts = sum(m.source.source_bytes for m in p.modules if m.role.value == "routed_expert")
    assert p.streamed_bytes == source_experts == 82_432 * 3 * (3072 * 1792 + 3072 * 112)
    gate = p.module_for("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    assert gate.choice.format is Format.MXFP4
    assert [(o.name.rpartition(".")[2], o.dtype, o.shape) for o in gate.outputs] == [
        ("weight", "U32", (896, 3072, 448)), ("scales", "U8", (896, 3072, 112))]


# --- a small Kimi-K3-architecture model ------------------------------------------------------------------------------

SMALL = dict(
    K3_TEXT_CONFIG, hidden_size=256, num_hidden_layers=4, vocab_size=512, intermediate_size=384,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
    moe_intermediate_size=96, routed_expert_hidden_size=128,
    linear_attn_config=dict(K3_TEXT_CONFIG["linear_attn_config"], num_heads=4, head_dim=32, kda_layers=[1, 2, 3],
                            full_attn_layers=[4]))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return write_skeleton(tmp_path_factory.mktemp("small") / "tiny-k3", k3_config(SMALL), k3_tensor_specs(SMALL),
                          shard_size=400_000)


def test_indivisible_linears_stay_at_source_and_are_counted(small: Path) -> None:
    """The experts' down_proj has in = 96: kept (as mxfp4 bytes) at g64, quantized at g32; listed either way."""
    sources = group_sources(open_checkpoint(small))
    g64 = make_plan(sources, Recipe.parse("tq3a-tqTe-g64"))
    down = g64.module_for("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed")
    assert down.choice.reason == "in % 64 != 0"
    assert [(o.name.rpartition(".")[2], o.dtype, o.shape) for o in down.outputs] == [
        ("weight", "U32", (8, 128, 12)), ("scales", "U8", (8, 128, 3))]
    gate_page = 96 * (4 * math.ceil(128 / 20) + 2 * 128 // 64)  # ternary (96, 128)
    assert g64.experts.page_by_projection == {"gate": gate_page, "up": gate_page, "down": 128 * (48 + 3)}
    assert any("switch_mlp.down_proj stays at source precision (in % 64 != 0)" in w for w in g64.warnings)
    kept = {k.reason: k for k in g64.kept}
    assert kept["in % 64 != 0"].bytes >= 3 * 8 * 128 * 51  # three MoE layers of kept down projections
    g32 = make_plan(sources, Recipe.parse("tq3a-tqTe-g32"))
    down32 = g32.module_for("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed")
    assert down32.choice.label == "ternary g32"
    assert g32.experts.page_by_projection["down"] == 128 * (4 * math.ceil(96 / 20) + 2 * 96 // 32)
    assert not any("stays at source" in w for w in g32.warnings)


@pytest.mark.parametrize("variant,changes", [
    ("tq4a-tqTe-down4-g32", "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"),
    ("tq3-tq2a-tqTe-down4-g32", "language_model.model.layers.1.self_attn.q_proj.weight"),
    ("tq3a-tqTe-down2-g32", "language_model.model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight"),
    ("tq3a-tq2e-down4-g32", "language_model.model.layers.1.block_sparse_moe.switch_mlp.up_proj.weight"),
    ("tq3a-tqTe-down4-g32-mlpg64", "language_model.model.layers.1.block_sparse_moe.switch_mlp.gate_proj.scales"),
    ("tq3a-tqTe-down4-g64", "language_model.model.layers.1.self_attn.q_proj.scales"),
    ("tq3a-affine4e-g32", "language_model.model.layers.1.block_sparse_moe.switch_mlp.up_proj.biases"),
    ("affine4a-tqTe-down4-g32", "language_model.model.layers.1.self_attn.q_proj.biases"),
    ("tq3a-mxfp4e-g32", "language_model.model.layers.1.block_sparse_moe.switch_mlp.up_proj.weight"),
])
def test_every_size_flag_changes_the_tensors_it_names(small: Path, variant: str, changes: str) -> None:
    """Lesson from the seed system (flags accepted and ignored): each flag must change the tensor it governs."""
    sources = group_sources(open_checkpoint(small))
    base = {t.name: t for m in make_plan(sources, Recipe.parse("tq3a-tqTe-down4-g32")).modules for t in m.outputs}
    other = {t.name: t for m in make_plan(sources, Recipe.parse(variant)).modules for t in m.outputs}
    assert base.get(changes) != other.get(changes)
    same_size = make_plan(sources, Recipe.parse("tq3a-tqTe-down4-g32-norot-seed7"))
    assert {t.name: t for m in same_size.modules for t in m.outputs} == base  # rotation changes values, not sizes


def test_dense_model_by_hand(tmp_path: Path) -> None:
    """A Llama-style dense model: no expert tier, and a down_proj (in = 352) that g64 does not divide."""
    from tqbench.shards import TensorSpec

    H, I, V = 128, 352, 256
    specs = [TensorSpec(name="model.embed_tokens.weight", dtype="BF16", shape=(V, H))]
    for i in range(2):
        p = f"model.layers.{i}."
        specs += [TensorSpec(name=p + "input_layernorm.weight", dtype="BF16", shape=(H,)),
                  TensorSpec(name=p + "post_attention_layernorm.weight", dtype="BF16", shape=(H,))]
        specs += [TensorSpec(name=p + f"self_attn.{x}_proj.weight", dtype="BF16", shape=(o, H))
                  for x, o in (("q", H), ("k", 64), ("v", 64), ("o", H))]
        specs += [TensorSpec(name=p + "mlp.gate_proj.weight", dtype="BF16",
                             shape=(I, H)), TensorSpec(name=p + "mlp.up_proj.weight", dtype="BF16",
                  shape=(I, H)), TensorSpec(name=p + "mlp.down_proj.weight", dtype="BF16", shape=(H, I))]
    specs += [TensorSpec(name="model.norm.weight", dtype="BF16",
                         shape=(H,)), TensorSpec(name="lm_head.weight", dtype="BF16", shape=(V, H))]
    config = {"model_type": "llama", "hidden_size": H, "num_hidden_layers": 2, "vocab_size": V}
    ckpt = open_checkpoint(write_skeleton(tmp_path / "dense", config, specs))
    p = make_plan(group_sources(ckpt), Recipe.parse("tq3a-tq2e-g64"))
    layer = 2 * H * 2 + tq(H, H, 3) + 2 * tq(64, H, 3) + tq(H, H, 3) + 2 * tq(I, H, 3) + H * I * 2  # down kept
    assert p.total_bytes == V * H * 2 + 2 * layer + H * 2 + tq(V, H, 3) == 386_768
    assert p.streamed_bytes == 0 and p.experts is None
    assert {k.reason: k.modules for k in p.kept}["in % 64 != 0"] == 2
    assert p.warnings == ("recipe tq3a-tq2e-g64 sets an expert tier, but the model has no routed experts",)
    f = assess(p.footprint, machine(4 * 10**9, platform="linux"))
    assert f.verdict.value == "resident" and f.cache_budget_bytes is None and f.bytes_per_token == 0
    assert assess(p.footprint, machine(3 * 10**9, platform="linux")).verdict.value == "does not fit"  # the reserve
    g32 = make_plan(group_sources(ckpt), Recipe.parse("tq3-g32"))
    down = g32.module_for("model.layers.1.mlp.down_proj.weight")
    assert down.choice.label == "tq3 g32" and down.bytes == tq(H, I, 3, 32)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(plan_command)
    return app


def _run(*args: str):
    return CliRunner().invoke(_app(), [str(a) for a in args])


def test_cli_json_equals_the_engine(small: Path) -> None:
    r = _run(small, "--recipe", K3_BUILD, "-r", "tq2e-g32", "--memory", "64GB", "--platform", "linux",
             "--disk-gbps", "1.5", "--hit-rate", "0.25", "--shard-size", "200000", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == "tqbench.plan/1" and doc["model_type"] == "kimi_k3"
    assert doc["machine"]["memory_bytes"] == 64 * 10**9 and doc["machine"]["disk_bytes_per_s"] == 1.5e9
    sources = group_sources(open_checkpoint(small))
    m = machine(64 * 10**9, platform="linux", disk_bytes_per_s=1.5e9)
    assert [p["recipe"]["name"] for p in doc["plans"]] == [K3_BUILD, "tq3a-tq2e-g32"]
    for entry, name in zip(doc["plans"], (K3_BUILD, "tq2e-g32")):
        p = make_plan(sources, Recipe.parse(name), 200_000)
        f = assess(p.footprint, m, hit_rate=0.25)
        assert entry["bytes"] == {"total": p.total_bytes, "resident": p.resident_bytes,
                                  "streamed": p.streamed_bytes, "source": p.source_bytes}
        assert entry["shards"] == {"count": p.shards, "shard_size": 200_000, "layout": "streaming"}
        assert entry["experts"]["bytes_per_expert"] == p.experts.bytes_per_expert
        assert entry["fit"] == json.loads(json.dumps(f.to_dict()))
        assert entry["fit"]["verdict"] == "resident"


def test_cli_table(small: Path) -> None:
    r = _run(small, "-r", K3_BUILD, "-r", "tqTe-mlpg128-g64", "--memory", "64GiB", "--disk-gbps", "2",
             "--platform", "linux")
    assert r.exit_code == 0, r.output
    sources = group_sources(open_checkpoint(small))
    p = make_plan(sources, Recipe.parse(K3_BUILD))
    out = " ".join(r.stdout.split())
    assert K3_BUILD in r.stdout and "tq3a-tqTe-g64-mlpg12" in r.stdout
    for needle in ("resident", "routed experts", "total", "bits/weight", "expert page", "shards", "verdict",
                   "cache budget", "GiB", "GB"):
        assert needle in out
    from tqbench import units
    assert units.gb(p.total_bytes) in out and units.gib(p.total_bytes) in out


def test_cli_flags_make_a_recipe(small: Path) -> None:
    r = _run(small, "--bits", "3", "-g", "64", "--ternary-experts", "--expert-down-bits", "4", "--json",
             "--disk-gbps", "1", "--memory", "16GB")
    assert r.exit_code == 0, r.output
    assert [p["recipe"]["name"] for p in json.loads(r.stdout)["plans"]] == [K3_BUILD]
    r = _run(small, "-r", "tq4-g64", "--mlp-bits", "2", "--no-rotation", "--json", "--disk-gbps", "1")
    assert [p["recipe"]["name"] for p in json.loads(r.stdout)["plans"]] == ["tq4-g64", "tq3a-tq2e-g64-norot"]
    r = _run(small, "--json", "--disk-gbps", "1")
    assert [p["recipe"]["name"] for p in json.loads(r.stdout)["plans"]] == ["tq3-g64"]


def test_cli_tensors(small: Path) -> None:
    r = _run(small, "-r", K3_BUILD, "--tensors", "*layers.2.*experts.*.w1.*", "--json", "--disk-gbps", "1")
    assert r.exit_code == 0, r.output
    (mod,) = json.loads(r.stdout)["plans"][0]["tensors"]
    assert mod["module"] == "language_model.model.layers.2.block_sparse_moe.switch_mlp.gate_proj"
    assert mod["choice"] == "ternary g64" and mod["experts"] == 8 and len(mod["sources"]) == 16
    assert [(o["name"].rpartition(".")[2], o["shape"]) for o in mod["outputs"]] == [
        ("weight", [8, 96, 7]), ("scales", [8, 96, 2]), ("codebook", [3]), ("signs", [128])]
    r = CliRunner().invoke(_app(), [str(small), "-r", K3_BUILD, "--tensors", "*layers.2.*experts.*.w1.*",
                                    "--disk-gbps", "1"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    for o in mod["outputs"]:
        assert o["name"] in r.stdout


@pytest.mark.parametrize("args,message", [
    (["-r", "tq3a-tqTe-affine4e"], "tqbench: error: recipe 'tq3a-tqTe-affine4e': 'affine4e' and 'tqTe' both set"),
    (["-r", "tq9"], "tqbench: error: recipe 'tq9': bits 9 is out of range for turboquant"),
    (["--ternary-experts", "--expert-format", "affine"], "tqbench: error: ternary experts are a TurboQuant codebook"),
    (["-r", "tq3", "--memory", "12XB"], "tqbench: error: cannot read '12XB' as a size"),
])
def test_cli_bad_input_is_one_line_exit_1(small: Path, args: list[str], message: str) -> None:
    r = _run(small, *args)
    assert r.exit_code == 1
    assert r.stdout == ""
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1


def test_cli_incomplete_checkpoint_exits_3(small: Path, tmp_path: Path) -> None:
    import shutil

    copy = shutil.copytree(small, tmp_path / "partial")
    shards = sorted(copy.glob("*.safetensors"))
    shards[-2].unlink()
    r = _run(copy, "-r", K3_BUILD, "--json", "--disk-gbps", "1")
    assert r.exit_code == 3
    assert "incomplete checkpoint" in r.stderr
    assert any("incomplete checkpoint" in w for w in json.loads(r.stdout)["plans"][0]["warnings"])


def test_unit_sizes_are_the_units(tmp_path) -> None:
    """The fast shard count (unit_sizes) and the units convert writes agree, in both layouts and with kept experts."""
    from tqbench.demo import DemoSpec, write_source
    from tqbench.layout.shard_units import file_units, unit_sizes

    src = write_source(tmp_path / "demo", DemoSpec(), seed=0)
    sources = group_sources(open_checkpoint(src))
    for name in ("tq3a-tqTe-down4-g32", "tq3a-mxfp4e-g64", "tq4-g64"):
        for layout in ("streaming", "stacked"):
            p = make_plan(sources, Recipe.parse(name), 100_000, layout)
            units = file_units(p.modules, layout)
            assert list(unit_sizes(p.modules, layout)) == [u.nbytes for u in units]
            assert sum(u.nbytes for u in units) == p.total_bytes
            experts = [u for u in units if u.expert is not None]
            assert len(experts) == (3 * 16 if layout == "streaming" else 0)

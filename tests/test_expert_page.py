"""One expert's bytes are one number: `inspect` of a converted output, `tqbench plan` and the output's expert map
agree on the page a runtime reads per expert (its own weights and scales), and the per-layer TurboQuant codebooks
and signs, shared by a layer's experts, are no part of it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import converted as shared_conversion
from conftest import demo_source
from tqbench.demo import DemoSpec
from tqbench.recipe import Recipe, group_sources, make_plan
from tqbench.skeleton import write_skeleton
from tqbench.source import open_checkpoint, summarize
from tqbench.shards.header import read_header
from tqbench.shards import TensorSpec

# Experts narrower than the sign vectors (16 experts, 64- and 128-wide projections), as in Kimi K3 (896 vs 3072).
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)
PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


@pytest.fixture(scope="module")
def converted() -> tuple[Path, Path]:
    """The source and its conversion, shared with other modules (read-only)."""
    return demo_source(SPEC), shared_conversion("tq3a-tqTe-down4-g64", SPEC, 150_000)


def test_inspect_plan_and_expert_map_agree(converted):
    src, dst = converted
    s = summarize(open_checkpoint(dst)).experts
    plan = make_plan(group_sources(open_checkpoint(src)), Recipe.parse("tq3a-tqTe-down4-g64"))
    # Straight from the shard headers: expert 0 of the first MoE layer, by projection.
    first = min(int(layer) for layer in json.loads((dst / "expert_map.json").read_text())["layers"])
    prefix = f"language_model.model.layers.{first}.block_sparse_moe.experts.0."
    by_proj: Counter[str] = Counter()
    for f in dst.glob("*.safetensors"):
        for t in read_header(f).tensors:
            if t.name.startswith(prefix):
                by_proj[PROJ[t.name[len(prefix):].split(".")[0]]] += t.nbytes
    expert_map = json.loads((dst / "expert_map.json").read_text())["layers"][str(first)]
    assert s.bytes_per_expert == sum(by_proj.values()) == expert_map["length"] == plan.experts.bytes_per_expert
    assert s.bytes_by_projection == dict(by_proj) == plan.experts.page_by_projection
    assert (s.experts_per_layer, s.moe_layers) == (SPEC.num_experts, plan.experts.moe_layers)
    assert s.expert_layers == plan.experts.expert_layers == SPEC.num_experts * s.moe_layers  # not the signs' width
    # The role total still holds everything routed: the pages plus the per-layer codebooks and signs.
    tables = sum(t.nbytes for f in dst.glob("*.safetensors") for t in read_header(f).tensors
                 if "switch_mlp" in t.name and t.name.endswith((".codebook", ".signs")))
    assert tables > 0 and s.routed_bytes == plan.streamed_bytes + tables


def test_stacked_layout_leaves_the_per_layer_tables_out(tmp_path):
    """MLX's stacked layout: weights and scales carry a leading expert axis; a sign vector as long as the expert count
    is still per layer."""
    E, out, inp = 64, 32, 64
    layer = "model.layers.0.mlp.switch_mlp."
    specs = [TensorSpec(name="model.layers.0.mlp.gate.weight", dtype="BF16", shape=(E, inp))]
    for proj, (o, i) in (("gate_proj", (out, inp)), ("up_proj", (out, inp)), ("down_proj", (inp, out))):
        specs += [TensorSpec(name=f"{layer}{proj}.weight", dtype="U32", shape=(E, o, i * 3 // 32)),
                  TensorSpec(name=f"{layer}{proj}.scales", dtype="F16", shape=(E, o, i // 32)),
                  TensorSpec(name=f"{layer}{proj}.codebook", dtype="F16", shape=(8,)),
                  TensorSpec(name=f"{layer}{proj}.signs", dtype="F16", shape=(i,))]
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 1,
              "hidden_size": inp}
    s = summarize(open_checkpoint(write_skeleton(tmp_path / "stacked", config, specs))).experts
    page = {"gate": out * (inp * 3 // 32 * 4 + inp // 32 * 2), "up": out * (inp * 3 // 32 * 4 + inp // 32 * 2),
            "down": inp * (out * 3 // 32 * 4 + out // 32 * 2)}
    assert s.bytes_by_projection == page and s.bytes_per_expert == sum(page.values())
    assert s.expert_layers == E

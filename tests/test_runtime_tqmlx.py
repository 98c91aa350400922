"""TurboQuant-MLX's own on-disk layout (docs/turboquant.md, "Stored tensors" and "TurboQuant-MLX's on-disk layout")
loads in tqbench.runtime and computes exactly what our layout of the same weights computes.

The TurboQuant-MLX directories are made from our conversions by `to_turboquant_mlx`: the same tensors, with the
routed experts stacked per layer and projection, their config block instead of ours and no expert map, so the only
difference between the two loads is the layout (and, in theirs, a rotation read from the signs instead of from a
recorded block)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import converted
from model_helpers import logits
from tqbench.demo import DemoSpec
from tqbench.quant import turboquant as tq
from tqbench.runtime.layers import TurboQuantConcat, TurboQuantLinear, TurboQuantSwitchLinear
from tqbench.runtime.load import LoadError, load

SHARD = 150_000
# As in test_layout: the routed experts' down_proj has input 352 = 11 x 32, which has no Hadamard transform of its own
# length, so it rotates in blocks of 32; TurboQuant-MLX's build records no block: the loader finds it from the signs.
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=352)
RECIPES = ("tq3a-tqTe-down4-g32", "tq3a-tqTe-down4-g32-norot")
PROMPT = [5, 17, 99, 3, 250, 42, 7, 300, 511, 64, 2]
_PER_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3)\.(?P<param>weight|scales)$")
_STACKED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_ONLY = ("expert_map.json", "convert-report.json", ".tqbench-convert.json", "model.safetensors.index.json")


def _tensors(root: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(root.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _port_name(name: str, a: mx.array) -> tuple[str, mx.array]:
    """The name (and array) TurboQuant-MLX's own K3 port gives a tensor (docs/turboquant.md, "Names"): MoE blocks at
    `mlp` (router `mlp.gate.weight` + `mlp.gate.e_score_correction_bias`), KDA convolutions at
    `self_attn.{q,k,v}_conv.conv.weight` in MLX's Conv1d layout (channels, kernel, 1)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if m := re.fullmatch(r"(.+)\.([qkv])_conv1d\.weight", name):
        return f"{m[1]}.{m[2]}_conv.conv.weight", a.moveaxis(2, 1)
    return name, a


def to_turboquant_mlx(ours: Path, dest: Path, port_names: bool = False, shards: int = 2) -> Path:
    """Rewrite one of our converted outputs (streaming layout) into TurboQuant-MLX's layout in `dest`.

    - per-expert `<moe>.experts.E.<w1|w3|w2>.{weight,scales}` -> `<moe>.switch_mlp.<gate|up|down>_proj.{weight,scales}`
      with a leading expert axis, next to the per-layer `codebook` / `signs` already stored there;
    - every other tensor unchanged, in shards with metadata {"format": "mlx"} and an mlx-style index;
    - config.json: our `quantization` block replaced by TurboQuant-MLX's, mirrored into `quantization_config`;
    - no expert_map.json, report or journal (the tokenizer and generation config are copied);
    - `port_names`: the names of TurboQuant-MLX's own K3 port (`_port_name`) instead of the source's."""
    dest.mkdir(parents=True)
    config = json.loads((ours / "config.json").read_text())
    recipe = config.pop("quantization")["recipe"]
    tensors = _tensors(ours)
    experts: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name in sorted(tensors):
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensors[name]
        else:
            experts.setdefault((m["moe"], m["proj"], m["param"]), {})[int(m["e"])] = tensors[name]
    for (moe, proj, param), per in experts.items():
        assert sorted(per) == list(range(len(per)))
        stacked = f"{moe}.switch_mlp.{_STACKED[proj]}"
        assert f"{stacked}.codebook" in out and f"{stacked}.signs" in out  # one codebook and signs for all experts
        out[f"{stacked}.{param}"] = mx.stack([per[e] for e in range(len(per))])
    if port_names:
        out = dict(_port_name(n, a) for n, a in out.items())
    names = sorted(out)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(dest / fname), {n: out[n] for n in part}, metadata={"format": "mlx"})
        weight_map.update({n: fname for n in part})
    total = sum(a.nbytes for a in out.values())
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    block = {"mode": "turboquant", "bits": recipe["bits"], "group_size": recipe["group_size"],
             "rotation": recipe["rotation"], "rotation_seed": recipe["seed"], "attn_bits": recipe["attn_bits"],
             "mlp_bits": recipe["mlp_bits"], "mlp_group_size": recipe["mlp_group_size"],
             "ternary_experts": recipe["ternary_experts"], "expert_down_bits": recipe["expert_down_bits"],
             "codebook": "lloyd-max", "use_qjl": False}
    config["quantization"] = block
    config["quantization_config"] = dict(block)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for f in ours.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _OURS_ONLY + ("config.json",):
            shutil.copy2(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """recipe -> {"ours": our conversion, "theirs": the same weights in TurboQuant-MLX's layout with the source's
    names, "port": the same with the names of TurboQuant-MLX's own K3 port}."""
    root = tmp_path_factory.mktemp("tqmlx")
    out = {}
    for name in RECIPES:
        ours = converted(name, SPEC, SHARD)  # shared with test_layout (read-only)
        out[name] = {"ours": ours, "theirs": to_turboquant_mlx(ours, root / f"{name}-tqmlx"),
                     "port": to_turboquant_mlx(ours, root / f"{name}-tqmlx-port", port_names=True)}
    return out


def _kinds(model) -> dict[str, int]:
    kinds = {"linear": 0, "experts": 0, "concat": 0}
    for path, m in model.named_modules():
        if isinstance(m, TurboQuantConcat):
            kinds["concat"] += 1
        elif isinstance(m, TurboQuantSwitchLinear):
            kinds["experts"] += 1
        elif isinstance(m, TurboQuantLinear) and ".parts." not in path:
            kinds["linear"] += 1
    return kinds


def test_the_rewritten_directory_is_turboquant_mlx_layout(dirs):
    theirs = dirs["tq3a-tqTe-down4-g32"]["theirs"]
    assert not (theirs / "expert_map.json").exists()
    config = json.loads((theirs / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"]
    assert config["quantization"]["mode"] == "turboquant" and "method" not in config["quantization"]
    tensors = _tensors(theirs)
    assert not [n for n in tensors if ".experts." in n]
    moe = "language_model.model.layers.1.block_sparse_moe.switch_mlp"
    assert tensors[f"{moe}.down_proj.weight"].shape == (SPEC.num_experts, SPEC.routed_expert_hidden_size, 44)
    assert tensors[f"{moe}.down_proj.scales"].shape == (SPEC.num_experts, SPEC.routed_expert_hidden_size, 11)
    assert tensors[f"{moe}.down_proj.codebook"].shape == (16,) and tensors[f"{moe}.gate_proj.codebook"].shape == (3,)
    ours = _tensors(dirs["tq3a-tqTe-down4-g32"]["ours"])
    for e in (0, 5, SPEC.num_experts - 1):  # stacked in expert order, bytes unchanged
        per = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w2"
        np.testing.assert_array_equal(np.array(tensors[f"{moe}.down_proj.weight"][e]), np.array(ours[f"{per}.weight"]))
        np.testing.assert_array_equal(np.array(tensors[f"{moe}.down_proj.scales"][e]), np.array(ours[f"{per}.scales"]))
    for f in theirs.glob("model-*.safetensors"):
        head = f.read_bytes()
        assert json.loads(head[8:8 + int.from_bytes(head[:8], "little")])["__metadata__"] == {"format": "mlx"}
    port = _tensors(dirs["tq3a-tqTe-down4-g32"]["port"])
    assert not [n for n in port if "block_sparse_moe" in n or "conv1d" in n]
    layer = "language_model.model.layers.1"
    assert port[f"{layer}.mlp.gate.e_score_correction_bias"].shape == (SPEC.num_experts,)
    assert port[f"{layer}.mlp.switch_mlp.down_proj.weight"].shape == tensors[f"{moe}.down_proj.weight"].shape
    assert port[f"{layer}.self_attn.q_conv.conv.weight"].shape == (SPEC.kda_num_heads * SPEC.kda_head_dim,
                                                                  SPEC.conv_kernel, 1)


@pytest.mark.parametrize("layout", ["theirs", "port"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_turboquant_mlx_layout_gives_our_layouts_logits_exactly(dirs, recipe, layout):
    ours, theirs = load(dirs[recipe]["ours"]), load(dirs[recipe][layout])
    stored = sum(n.endswith(".codebook") for n in _tensors(dirs[recipe][layout]))
    assert stored == sum(n.endswith(".codebook") for n in _tensors(dirs[recipe]["ours"]))
    assert ours.turboquant_modules == theirs.turboquant_modules == stored == 48
    # 3 MoE layers x 3 expert projections; KDA layers 0-2 whose q/k/v mlx-lm's kimi_k3 fuses into qkv_proj
    assert _kinds(ours.model) == _kinds(theirs.model) == {"linear": 30, "experts": 9, "concat": 3}
    got = logits(theirs.model, PROMPT)
    assert np.isfinite(got).all() and np.abs(got).max() > 1
    np.testing.assert_array_equal(got, logits(ours.model, PROMPT))


@pytest.mark.parametrize("recipe", RECIPES)
def test_rotation_from_the_signs_is_the_recorded_one(dirs, recipe):
    """Their build records no rotation: all +1 signs mean none, other signs the largest valid block, which for the
    352-wide expert down_proj is 32 (blockwise): the blocks our recorded rotations give, module for module."""
    rotated = not recipe.endswith("-norot")
    ours, theirs = load(dirs[recipe]["ours"]).model, load(dirs[recipe]["theirs"]).model

    def blocks(model) -> dict[str, tuple[int, int | None]]:
        return {p: (m.input_dims, m.block) for p, m in model.named_modules()
                if isinstance(m, (TurboQuantLinear, TurboQuantSwitchLinear))}

    assert blocks(theirs) == blocks(ours) and len(blocks(theirs)) == 48
    down = theirs.language_model.model.layers[1].mlp.switch_mlp.down_proj
    assert down.input_dims == 352
    if rotated:
        assert all(b == tq.rotation_block(n) for n, b in blocks(theirs).values())
        assert down.block == 32 and bool(np.any(np.array(down.signs) < 0))
    else:
        assert {b for _, b in blocks(theirs).values()} == {None} and bool(np.all(np.array(down.signs) == 1))


def test_a_scales_group_count_that_does_not_divide_in_is_one_line_naming_the_tensor(dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dirs["tq3a-tqTe-down4-g32"]["theirs"], broken)
    name = "language_model.model.layers.2.block_sparse_moe.switch_mlp.down_proj.scales"
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"][name]
    tensors = mx.load(str(shard))
    tensors[name] = mx.ones((SPEC.num_experts, SPEC.routed_expert_hidden_size, 3), dtype=mx.float16)  # 352 % 3 != 0
    mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
    with pytest.raises(LoadError) as e:
        load(broken)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"{broken}: tensor language_model.model.layers.2.mlp.switch_mlp.down_proj.scales: 3 groups do not "
                   "divide the input width 352")

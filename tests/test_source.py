"""Source inspection: header parsing, roles, summaries, checked against independent computations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from conftest import small_k3_text
from tqbench.errors import CheckpointError
from tqbench.source import Role, classify, open_checkpoint, select_tensors, summarize
from tqbench.shards.header import read_header
from tqbench.shards.writer import from_bf16, save_shard, to_bf16


def test_header_matches_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "a.weight": ("BF16", to_bf16(rng.standard_normal((5, 7)).astype(np.float32))),
        "b.bias": ("F32", rng.standard_normal(3).astype(np.float32)),
        "c.codes": ("U8", rng.integers(0, 255, (4, 9), dtype=np.uint8)),
        "d.index": ("I64", np.arange(6, dtype=np.int64).reshape(2, 3)),
        "e.empty": ("F16", np.zeros((0, 4), dtype=np.float16)),
    }
    path = save_shard(tmp_path / "x.safetensors", arrays, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert [t.name for t in header.tensors if t.nbytes] == ["a.weight", "b.bias", "c.codes", "d.index"]
    raw = path.read_bytes()
    with safe_open(str(path), framework="numpy") as f:
        for t in header.tensors:
            dtype, arr = arrays[t.name]
            assert t.dtype == dtype and t.shape == arr.shape and t.nbytes == arr.nbytes
            # Our absolute offsets address exactly the bytes the reference library decodes.
            assert raw[t.offset:t.offset + t.nbytes] == arr.tobytes()
            if dtype != "BF16":
                np.testing.assert_array_equal(f.get_tensor(t.name), arr)


def test_bf16_rounding_matches_mlx():
    import mlx.core as mx

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 10_000),
                        # exact ties between two bf16 values round to even
                        (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)])
    reference = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(to_bf16(x), reference)
    np.testing.assert_array_equal(from_bf16(reference), np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)))


@pytest.mark.parametrize("name, role, layer, expert, projection", [
    ("language_model.model.embed_tokens.weight", Role.EMBEDDING, None, None, "embed_tokens"),
    ("language_model.lm_head.weight", Role.LM_HEAD, None, None, "lm_head"),
    ("language_model.model.norm.weight", Role.NORM, None, None, "norm"),
    ("language_model.model.layers.7.input_layernorm.weight", Role.NORM, 7, None, "input_layernorm"),
    ("language_model.model.layers.2.self_attn.q_conv1d.weight", Role.ATTENTION, 2, None, "q_conv1d"),
    ("language_model.model.layers.3.self_attn.kv_b_proj.weight", Role.ATTENTION, 3, None, "kv_b_proj"),
    ("language_model.model.layers.0.mlp.down_proj.weight", Role.DENSE_MLP, 0, None, "down"),
    ("language_model.model.layers.5.block_sparse_moe.gate.weight", Role.ROUTER, 5, None, "gate"),
    ("language_model.model.layers.5.block_sparse_moe.gate.e_score_correction_bias", Role.ROUTER, 5, None, "gate"),
    ("language_model.model.layers.5.block_sparse_moe.shared_experts.up_proj.weight", Role.SHARED_EXPERT, 5, None, "up"),
    ("model.layers.5.mlp.shared_expert.down_proj.weight", Role.SHARED_EXPERT, 5, None, "down"),
    ("language_model.model.layers.5.block_sparse_moe.experts.895.w1.weight_packed", Role.ROUTED_EXPERT, 5, 895, "gate"),
    ("language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight_scale", Role.ROUTED_EXPERT, 5, 3, "down"),
    ("language_model.model.layers.5.block_sparse_moe.experts.3.w3.weight_packed", Role.ROUTED_EXPERT, 5, 3, "up"),
    ("model.layers.1.mlp.experts.12.gate_proj.weight", Role.ROUTED_EXPERT, 1, 12, "gate"),
    ("model.layers.1.mlp.switch_mlp.down_proj.scales", Role.ROUTED_EXPERT, 1, None, "down"),
    ("language_model.model.layers.5.block_sparse_moe.routed_expert_down_proj.weight", Role.LATENT_PROJ, 5, None,
     "routed_expert_down_proj"),
    ("language_model.model.layers.5.self_attention_res_proj.weight", Role.ATTN_RES, 5, None, "self_attention_res_proj"),
    ("language_model.model.output_attn_res_norm.weight", Role.ATTN_RES, None, None, "output_attn_res_norm"),
    ("vision_tower.encoder.layers.0.attn.qkv.weight", Role.OTHER, None, None, "qkv"),
])
def test_roles(name, role, layer, expert, projection):
    n = classify(name)
    assert (n.role, n.layer, n.expert, n.projection) == (role, layer, expert, projection)
    assert n.stacked == ("switch_mlp" in name)


def _expected_small_params(t: dict) -> tuple[int, int, int]:
    """Total, routed and per-expert parameters of small_k3_text(), from the architecture, not from headers."""
    H, V, L, I = t["hidden_size"], t["vocab_size"], t["routed_expert_hidden_size"], t["moe_intermediate_size"]
    lin = t["linear_attn_config"]
    P, hd, nh = lin["num_heads"] * lin["head_dim"], lin["head_dim"], t["num_attention_heads"]
    kda = 3 * P * H + 3 * P * 4 + hd * H + P * hd + lin["num_heads"] * H + P * H + 2 * P + hd + H * P
    mla = (t["q_lora_rank"] * H + t["q_lora_rank"] + nh * 24 * t["q_lora_rank"] + 40 * H + 32
           + nh * 32 * t["kv_lora_rank"] + nh * 16 * H + H * nh * 16)
    common = 6 * H
    dense = 3 * t["intermediate_size"] * H
    expert = 3 * L * I
    moe = t["num_experts"] * H + t["num_experts"] + 2 * L * H + L + 3 * I * t["num_shared_experts"] * H
    routed = 3 * t["num_experts"] * expert
    total = 2 * V * H + H + 2 * H + 4 * common + 3 * kda + mla + dense + 3 * moe + routed
    return total, routed, expert


def test_small_k3_summary(small_k3):
    ckpt = open_checkpoint(small_k3)
    s = summarize(ckpt)
    text = small_k3_text()
    total, routed, expert = _expected_small_params(text)
    assert s.params == total
    assert s.experts.routed_params == routed and s.experts.params_per_expert == expert
    assert s.active_params == total - routed + 3 * 2 * expert  # 3 MoE layers x top-2
    assert (s.experts.moe_layers, s.experts.experts_per_layer, s.experts.top_k) == (3, 8, 2)
    # One expert: w1/w3 packed (64 x 16 B) + scales (64 x 1 B); w2 packed (32 x 32 B) + scales (32 x 2 B).
    assert s.experts.bytes_by_projection == {"gate": 1088, "up": 1088, "down": 1088}
    assert [(x.layer, x.attention, x.mlp, x.experts) for x in s.by_layer] == [
        (0, "kda", "dense", 0), (1, "kda", "moe", 8), (2, "kda", "moe", 8), (3, "mla", "moe", 8)]
    index = json.loads((small_k3 / "model.safetensors.index.json").read_text())
    assert s.bytes == index["metadata"]["total_size"] == sum(g.bytes for g in s.by_role)
    assert s.tensors == len(index["weight_map"]) == sum(g.tensors for g in s.by_shard)
    assert len(s.by_shard) == len(set(index["weight_map"].values())) > 2
    assert s.format == "compressed-tensors mxfp4-pack-quantized + bf16"
    assert {g.key: g.formats for g in s.by_role}["routed_expert"] == ("mxfp4",)
    assert len(select_tensors(ckpt, "*experts.3.*")) == 3 * 6
    assert select_tensors(ckpt, "*layers.3.self_attn.o_proj*")[0].name.attention == "mla"


def test_stacked_mlx_layout_and_missing_index(tmp_path):
    """An MLX-converted layout (stacked switch_mlp, affine) without an index: all *.safetensors are read."""
    E, out, inp, g, bits = 4, 64, 128, 64, 4
    words = inp * bits // 32
    u32 = np.zeros((E, out, words), np.uint32)
    f16 = np.zeros((E, out, inp // g), np.float16)
    save_shard(tmp_path / "model.safetensors", {
        "model.layers.0.mlp.switch_mlp.gate_proj.weight": ("U32", u32),
        "model.layers.0.mlp.switch_mlp.gate_proj.scales": ("F16", f16),
        "model.layers.0.mlp.switch_mlp.gate_proj.biases": ("F16", f16),
        "model.layers.0.mlp.gate.weight": ("F16", np.zeros((E, inp), np.float16)),
    })
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 1,
         "quantization": {"group_size": g, "bits": bits}}))
    s = summarize(open_checkpoint(tmp_path))
    assert s.format == "mlx-affine + f16"
    assert s.experts.experts_per_layer == E and s.experts.params_per_expert == out * inp
    assert s.experts.bytes_per_expert == (u32.nbytes + 2 * f16.nbytes) // E
    assert s.params == E * out * inp + E * inp
    assert s.active_params == s.params - E * out * inp + 2 * out * inp


@pytest.mark.slow
def test_k3_published_figures(k3_skeleton):
    s = summarize(open_checkpoint(k3_skeleton))
    assert round(s.params / 1e9, 1) == 2779.5
    assert round(s.experts.routed_params / 1e9, 1) == 2722.7
    assert round(s.experts.params_per_expert / 1e6, 2) == 33.03
    assert round(s.active_params / 1e9) == 105
    assert round(s.bytes / 1e12, 2) == 1.56
    assert s.experts.expert_layers == 92 * 896 == 82_432
    assert (s.experts.top_k, s.experts.experts_per_layer) == (16, 896)
    assert sum(1 for x in s.by_layer if x.attention == "mla") == 24
    assert sum(1 for x in s.by_layer if x.attention == "kda") == 69
    assert math.isclose(s.experts.routed_bytes / s.experts.routed_params * 8, 4.25)


def test_every_tensor_keeps_its_header_entry(small_k3):
    """The checkpoint keeps one compact record per tensor (shared kinds, names rebuilt on demand): every rebuilt entry
    equals what the shard headers say, name for name, byte for byte."""
    ckpt = open_checkpoint(small_k3)
    headers = {t.name: t for s in ckpt.shards for t in read_header(s.path, s.file).tensors}
    assert sorted(t.entry.name for t in ckpt.tensors) == sorted(headers)
    for t in ckpt.tensors:
        assert t.entry == headers[t.entry.name]
        assert t.name.name == t.entry.name and classify(t.entry.name).expert == t.name.expert
    assert [s.tensors for s in ckpt.shards] == [len(read_header(s.path).tensors) for s in ckpt.shards]


def _two_shards(root, first: dict, second: dict):
    z = ("BF16", np.zeros((4, 8), np.uint16))
    save_shard(root / "a.safetensors", {n: z for n in first})
    save_shard(root / "b.safetensors", {n: z for n in second})
    (root / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1}))


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.norm.weight"])
def test_a_tensor_in_two_shards_is_refused(tmp_path, name):
    expert = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    _two_shards(tmp_path, {expert.format(0), name}, {name, expert.format(1)})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' appears in both a.safetensors and b.safetensors"):
        open_checkpoint(tmp_path)


def test_expert_numbers_with_leading_zeros_keep_their_names(tmp_path):
    names = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in ("0", "1", "02", "10")]
    _two_shards(tmp_path, set(names[:2]), set(names[2:]))
    ckpt = open_checkpoint(tmp_path)
    assert sorted(t.entry.name for t in ckpt.tensors) == sorted(names)
    assert sorted(t.name.expert for t in ckpt.tensors) == [0, 1, 2, 10]
    assert all(t.name.role is Role.ROUTED_EXPERT for t in ckpt.tensors)

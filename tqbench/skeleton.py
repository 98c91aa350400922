"""Header-only checkpoints: real safetensors headers over sparse (unwritten) data regions.

These let tests and `tqbench plan` demonstrations work on the exact tensor layout of a 1.56 TB model like Kimi K3
without the bytes: the files are sparse, so they cost almost nothing on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tqbench.layout.names import shard_file
from tqbench.layout.shard_units import assign_shards
from tqbench.shards import TensorSpec, header_bytes

# The published Kimi K3 config (text part under text_config), as described in docs/kimi-k3.md.
K3_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "vocab_size": 163840,
    "intermediate_size": 33792,
    "rms_norm_eps": 1e-5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
        "kda_layers": [i + 1 for i in range(93) if (i + 1) % 4 != 0 and i != 92],
        "full_attn_layers": [i + 1 for i in range(93) if (i + 1) % 4 == 0 or i == 92],
    },
    "attn_res_block_size": 12,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
}

MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                        "scale_dtype": "torch.uint8"},
        }
    },
}


def k3_config(text: dict[str, Any] | None = None) -> dict[str, Any]:
    """A top-level K3 config.json around a text config (the published one by default)."""
    text = dict(text or K3_TEXT_CONFIG)
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "tie_word_embeddings": False,
        "text_config": text,
        "quantization_config": MXFP4_QUANTIZATION_CONFIG,
    }


def k3_tensor_specs(text: dict[str, Any], prefix: str = "language_model.") -> list[TensorSpec]:
    """Every tensor of a Kimi-K3-architecture source checkpoint (HF naming, mxfp4 routed experts), in file order."""
    H = text["hidden_size"]
    lin = text["linear_attn_config"]
    kda_layers = set(lin["kda_layers"])
    P = lin["num_heads"] * lin["head_dim"]
    nh, qk_nope, qk_rope, v = (text["num_attention_heads"], text["qk_nope_head_dim"], text["qk_rope_head_dim"],
                               text["v_head_dim"])
    q_lora, kv_lora = text["q_lora_rank"], text["kv_lora_rank"]
    L = text.get("routed_expert_hidden_size") or H
    inter = text["moe_intermediate_size"]
    shared = inter * text["num_shared_experts"]
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> None:
        specs.append(TensorSpec(name=prefix + name, dtype=dtype, shape=shape))

    add("model.embed_tokens.weight", (text["vocab_size"], H))
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(p + norm + ".weight", (H,))
        add(p + "self_attention_res_proj.weight", (1, H))
        add(p + "mlp_res_proj.weight", (1, H))
        a = p + "self_attn."
        if i + 1 in kda_layers:
            for x in "qkv":
                add(a + f"{x}_proj.weight", (P, H))
            for x in "qkv":
                add(a + f"{x}_conv1d.weight", (P, 1, lin["short_conv_kernel_size"]))
            add(a + "f_a_proj.weight", (lin["head_dim"], H))
            add(a + "f_b_proj.weight", (P, lin["head_dim"]))
            add(a + "b_proj.weight", (lin["num_heads"], H))
            add(a + "g_proj.weight", (P, H))
            add(a + "A_log", (P,), "F32")
            add(a + "dt_bias", (P,), "F32")
            add(a + "o_norm.weight", (lin["head_dim"],))
            add(a + "o_proj.weight", (H, P))
        else:
            add(a + "q_a_proj.weight", (q_lora, H))
            add(a + "q_a_layernorm.weight", (q_lora,))
            add(a + "q_b_proj.weight", (nh * (qk_nope + qk_rope), q_lora))
            add(a + "kv_a_proj_with_mqa.weight", (kv_lora + qk_rope, H))
            add(a + "kv_a_layernorm.weight", (kv_lora,))
            add(a + "kv_b_proj.weight", (nh * (qk_nope + v), kv_lora))
            if text.get("mla_use_output_gate"):
                add(a + "g_proj.weight", (nh * v, H))
            add(a + "o_proj.weight", (H, nh * v))
        if i < text.get("first_k_dense_replace", 0):
            I = text["intermediate_size"]
            add(p + "mlp.gate_proj.weight", (I, H))
            add(p + "mlp.up_proj.weight", (I, H))
            add(p + "mlp.down_proj.weight", (H, I))
            continue
        m = p + "block_sparse_moe."
        E = text["num_experts"]
        add(m + "gate.weight", (E, H))
        add(m + "gate.e_score_correction_bias", (E,), "F32")
        add(m + "routed_expert_down_proj.weight", (L, H))
        add(m + "routed_expert_up_proj.weight", (H, L))
        if text.get("latent_moe_use_norm"):
            add(m + "routed_expert_norm.weight", (L,))
        if shared:
            add(m + "shared_experts.gate_proj.weight", (shared, H))
            add(m + "shared_experts.up_proj.weight", (shared, H))
            add(m + "shared_experts.down_proj.weight", (H, shared))
        for e in range(E):
            for w, (rows, cols) in (("w1", (inter, L)), ("w2", (L, inter)), ("w3", (inter, L))):
                add(m + f"experts.{e}.{w}.weight_packed", (rows, cols // 2), "U8")
                add(m + f"experts.{e}.{w}.weight_scale", (rows, cols // 32), "U8")
    add("model.output_attn_res_proj.weight", (1, H))
    add("model.output_attn_res_norm.weight", (H,))
    add("model.norm.weight", (H,))
    add("lm_head.weight", (text["vocab_size"], H))
    return specs


def write_skeleton(dest: Path, config: dict[str, Any], specs: list[TensorSpec], shard_size: int = 5 * 2**30) -> Path:
    """Write config.json, an index and sparse shards whose headers describe `specs` (data left unwritten)."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups = assign_shards(specs, shard_size)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        name = shard_file(i, len(groups))
        head = header_bytes(group)
        with open(tmp / name, "wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(s.nbytes for s in group))
        weight_map.update({s.name: name for s in group})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def write_k3_skeleton(dest: Path, shard_size: int = 5 * 2**30) -> Path:
    """The full Kimi K3 source layout (93 layers, 896 experts, ~1.56 TB of sparse data)."""
    return write_skeleton(dest, k3_config(), k3_tensor_specs(K3_TEXT_CONFIG), shard_size)

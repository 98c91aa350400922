"""The demo model's shape (`DemoSpec`; the first demo's `TRAINED_SPEC`, the shipped `SHIPPED_SPEC`) and what follows
from it alone: the K3-like `config.json`, the special token ids and the tensors of the checkpoint (names, shapes and
dtypes from `tqbench.skeleton`, the K3 layout: routed experts U8 (mxfp4), `A_log`, `dt_bias` and
`e_score_correction_bias` F32, everything else BF16)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tqbench.shards.header import TensorSpec
from tqbench.skeleton import K3_TEXT_CONFIG, k3_tensor_specs
from tqbench.tokenizer import NAMED_SPECIAL, NUM_SPECIAL


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """The shape of a demo model. The defaults give a 0.85 MB checkpoint; scale any field up for benchmarks."""

    hidden_size: int = 64
    num_hidden_layers: int = 4
    mla_every: int = 4  # MLA at 1-indexed layers divisible by this, and at the last layer (K3: 4, 8, ..., 92, 93)
    intermediate_size: int = 128  # the dense MLP of the first layers
    first_k_dense_replace: int = 1
    num_experts: int = 16
    num_experts_per_token: int = 4
    moe_intermediate_size: int = 64
    routed_expert_hidden_size: int = 32  # the latent size the routed experts work in
    num_shared_experts: int = 1
    num_attention_heads: int = 4  # MLA
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    kda_num_heads: int = 4
    kda_head_dim: int = 16
    conv_kernel: int = 4
    attn_res_block_size: int = 2
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    bpe_merges: int = 256  # tokenizer: 256 bytes + merges, then the 256 specials
    num_shards: int = 4

    def __post_init__(self):
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 32 for mxfp4 experts")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"cannot route to {self.num_experts_per_token} of {self.num_experts} experts")

    @property
    def base_vocab(self) -> int:
        return 256 + self.bpe_merges

    @property
    def vocab_size(self) -> int:
        return self.base_vocab + NUM_SPECIAL

    @property
    def full_attn_layers(self) -> list[int]:
        n = self.num_hidden_layers
        return sorted({i for i in range(1, n + 1) if i % self.mla_every == 0} | {n})

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers]

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


# The shipped demo: hidden 128, 8 layers (KDA, MLA at 4 and 8), layer 0 dense, 7 LatentMoE layers of 64 experts top-4
# in a 64-wide latent space plus 2 shared experts, a 4096-merge BPE. About 8 M parameters, 2.9 M active per token.
TRAINED_SPEC = DemoSpec(
    hidden_size=128,
    num_hidden_layers=8,
    mla_every=4,
    intermediate_size=384,
    first_k_dense_replace=1,
    num_experts=64,
    num_experts_per_token=4,
    moe_intermediate_size=64,
    routed_expert_hidden_size=64,
    num_shared_experts=2,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    kda_num_heads=4,
    kda_head_dim=32,
    attn_res_block_size=4,
    bpe_merges=4096,
    num_shards=4,
)


# The second-generation (chat) demo: the same dense parts as TRAINED_SPEC (hidden 128, 8 layers, KDA + MLA at 4 and 8,
# AttnRes blocks of 4, the same 4096-merge tokenizer, so per-token losses compare), with K3's routed share: 448 routed
# experts top-8 per MoE layer = 1.79% active, exactly K3's 16 of 896 (both halved). The experts are half as wide as the
# first demo's (latent 64 -> 32 -> 64: 6,144 parameters, 3,264 bytes in mxfp4), so a token's routed compute is the
# same (8 x 6,144 = 4 x 12,288) while the routed parameters grow 3.5x (19.3 M). Four shared "experts" of 32 make the
# shared MLP 128 wide, as the first demo's two of 64. 16.07 MB of tensors (10.24 MB experts); about 20 MB on disk with
# the safetensors headers and the index of 19,028 tensors.
CHAT_SPEC = replace(TRAINED_SPEC, num_experts=448, num_experts_per_token=8, moe_intermediate_size=32,
                    num_shared_experts=4)

SHIPPED_SPEC = CHAT_SPEC  # the checkpoint in the package (tqbench/demo/checkpoint) since demo v4

DEMO_SPECS = {"code": TRAINED_SPEC, "chat": CHAT_SPEC}  # by the name scripts/train_demo.py's --spec takes


def special_ids(spec: DemoSpec) -> dict[str, int]:
    """bos, eos (a chat turn's end, also the end of a training document) and pad ids of a demo's vocabulary."""
    ids = {name: spec.base_vocab + i for i, name in NAMED_SPECIAL.items()}
    return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|end_of_msg|>"], "pad_token_id": ids["[PAD]"]}


def text_config(spec: DemoSpec) -> dict:
    """The `text_config` of the demo: every key of K3's, with the demo's sizes."""
    return {
        **K3_TEXT_CONFIG,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "intermediate_size": spec.intermediate_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": 1048576,
        "activation_situ_beta": spec.situ_beta,
        "activation_situ_linear_beta": spec.situ_linear_beta,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "num_experts": spec.num_experts,
        "num_experts_per_token": spec.num_experts_per_token,
        "num_shared_experts": spec.num_shared_experts,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "routed_expert_hidden_size": spec.routed_expert_hidden_size,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "linear_attn_config": {
            **K3_TEXT_CONFIG["linear_attn_config"],
            "num_heads": spec.kda_num_heads,
            "head_dim": spec.kda_head_dim,
            "short_conv_kernel_size": spec.conv_kernel,
            "kda_layers": spec.kda_layers,
            "full_attn_layers": spec.full_attn_layers,
        },
        "attn_res_block_size": spec.attn_res_block_size,
        "torch_dtype": "bfloat16",
        **special_ids(spec),
    }


def source_config(spec: DemoSpec) -> dict:
    """config.json of a K3-layout source checkpoint for `spec`."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.uint8",
        "zp_dtype": None,
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        # Only the routed experts are quantized; every other Linear stays bf16.
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj$",
            "re:.*block_sparse_moe\\.gate$",
            "re:.*routed_expert_(down|up)_proj$",
            "re:.*_res_proj$",
        ],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        **special_ids(spec),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text_config(spec),
        "quantization_config": quant,
    }


def tensor_plan(spec: DemoSpec) -> list[TensorSpec]:
    """Every tensor of the demo source checkpoint in file order (the K3 layout from `tqbench.skeleton`)."""
    return k3_tensor_specs(text_config(spec))

"""Tensor naming: which layer, role, expert and projection a checkpoint tensor belongs to.

This is the one place that knows checkpoint naming conventions (HF per-expert names such as `experts.E.w1`,
stacked MLX names such as `switch_mlp.gate_proj`, `block_sparse_moe` vs `mlp`, `shared_expert` vs `shared_experts`).
Every later feature (plan, convert, stream) classifies tensors through `classify`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"
    ATTENTION = "attention"
    DENSE_MLP = "dense_mlp"
    ROUTER = "router"
    SHARED_EXPERT = "shared_expert"
    ROUTED_EXPERT = "routed_expert"
    LATENT_PROJ = "latent_proj"
    ATTN_RES = "attn_res"
    OTHER = "other"


# Parameter suffixes that belong to one module (a Linear and its quantization side tensors).
PARAM_SUFFIXES = (
    "weight_packed",
    "weight_scale_inv",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "input_global_scale",
    "weight",
    "scales",
    "biases",
    "codebook",
    "signs",
    "bias",
    "e_score_correction_bias",
    "A_log",
    "dt_bias",
)

# Projection names of routed/shared experts and MLPs, normalised: w1 = gate, w3 = up, w2 = down.
PROJECTIONS = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
    "gate_up_proj": "gate_up",
}

# Attention sub-module names that only one attention family has.
KDA_NAMES = {"f_a_proj", "f_b_proj", "b_proj", "A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "qkv_conv",
             "q_conv", "k_conv", "v_conv", "g_a_proj", "g_b_proj", "o_norm", "qkv_proj"}
MLA_NAMES = {"q_a_proj", "q_b_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
             "embed_q", "unembed_out"}

# Prefixes that wrap the text model in multimodal or MLX checkpoints; stripped before matching.
_WRAPPERS = re.compile(r"^(?:language_model\.|model\.language_model\.|text_model\.)")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.")
_STACKED = re.compile(r"\.(?:switch_mlp|experts)\.(gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)\.")
_NON_TEXT = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "visual.")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorName:
    """What a tensor name says about the tensor."""

    name: str
    role: Role
    module: str  # the name without its parameter suffix (the Linear / Norm path)
    param: str  # weight, weight_packed, scales, ...
    layer: int | None = None
    expert: int | None = None  # set for per-expert names (`experts.E.w1`)
    stacked: bool = False  # a routed-expert tensor with a leading expert axis
    projection: str | None = None  # gate / up / down for experts and MLPs, else the module's last part
    attention: str | None = None  # "kda", "mla" or "generic" for attention tensors


def split_param(name: str) -> tuple[str, str]:
    """`a.b.weight_packed` -> (`a.b`, `weight_packed`); a name without a dot is its own module."""
    for suffix in PARAM_SUFFIXES:
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    module, _, last = name.rpartition(".")
    return (module, last) if module else (name, "")


def classify(name: str) -> TensorName:
    module, param = split_param(name)
    inner = _WRAPPERS.sub("", name)
    m = _LAYER.search(inner)
    layer = int(m.group(1)) if m else None
    last = module.rpartition(".")[2]

    def make(role: Role, **kw) -> TensorName:
        kw.setdefault("projection", last)
        return TensorName(name=name, role=role, module=module, param=param, layer=layer, **kw)

    if any(w in inner for w in _NON_TEXT) or "mtp" in inner.split(".")[:2]:
        return TensorName(name=name, role=Role.OTHER, module=module, param=param, projection=last)
    if "attn_res" in inner or "attention_res" in inner or "mlp_res" in inner:
        return make(Role.ATTN_RES)
    if e := _EXPERT.search(inner + "."):
        if "shared_expert" not in inner:
            return make(Role.ROUTED_EXPERT, expert=int(e.group(1)), projection=PROJECTIONS.get(e.group(2), e.group(2)))
    if s := _STACKED.search(inner + "."):
        if "shared_expert" not in inner:
            return make(Role.ROUTED_EXPERT, stacked=True, projection=PROJECTIONS.get(s.group(1), s.group(1)))
    if "shared_expert" in inner:
        return make(Role.SHARED_EXPERT, projection=PROJECTIONS.get(last, last))
    if last in ("routed_expert_down_proj", "routed_expert_up_proj", "fc1_latent_proj", "fc2_latent_proj"):
        return make(Role.LATENT_PROJ)
    if param == "e_score_correction_bias" or last in ("gate", "router") and layer is not None:
        return make(Role.ROUTER)
    if "embed_tokens" in inner or last in ("wte", "tok_embeddings", "word_embeddings"):
        return make(Role.EMBEDDING)
    if last in ("lm_head", "output") and layer is None:
        return make(Role.LM_HEAD)
    if "norm" in last or last.endswith("ln") or last.startswith("ln_"):
        return make(Role.NORM)
    if layer is not None and re.search(r"\.(self_attn|attention|attn|self_attention)\.", inner):
        kind = "kda" if last in KDA_NAMES or param in KDA_NAMES else "mla" if last in MLA_NAMES else "generic"
        return make(Role.ATTENTION, attention=kind)
    if layer is not None and re.search(r"\.(mlp|feed_forward|ffn)\.", inner):
        return make(Role.DENSE_MLP, projection=PROJECTIONS.get(last, last))
    return make(Role.OTHER)

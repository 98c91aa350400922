"""Role rules: what a recipe does to one source module (a Linear, a norm, a router, a stack of routed experts).

From docs/turboquant.md, checked against TurboQuant-MLX's converter:
- kept at source precision: embeddings, norms, routers (`gate`, `e_score_correction_bias`), AttnRes projections and
  norms, convolutions and other non-Linear parameters (`A_log`, `dt_bias`), tensors of unknown role, and any Linear
  with a dimension < 32 or `in % g != 0` (never an error: it is listed, with its bytes, in the plan);
- MLA `kv_b_proj` is kept at source too: MLX runtimes split it per head into `embed_q` / `unembed_out`
  (MultiLinear, not a Linear), which TurboQuant-MLX leaves in bf16. Quantizing it would put Kimi K3's resident set at
  27.30 GB instead of the published ~27.7 GB;
- attention (q/k/v/o, q-LoRA, MLA latents, KDA projections): `attn_bits` or `bits`, group g;
- shared experts, LatentMoE down/up projections, dense MLPs and `lm_head`: the base tier (`bits`, group g), never
  the expert tier. TurboQuant-MLX quantizes `lm_head` as an ordinary Linear (it skips only `nn.Embedding`), which the
  published K3 total needs (lm_head kept in bf16 would add 1.84 GB: the model card's 869 GiB). TurboQuant-MLX gives
  dense MLPs `mlp_bits` and, by matching "mlp" in module paths, `mlp_group_size` even to shared experts and latent
  projections; here the expert tier means routed experts only (no published figure depends on the difference:
  ~617 GB either way for tqTe-g64-mlpg128 on K3);
- routed experts: the expert format; ternary or `mlp_bits`/`bits`; `down_proj` at `expert_down_bits` when given
  (never ternary); group `mlp_group_size` or g. mxfp4 source experts are dequantized for TurboQuant or affine output
  (their logical shape is rows x 2*packed columns) or copied byte for byte (`mxfp4e`, `srce`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.recipe.recipe import Format, Recipe, RecipeError
from tqbench.source.naming import Role, TensorName

MIN_DIM = 32
# Source formats a quantizing recipe can start from: plain floats, fp8 with block scales, and 4-bit packs we decode.
REQUANTIZABLE = {"bf16", "f16", "f32", "f64", "fp8", "mxfp4", "nvfp4"}
_KEPT_ROLES = {
    Role.EMBEDDING: "embedding",
    Role.NORM: "norm",
    Role.ROUTER: "router",
    Role.ATTN_RES: "AttnRes",
    Role.OTHER: "other",
}
_BASE_ROLES = (Role.ATTENTION, Role.SHARED_EXPERT, Role.LATENT_PROJ, Role.DENSE_MLP, Role.LM_HEAD)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """How one module is stored: format, code bits (None for ternary or kept), group, tier, and why it was kept."""

    format: Format
    bits: int | None = None
    ternary: bool = False
    group_size: int | None = None
    tier: str = ""  # attention, base, experts, expert down; "" when kept
    reason: str = ""  # why it stays at source precision

    @property
    def quantized(self) -> bool:
        return self.format in (Format.TURBOQUANT, Format.AFFINE)

    @property
    def label(self) -> str:
        """`tq3 g64`, `ternary g64`, `affine4 g64`, `mxfp4`, `source (router)`."""
        if self.format is Format.TURBOQUANT:
            return f"{'ternary' if self.ternary else f'tq{self.bits}'} g{self.group_size}"
        if self.format is Format.AFFINE:
            return f"affine{self.bits} g{self.group_size}"
        if self.format is Format.MXFP4:
            return "mxfp4"
        return f"source ({self.reason})" if self.reason else "source"


def kept(reason: str) -> Choice:
    return Choice(format=Format.SOURCE, reason=reason)


def choose(recipe: Recipe, name: TensorName, shape: tuple[int, int] | None, source_format: str) -> Choice:
    """The choice for one module. `shape` is the logical (out, in) of one Linear (one expert for routed experts),
    None when the module is not a Linear. Raises RecipeError when the recipe cannot apply to this source."""
    if name.role in _KEPT_ROLES:
        return kept(_KEPT_ROLES[name.role])
    if shape is None or len(shape) != 2:
        return kept("not a Linear")
    if name.module.rpartition(".")[2] == "kv_b_proj":
        return kept("MLA kv_b_proj")
    if name.role is Role.ROUTED_EXPERT:
        fmt, group = recipe.experts_format, recipe.expert_group_size
        if fmt is Format.MXFP4:
            if source_format != "mxfp4":
                raise RecipeError(f"recipe {recipe.name}: mxfp4e copies mxfp4 experts, but {name.module} is "
                                  f"{source_format}")
            return Choice(format=Format.MXFP4, tier="experts", reason="mxfp4 passthrough")
        if fmt is Format.SOURCE:
            return kept("recipe")
        if name.projection == "down" and recipe.expert_down_bits is not None:
            choice = Choice(format=fmt, bits=recipe.expert_down_bits, ternary=False, group_size=group,
                            tier="expert down")
        elif recipe.ternary_experts:
            choice = Choice(format=fmt, bits=None, ternary=True, group_size=group, tier="experts")
        else:
            choice = Choice(format=fmt, bits=recipe.expert_bits, ternary=False, group_size=group, tier="experts")
    elif name.role in _BASE_ROLES:
        if recipe.format is Format.SOURCE:
            return kept("recipe")
        attention = name.role is Role.ATTENTION
        bits = recipe.attention_bits if attention else recipe.bits
        choice = Choice(format=recipe.format, bits=bits, ternary=False, group_size=recipe.group_size,
                        tier="attention" if attention else "base")
    else:
        return kept(name.role.value)
    if source_format not in REQUANTIZABLE:
        raise RecipeError(f"recipe {recipe.name}: cannot re-quantize {name.module}, stored as {source_format}; plan "
                          "from the original checkpoint")
    out, inp = shape
    if min(out, inp) < MIN_DIM:
        return kept(f"dimension < {MIN_DIM}")
    if inp % choice.group_size:
        return kept(f"in % {choice.group_size} != 0")
    return choice

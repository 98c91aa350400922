"""The `quantization` block a conversion writes into config.json, and reading it back.

It records the recipe and, per output module, what a loader needs so it never has to guess: the format (turboquant,
affine, mxfp4), bits (None for ternary), ternary, group size and, for TurboQuant, the rotation (`kind`: hadamard,
blockwise-hadamard or none, and the transform length `block`). Routed experts stored per expert share one entry under
`<moe>.experts.*.<proj>` (and the stacked name `<moe>.switch_mlp.<proj>_proj`).

The block also carries what `mlx_lm.load` reads: top-level `group_size`, `bits` and `mode`. mlx-lm then infers each
quantized module's parameters from its saved tensors, so outputs of MLX-native recipes (affine, mxfp4) load there
unchanged. mlx-lm has no TurboQuant layers: each TurboQuant module also gets an entry under its mlx-lm module path
with mode "turboquant", so `mlx_lm.load` stops with "Invalid quantization mode 'turboquant'" instead of loading
codebook codes as affine weights.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from tqbench.layout.names import EXPERT_MAP, mlx_module_path

METHOD = "tqbench"
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ModuleQuant:
    format: str  # turboquant, affine or mxfp4
    bits: int | None  # None for ternary
    ternary: bool
    group_size: int
    rotation: dict[str, Any] | None = None  # TurboQuant: {"kind", "block"}

    @property
    def mlx_mode(self) -> str:
        return {"affine": "affine", "mxfp4": "mxfp4"}.get(self.format, self.format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["rotation"] is None:
            del d["rotation"]
        return d


def quantization_block(recipe: dict[str, Any], modules: Mapping[str, ModuleQuant],
                       expert_names: Mapping[str, str]) -> dict[str, Any]:
    """The block for a conversion: `modules` by output module name, `expert_names` maps a stacked routed-expert
    module to its per-expert name with `*` for the expert (`<moe>.experts.*.<proj>`)."""
    entries: dict[str, Any] = {}
    for name, q in modules.items():
        entries[name] = q.to_dict()
        if name in expert_names:
            entries[expert_names[name]] = q.to_dict()
    block: dict[str, Any] = {"method": METHOD, "recipe": recipe, "layout": "streaming", "expert_map": EXPERT_MAP,
                             "modules": entries, **_mlx_defaults(modules.values())}
    for name, q in modules.items():
        if q.format == "turboquant":
            path = mlx_module_path(expert_names.get(name, name))
            block[path] = {"group_size": q.group_size, "bits": q.bits or 2, "mode": "turboquant"}
    return block


def _mlx_defaults(quants) -> dict[str, Any]:
    """Top-level group_size/bits/mode for mlx-lm: the most common native format's (affine before mxfp4)."""
    qs = list(quants)
    for fmt in ("affine", "mxfp4", "turboquant"):
        for q in qs:
            if q.format == fmt:
                return {"group_size": q.group_size, "bits": q.bits or 2, "mode": q.mlx_mode}
    return {"group_size": 64, "bits": 4, "mode": "affine"}  # nothing quantized: values mlx-lm never uses


@dataclass(frozen=True)
class QuantizationBlock:
    """A tqbench conversion's quantization block, read from a config dict."""

    recipe: dict[str, Any]
    modules: dict[str, ModuleQuant]
    expert_map: str

    @classmethod
    def from_config(cls, quant: Mapping[str, Any] | None) -> QuantizationBlock | None:
        """None when the block is absent or another tool's."""
        if not isinstance(quant, Mapping) or quant.get("method") != METHOD:
            return None
        modules = {}
        for name, e in (quant.get("modules") or {}).items():
            modules[name] = ModuleQuant(e["format"], e.get("bits"), bool(e.get("ternary")), int(e["group_size"]),
                                        e.get("rotation"))
        return cls(dict(quant.get("recipe") or {}), modules, str(quant.get("expert_map", EXPERT_MAP)))

    def module(self, name: str) -> ModuleQuant | None:
        """The entry of a module; a per-expert module (`...experts.7.w1`) finds its layer's `experts.*` entry."""
        q = self.modules.get(name)
        if q is None and ".experts." in name:
            q = self.modules.get(_EXPERT_NUMBER.sub(".experts.*.", name + ".")[:-1])
        return q

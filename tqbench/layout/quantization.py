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
from pathlib import Path
from typing import Any, Mapping

from tqbench.errors import CheckpointError
from tqbench.layout.names import EXPERT_MAP, mlx_module_path

METHOD = "tqbench"
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class ModuleQuant:
    format: str  # turboquant, affine or mxfp4
    bits: int | None  # None for ternary
    ternary: bool
    group_size: int
    rotation: dict[str, Any] | None = None  # TurboQuant: {"kind", "block"}
    scales: str | None = None  # TurboQuant: how group scales were chosen ("search" or "rms"; decoding is the same)
    calibrated: bool = False  # TurboQuant: codes by calibrated rounding (recipe part `cal`; decoding is the same)

    @property
    def mlx_mode(self) -> str:
        return {"affine": "affine", "mxfp4": "mxfp4"}.get(self.format, self.format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("rotation", "scales", "calibrated"):
            if d[key] in (None, False):
                del d[key]
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


@dataclass(frozen=True, kw_only=True)
class QuantizationBlock:
    """A tqbench conversion's quantization block, read from a config dict."""

    recipe: dict[str, Any]
    modules: dict[str, ModuleQuant]
    expert_map: str

    @classmethod
    def from_config(cls, quant: Mapping[str, Any] | None,
                    source: str | Path | None = None) -> QuantizationBlock | None:
        """None when the block is absent or another tool's. Raises CheckpointError (naming `source`, the config
        file, and the entry) when an entry is not what a conversion writes."""
        if not isinstance(quant, Mapping) or quant.get("method") != METHOD:
            return None
        entries = quant.get("modules") or {}
        if not isinstance(entries, Mapping):
            raise CheckpointError("quantization.modules is not an object of module entries", source)
        modules = {name: _module_quant(name, e, source) for name, e in entries.items()}
        recipe, expert_map = quant.get("recipe") or {}, quant.get("expert_map", EXPERT_MAP)
        if not isinstance(recipe, Mapping) or not isinstance(expert_map, str):
            raise CheckpointError("quantization.recipe is not an object or quantization.expert_map not a file name",
                                  source)
        return cls(recipe=dict(recipe), modules=modules, expert_map=expert_map)

    def module(self, name: str) -> ModuleQuant | None:
        """The entry of a module; a per-expert module (`...experts.7.w1`) finds its layer's `experts.*` entry."""
        q = self.modules.get(name)
        if q is None and ".experts." in name:
            q = self.modules.get(_EXPERT_NUMBER.sub(".experts.*.", name + ".")[:-1])
        return q


FORMATS = ("turboquant", "affine", "mxfp4")
ROTATIONS = ("hadamard", "blockwise-hadamard", "none")
SCALE_RULES = ("search", "rms")


def _module_quant(name: str, e: Any, source: str | Path | None) -> ModuleQuant:
    """One `modules` entry, checked field by field."""
    def wrong(what: str) -> CheckpointError:
        return CheckpointError(f"quantization.modules[{name!r}]: {what}", source)

    if not isinstance(e, Mapping):
        raise wrong("not an object")
    fmt, bits, group, rotation = e.get("format"), e.get("bits"), e.get("group_size"), e.get("rotation")
    if fmt not in FORMATS:
        raise wrong(f"format {fmt!r} is none of {', '.join(FORMATS)}")
    if bits is not None and not (_whole(bits) and 1 <= bits <= 8):
        raise wrong(f"bits {bits!r} is not a whole number from 1 to 8")
    if not (_whole(group) and group > 0):
        raise wrong(f"group_size {group!r} is not a positive whole number")
    if rotation is not None:
        kind, block = (rotation.get("kind"), rotation.get("block")) if isinstance(rotation, Mapping) else (None, None)
        if kind not in ROTATIONS or not (block is None or (_whole(block) and block > 0)):
            raise wrong(f"rotation {rotation!r} is not {{\"kind\": {' | '.join(ROTATIONS)}, \"block\": a length}}")
    scales = e.get("scales")
    if scales is not None and scales not in SCALE_RULES:
        raise wrong(f"scales {scales!r} is none of {', '.join(SCALE_RULES)}")
    return ModuleQuant(format=fmt, bits=bits, ternary=bool(e.get("ternary")), group_size=group,
                       rotation=dict(rotation) if rotation is not None else None, scales=scales,
                       calibrated=e.get("calibrated") is True)


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

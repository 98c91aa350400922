"""The exact size preview: every source module's planned output tensors (names, dtypes, shapes, bytes) and totals.

Read from shard headers alone. The converted layout keeps source tensor names, except routed experts, which are
stacked per layer and projection into `<moe>.switch_mlp.{gate,up,down}_proj.*` with a leading expert axis.
Output tensors of one quantized Linear (out, in) (docs/turboquant.md):
- TurboQuant b-bit, group g: `weight` U32 (out, ceil(in / floor(32/b))), `scales` F16 (out, in/g), `codebook` F16
  (2^b), `signs` F16 (in), `bias` F16 (out) when the source has one; ternary packs 20 trits per word and has a
  3-entry codebook. Routed experts add a leading E axis to weight/scales/bias; codebook and signs are per layer.
  Signs are written even without rotation (all +1) so every converted file has one layout.
- MLX affine b-bit: `weight` U32 (out, in*b/32), `scales` and `biases` F16 (out, in/g).
- mxfp4 passthrough / kept mxfp4 experts: `weight` U32 (E, out, in/8) (the packed bytes viewed as uint32) and
  `scales` U8 (E, out, in/32): the source bytes. Other kept tensors: as stored.
Streamed bytes are the routed experts' per-expert tensors (weight, scales, biases, bias); codebooks and signs stay
resident with everything else. Shards: output tensors in source order, a new shard whenever the next tensor would
pass the shard size (a tensor larger than the shard size gets a shard of its own), as mlx-lm writes them.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable

from tqbench.layout.names import per_expert_name, stacked_expert_name
from tqbench.layout.shard_units import LAYOUTS, count_shards, unit_sizes
from tqbench.recipe.fit import Footprint
from tqbench.recipe.recipe import Format, Recipe, RecipeError
from tqbench.recipe.rules import Choice, choose
from tqbench.source.checkpoint import Checkpoint, Tensor
from tqbench.source.naming import Role, TensorName
from tqbench.quant.packing import codes_per_word
from tqbench.shards.header import TensorSpec

SHARD_SIZE = 5 * 2**30
SCHEMA = "tqbench.plan/1"
_FOUR_BIT_PACKS = ("mxfp4", "nvfp4")  # weight_packed holds two 4-bit codes per byte


# --- layouts (the size formulas) ---------------------------------------------------------------------------------

def turboquant_layout(prefix: str, out: int, inp: int, bits: int | None, group: int, ternary: bool = False,
                      experts: int = 0, bias: bool = False) -> tuple[TensorSpec, ...]:
    """`out * (4*ceil(in/w) + 2*in/g)` per matrix, + `2*in` signs + `2*len(codebook)` per layer (+ `2*out` bias)."""
    lead = (experts,) if experts else ()
    words = math.ceil(inp / codes_per_word(bits or 0, ternary))
    ts = [TensorSpec(name=f"{prefix}.weight", dtype="U32", shape=(*lead, out, words), streamed=bool(experts)),
          TensorSpec(name=f"{prefix}.scales", dtype="F16", shape=(*lead, out, inp // group), streamed=bool(experts)),
          TensorSpec(name=f"{prefix}.codebook", dtype="F16", shape=(3 if ternary else 2**bits,)),
          TensorSpec(name=f"{prefix}.signs", dtype="F16", shape=(inp,))]
    if bias:
        ts.append(TensorSpec(name=f"{prefix}.bias", dtype="F16", shape=(*lead, out), streamed=bool(experts)))
    return tuple(ts)


def affine_layout(prefix: str, out: int, inp: int, bits: int, group: int, experts: int = 0,
                  bias: bool = False) -> tuple[TensorSpec, ...]:
    """`out*in*b/8 + 4*out*in/g` per matrix (fp16 scales and biases), + `2*out` bias."""
    lead = (experts,) if experts else ()
    s = bool(experts)
    ts = [TensorSpec(name=f"{prefix}.weight", dtype="U32", shape=(*lead, out, inp * bits // 32), streamed=s),
          TensorSpec(name=f"{prefix}.scales", dtype="F16", shape=(*lead, out, inp // group), streamed=s),
          TensorSpec(name=f"{prefix}.biases", dtype="F16", shape=(*lead, out, inp // group), streamed=s)]
    if bias:
        ts.append(TensorSpec(name=f"{prefix}.bias", dtype="F16", shape=(*lead, out), streamed=s))
    return tuple(ts)


# --- source modules ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class SourceModule:
    """The source tensors one output module comes from: one Linear/norm/router, or all experts of one projection."""

    name: str  # output module path (routed experts: `<moe>.switch_mlp.<proj>_proj`)
    tname: TensorName  # the classification (for routed experts: of the stacked module)
    tensors: tuple[Tensor, ...]  # every source tensor, in source order
    template: tuple[Tensor, ...]  # one expert's tensors (per-expert sources), else `tensors`
    experts: int  # experts stacked here; 0 when not routed experts
    per_expert: bool  # the sources are per-expert tensors (`experts.E.w1`), stacked on output
    format: str  # source storage format of the module
    shape: tuple[int, int] | None  # logical (out, in) of one Linear (one expert), None when not a Linear

    @cached_property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @cached_property
    def source_bytes(self) -> int:
        """Computed once: the converter asks per unit, and a K3 expert module has 1,792 tensors."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, kw_only=True)
class Sources:
    """A checkpoint's tensors grouped into output modules (done once, shared by every recipe planned)."""

    checkpoint: Checkpoint
    modules: tuple[SourceModule, ...]
    warnings: tuple[str, ...] = ()


def group_sources(ckpt: Checkpoint) -> Sources:
    """Group tensors by output module, in source order: per-expert tensors of one layer and projection become one
    stacked module. Raises RecipeError when the experts of one projection differ in tensors or shapes."""
    groups: dict[str, list[Tensor]] = {}
    per_expert: dict[str, dict[int, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
    for t in ckpt.tensors:
        n = t.name
        if n.role is Role.ROUTED_EXPERT and n.expert is not None:
            key = _stacked_name(n)
            per_expert[key][n.expert].append(t)
        else:
            key = n.module
        groups.setdefault(key, []).append(t)

    modules, warnings = [], []
    for key, tensors in groups.items():
        first = tensors[0]
        if key in per_expert:
            experts = per_expert[key]
            template = experts[min(experts)]
            _check_experts_alike(key, experts, template)
            tname = replace(first.name, module=key, expert=None, stacked=True, name=f"{key}.weight")
            shape = _logical_shape(template, stacked=False)
            count = len(experts)
            if ckpt.config.num_experts and count != ckpt.config.num_experts:
                warnings.append(f"{key}: {count} of {ckpt.config.num_experts} experts present")
        else:
            template, tname = tensors, first.name
            stacked = tname.role is Role.ROUTED_EXPERT and tname.stacked
            shape = _logical_shape(tensors, stacked)
            count = _stacked_count(tensors) if stacked else 0
        modules.append(SourceModule(name=key, tname=tname, tensors=tuple(tensors), template=tuple(template),
                                    experts=count, per_expert=key in per_expert, format=first.format, shape=shape))
    if ckpt.missing:
        warnings.append(f"incomplete checkpoint: {len(ckpt.missing)} shard(s) missing, sizes undercount")
    return Sources(checkpoint=ckpt, modules=_experts_in_glu_order(modules), warnings=tuple(warnings))


_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


def _kept_experts_warnings(modules: list) -> list[str]:
    """Routed experts a recipe meant to quantize that stay at source precision: one line per module kind and reason,
    naming its layers (a model's every MoE layer would otherwise repeat the same line)."""
    kept: dict[tuple[str, str], list[tuple[int | None, int]]] = {}
    for m in modules:
        if m.role is Role.ROUTED_EXPERT and m.choice.format is Format.SOURCE and m.choice.reason != "recipe":
            number = _LAYER_NUMBER.search(m.name)
            kind = _LAYER_NUMBER.sub(".layers.N.", m.name, count=1) if number else m.name
            kept.setdefault((kind, m.choice.reason), []).append((int(number.group(1)) if number else None, m.bytes))
    lines = []
    for (kind, reason), where in kept.items():
        total = sum(b for _, b in where)
        if len(where) == 1:
            name = kind.replace(".layers.N.", f".layers.{where[0][0]}.") if where[0][0] is not None else kind
            lines.append(f"{name} stays at source precision ({reason}): {total:,} bytes")
        else:
            layers = layer_ranges(sorted(n for n, _ in where if n is not None))
            lines.append(f"{kind} stays at source precision ({reason}) in layers {layers}: {total:,} bytes")
    return lines


def layer_ranges(layers: list[int]) -> str:
    """1, 3-7, 9: consecutive layers as a range."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


_GLU_ORDER = {"gate": 0, "gate_up": 1, "up": 2, "down": 3}


def _experts_in_glu_order(modules: list[SourceModule]) -> tuple[SourceModule, ...]:
    """Each layer's run of routed-expert modules written gate, up, down (SwitchGLU's order), whatever the source
    order (K3's files hold w1, w2, w3). The order decides where shards split: this one gives K3's published 186."""
    out: list[SourceModule] = []
    run: list[SourceModule] = []

    def flush() -> None:
        out.extend(sorted(run, key=lambda r: _GLU_ORDER.get(r.tname.projection or "", len(_GLU_ORDER))))
        run.clear()

    for m in modules:
        routed = m.tname.role is Role.ROUTED_EXPERT
        if routed and (not run or run[0].tname.layer == m.tname.layer):
            run.append(m)
            continue
        flush()
        (run if routed else out).append(m)
    flush()
    return tuple(out)


def _stacked_name(n: TensorName) -> str:
    """`...experts.7.w1` -> `...switch_mlp.gate_proj`."""
    i = n.module.rfind(".experts.")
    return f"{n.module[:i]}.switch_mlp.{n.projection}_proj"


def _check_experts_alike(key: str, experts: dict[int, list[Tensor]], template: list[Tensor]) -> None:
    sig = [(t.name.param, t.entry.dtype, t.entry.shape) for t in template]
    for e, ts in experts.items():
        if [(t.name.param, t.entry.dtype, t.entry.shape) for t in ts] != sig:
            raise RecipeError(f"{key}: expert {e} has different tensors or shapes than expert {min(experts)}")


def _logical_shape(tensors: Iterable[Tensor], stacked: bool) -> tuple[int, int] | None:
    parts = {t.name.param: t for t in tensors}
    packed, weight = parts.get("weight_packed"), parts.get("weight")
    lead = 1 if stacked else 0
    if packed is not None and packed.format in _FOUR_BIT_PACKS and len(packed.entry.shape) == 2 + lead:
        rows, cols = packed.entry.shape[lead:]
        return rows, cols * 2
    if weight is not None and len(weight.entry.shape) == 2 + lead:
        rows, cols = weight.entry.shape[lead:]
        return rows, cols
    return None


def _stacked_count(tensors: Iterable[Tensor]) -> int:
    return max((t.entry.shape[0] for t in tensors if t.entry.shape), default=0)


# --- the plan ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModulePlan:
    source: SourceModule
    choice: Choice
    outputs: tuple[TensorSpec, ...]

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def role(self) -> Role:
        return self.source.tname.role

    @property
    def layer(self) -> int | None:
        return self.source.tname.layer

    @property
    def experts(self) -> int:
        """Routed experts stacked in this module (0: not routed experts)."""
        return self.source.experts if self.role is Role.ROUTED_EXPERT else 0

    def expert_name(self, expert: int | str) -> str:
        """`<moe>.experts.E.<proj>`: the source's per-expert name (`experts.E.w1`), or `<proj>_proj` for stacked
        sources."""
        s = self.source
        if s.per_expert:
            return per_expert_name(s.template[0].name.module, expert)
        return stacked_expert_name(self.name, s.tname.projection, expert)

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def streamed_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs if t.streamed)

    def to_dict(self) -> dict[str, Any]:
        s = self.source
        return {"module": s.name, "role": self.role.value, "layer": s.tname.layer, "projection": s.tname.projection,
                "experts": s.experts, "shape": list(s.shape) if s.shape else None, "source_format": s.format,
                "choice": self.choice.label, "kept_reason": self.choice.reason or None, "params": s.params,
                "source_bytes": s.source_bytes, "bytes": self.bytes, "streamed_bytes": self.streamed_bytes,
                "sources": [t.entry.name for t in s.tensors], "outputs": [t.to_dict() for t in self.outputs]}


@dataclass(frozen=True, kw_only=True)
class RoleTotal:
    role: str
    params: int
    source_bytes: int
    bytes: int

    @property
    def bits_per_weight(self) -> float | None:
        return self.bytes * 8 / self.params if self.params else None


@dataclass(frozen=True, kw_only=True)
class ExpertTotals:
    moe_layers: int
    experts_per_layer: int
    expert_layers: int  # sum over MoE layers of their experts (K3: 92 x 896 = 82,432)
    top_k: int
    bytes_per_expert: int  # one expert's page in one layer (the largest layer's)
    page_by_projection: dict[str, int]  # bytes per expert by projection, in the first MoE layer
    uniform: bool  # every MoE layer has the same page size
    streamed_bytes: int


@dataclass(frozen=True, kw_only=True)
class KeptTotal:
    reason: str
    modules: int
    bytes: int


@dataclass(frozen=True, kw_only=True)
class Plan:
    recipe: Recipe
    path: str
    model_type: str
    modules: tuple[ModulePlan, ...] = field(repr=False)
    shard_size: int
    layout: str  # streaming or stacked (tqbench.layout.shard_units)
    shards: int
    params: int
    source_bytes: int
    total_bytes: int
    streamed_bytes: int
    by_role: tuple[RoleTotal, ...]
    experts: ExpertTotals | None
    kept: tuple[KeptTotal, ...]
    warnings: tuple[str, ...]

    @property
    def resident_bytes(self) -> int:
        return self.total_bytes - self.streamed_bytes

    @property
    def bits_per_weight(self) -> float | None:
        return self.total_bytes * 8 / self.params if self.params else None

    @property
    def footprint(self) -> Footprint:
        e = self.experts
        return Footprint(total_bytes=self.total_bytes, resident_bytes=self.resident_bytes,
                         streamed_bytes=self.streamed_bytes, moe_layers=e.moe_layers if e else 0,
                         top_k=e.top_k if e else 0, bytes_per_expert=e.bytes_per_expert if e else 0)

    @cached_property
    def _by_source(self) -> dict[str, ModulePlan]:
        return {t.entry.name: m for m in self.modules for t in m.source.tensors}

    def module_for(self, source_name: str) -> ModulePlan:
        """The module a source tensor goes into (its outputs are that module's outputs)."""
        try:
            return self._by_source[source_name]
        except KeyError:
            raise RecipeError(f"no tensor {source_name!r} in {self.path}") from None

    def select(self, pattern: str) -> list[ModulePlan]:
        """Modules with a source or output tensor whose name matches a shell glob."""
        match = fnmatch.fnmatchcase
        return [m for m in self.modules
                if any(match(t.name, pattern) for t in m.outputs)
                or any(match(t.entry.name, pattern) for t in m.source.tensors)]

    def to_dict(self) -> dict[str, Any]:
        e = self.experts
        return {
            "recipe": self.recipe.to_dict(),
            "params": self.params,
            "bytes": {"total": self.total_bytes, "resident": self.resident_bytes, "streamed": self.streamed_bytes,
                      "source": self.source_bytes},
            "bits_per_weight": self.bits_per_weight,
            "shards": {"count": self.shards, "shard_size": self.shard_size, "layout": self.layout},
            "experts": None if e is None else {
                "moe_layers": e.moe_layers, "experts_per_layer": e.experts_per_layer,
                "expert_layers": e.expert_layers, "top_k": e.top_k, "bytes_per_expert": e.bytes_per_expert,
                "page_by_projection": dict(e.page_by_projection), "uniform": e.uniform,
                "streamed_bytes": e.streamed_bytes},
            "by_role": [{"role": r.role, "params": r.params, "source_bytes": r.source_bytes, "bytes": r.bytes,
                         "bits_per_weight": r.bits_per_weight} for r in self.by_role],
            "kept": [{"reason": k.reason, "modules": k.modules, "bytes": k.bytes} for k in self.kept],
            "warnings": list(self.warnings),
        }


def plan_checkpoint(ckpt: Checkpoint, recipe: Recipe, shard_size: int = SHARD_SIZE,
                    layout: str = "streaming") -> Plan:
    return make_plan(group_sources(ckpt), recipe, shard_size, layout)


def make_plan(sources: Sources, recipe: Recipe, shard_size: int = SHARD_SIZE, layout: str = "streaming") -> Plan:
    if shard_size <= 0:
        raise RecipeError(f"shard size must be positive, got {shard_size}")
    if layout not in LAYOUTS:
        raise RecipeError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    ckpt = sources.checkpoint
    modules = tuple(_plan_module(s, recipe) for s in sources.modules)
    outputs = [t for m in modules for t in m.outputs]
    total = sum(t.nbytes for t in outputs)
    streamed = sum(t.nbytes for t in outputs if t.streamed)

    roles: dict[str, list[int]] = {}
    kept: dict[str, list[int]] = {}
    for m in modules:
        r = roles.setdefault(m.role.value, [0, 0, 0])
        r[0] += m.source.params
        r[1] += m.source.source_bytes
        r[2] += m.bytes
        if m.choice.format is Format.SOURCE:
            k = kept.setdefault(m.choice.reason or "source", [0, 0])
            k[0] += 1
            k[1] += m.bytes

    warnings = list(sources.warnings)
    experts = _expert_totals(modules, ckpt.config.top_k)
    if experts is None and (recipe.experts_format is not recipe.format or recipe.ternary_experts
                            or recipe.mlp_bits is not None or recipe.expert_down_bits is not None
                            or recipe.mlp_group_size is not None):
        warnings.append(f"recipe {recipe.name} sets an expert tier, but the model has no routed experts")
    warnings += _kept_experts_warnings(modules)

    return Plan(
        recipe=recipe, path=ckpt.name, model_type=ckpt.config.model_type, modules=modules,
        shard_size=shard_size, layout=layout, shards=count_shards(unit_sizes(modules, layout), shard_size),
        params=sum(m.source.params for m in modules), source_bytes=sum(m.source.source_bytes for m in modules),
        total_bytes=total, streamed_bytes=streamed,
        by_role=tuple(RoleTotal(role=role, params=p, source_bytes=s, bytes=b) for role, (p, s, b) in roles.items()),
        experts=experts,
        kept=tuple(KeptTotal(reason=reason, modules=n, bytes=b)
                   for reason, (n, b) in sorted(kept.items(), key=lambda kv: -kv[1][1])),
        warnings=tuple(warnings))


def _plan_module(s: SourceModule, recipe: Recipe) -> ModulePlan:
    choice = choose(recipe, s.tname, s.shape, s.format)
    parts = {t.name.param: t for t in s.template}
    bias = "bias" in parts
    if choice.format is Format.TURBOQUANT:
        out, inp = s.shape
        outputs = turboquant_layout(s.name, out, inp, bits=choice.bits, group=choice.group_size, ternary=choice.ternary,
                                    experts=s.experts, bias=bias)
    elif choice.format is Format.AFFINE:
        out, inp = s.shape
        outputs = affine_layout(s.name, out, inp, bits=choice.bits, group=choice.group_size, experts=s.experts,
                                bias=bias)
    elif s.per_expert:
        outputs = _stacked_kept(s)
    elif s.experts:
        outputs = tuple(TensorSpec(name=t.entry.name, dtype=t.entry.dtype, shape=t.entry.shape,
                                   streamed=len(t.entry.shape) >= 2 and t.entry.shape[0] == s.experts)
                        for t in s.tensors)
    else:
        outputs = tuple(TensorSpec(name=t.entry.name, dtype=t.entry.dtype, shape=t.entry.shape) for t in s.tensors)
    return ModulePlan(source=s, choice=choice, outputs=outputs)


def _stacked_kept(s: SourceModule) -> tuple[TensorSpec, ...]:
    """Per-expert source tensors stacked as they are (mxfp4 packed bytes viewed as uint32)."""
    ts = []
    for t in s.template:
        p, dtype, shape = t.name.param, t.entry.dtype, t.entry.shape
        if p == "weight_packed" and s.format == "mxfp4":
            p, dtype, shape = "weight", "U32", (*shape[:-1], shape[-1] // 4)
        elif p == "weight_scale" and s.format == "mxfp4":
            p = "scales"
        ts.append(TensorSpec(name=f"{s.name}.{p}", dtype=dtype, shape=(s.experts, *shape), streamed=True))
    return tuple(ts)


def _expert_totals(modules: tuple[ModulePlan, ...], top_k: int) -> ExpertTotals | None:
    routed = [m for m in modules if m.role is Role.ROUTED_EXPERT and m.source.experts]
    if not routed:
        return None
    pages: dict[int | None, int] = defaultdict(int)
    experts: dict[int | None, int] = {}
    first_layer = routed[0].source.tname.layer
    by_projection: dict[str, int] = {}
    for m in routed:
        layer, count = m.source.tname.layer, m.source.experts
        page = m.streamed_bytes // count
        pages[layer] += page
        experts[layer] = max(experts.get(layer, 0), count)
        if layer == first_layer:
            proj = m.source.tname.projection or m.name.rpartition(".")[2]
            by_projection[proj] = by_projection.get(proj, 0) + page
    return ExpertTotals(
        moe_layers=len(pages), experts_per_layer=max(experts.values()), expert_layers=sum(experts.values()),
        top_k=top_k, bytes_per_expert=max(pages.values()), page_by_projection=by_projection,
        uniform=len(set(pages.values())) == 1, streamed_bytes=sum(m.streamed_bytes for m in routed))


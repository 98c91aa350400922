"""Summaries of a checkpoint: totals by role, layer and shard; experts; parameters and active parameters."""

from __future__ import annotations

import fnmatch
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from tqbench.source.checkpoint import Checkpoint, HubOrigin, Tensor
from tqbench.source.naming import Role

SCHEMA = "tqbench.inspect/1"
_PROJ_ORDER = {"gate": 0, "up": 1, "gate_up": 1, "down": 2}

# What a quantized format is called in reports, most specific first.
_FORMAT_NAMES = {
    "turboquant": "turboquant",
    "mlx-affine": "mlx-affine",
    "mlx-mxfp4": "mlx-mxfp4",
    "mxfp4": "compressed-tensors mxfp4-pack-quantized",
    "nvfp4": "compressed-tensors nvfp4-pack-quantized",
    "compressed-tensors": "compressed-tensors",
    "fp8": "fp8 block-scaled",
}


@dataclass(frozen=True, kw_only=True)
class Group:
    key: str
    tensors: int
    params: int
    bytes: int
    formats: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class LayerSummary:
    layer: int
    attention: str | None  # kda / mla / generic
    mlp: str | None  # moe / dense
    tensors: int
    params: int
    bytes: int
    experts: int
    expert_bytes: int


@dataclass(frozen=True, kw_only=True)
class ExpertSummary:
    moe_layers: int
    experts_per_layer: int
    top_k: int
    expert_layers: int  # moe_layers x experts (what a streaming runtime pages)
    params_per_expert: int
    bytes_per_expert: int  # one expert's page: its own tensors (or slices), what a streaming runtime reads per expert
    bytes_by_projection: dict[str, int]  # one expert of the first MoE layer, by gate / up / down
    routed_params: int
    routed_bytes: int  # every routed-expert tensor: the experts' pages and the per-layer codebooks and signs


@dataclass(frozen=True, kw_only=True)
class Summary:
    schema: str
    path: str
    model_type: str
    format: str
    complete: bool
    tensors: int
    params: int
    active_params: int
    bytes: int
    index_total_size: int | None
    by_role: tuple[Group, ...]
    by_layer: tuple[LayerSummary, ...]
    by_shard: tuple[Group, ...]
    experts: ExpertSummary | None
    missing: tuple[dict[str, Any], ...]
    hub: HubOrigin | None = None  # a checkpoint read from the hub: which commit, and what reading it fetched

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _group(key: str, tensors: list[Tensor]) -> Group:
    formats = Counter()
    for t in tensors:
        formats[t.format] += t.nbytes
    return Group(key=key, tensors=len(tensors), params=sum(t.params for t in tensors),
                 bytes=sum(t.nbytes for t in tensors), formats=tuple(f for f, _ in formats.most_common()))


def detect_format(ckpt: Checkpoint) -> str:
    """The checkpoint's quantization format in one phrase, e.g. `compressed-tensors mxfp4-pack-quantized + bf16`."""
    by_format = Counter()
    for t in ckpt.tensors:
        by_format[t.format] += t.nbytes
    quantized = [_FORMAT_NAMES[f] for f in _FORMAT_NAMES if f in by_format]
    plain = [f for f, _ in by_format.most_common() if f not in _FORMAT_NAMES]
    parts = quantized[:1] + plain[:1]
    return " + ".join(parts) if parts else "empty"


def summarize(ckpt: Checkpoint) -> Summary:
    tensors = ckpt.tensors
    by_role: dict[str, list[Tensor]] = defaultdict(list)
    by_layer: dict[int, list[Tensor]] = defaultdict(list)
    by_shard: dict[str, list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_role[t.name.role.value].append(t)
        by_shard[t.entry.shard].append(t)
        if t.name.layer is not None and t.name.role is not Role.OTHER:
            by_layer[t.name.layer].append(t)

    experts = _experts(ckpt)
    params = sum(t.params for t in tensors)
    active = params
    if experts:
        active = params - experts.routed_params + experts.top_k * experts.params_per_expert * experts.moe_layers

    return Summary(
        schema=SCHEMA,
        path=ckpt.name,
        model_type=ckpt.config.model_type,
        format=detect_format(ckpt),
        complete=ckpt.complete,
        tensors=len(tensors),
        params=params,
        active_params=active,
        bytes=ckpt.present_bytes,
        index_total_size=ckpt.index_total_size,
        by_role=tuple(_group(r.value, by_role[r.value]) for r in Role if r.value in by_role),
        by_layer=tuple(_layer(i, ts) for i, ts in sorted(by_layer.items())),
        by_shard=tuple(_group(s, ts) for s, ts in sorted(by_shard.items())),
        experts=experts,
        missing=tuple({"file": m.file, "tensors": len(m.tensors)} for m in ckpt.missing),
        hub=ckpt.origin,
    )


def _layer(i: int, tensors: list[Tensor]) -> LayerSummary:
    attention = next((t.name.attention for t in tensors if t.name.role is Role.ATTENTION), None)
    routed = [t for t in tensors if t.name.role is Role.ROUTED_EXPERT]
    mlp = "moe" if routed else "dense" if any(t.name.role is Role.DENSE_MLP for t in tensors) else None
    return LayerSummary(layer=i, attention=attention, mlp=mlp, tensors=len(tensors),
                        params=sum(t.params for t in tensors), bytes=sum(t.nbytes for t in tensors),
                        experts=_expert_count(routed), expert_bytes=sum(t.nbytes for t in routed))


def _expert_count(routed: list[Tensor]) -> int:
    ids = {t.name.expert for t in routed if t.name.expert is not None}
    stacked = [t.entry.shape[0] for t in routed
               if t.name.stacked and t.entry.shape and t.name.param not in _PER_LAYER_PARAMS]
    return max([len(ids)] + stacked)


# TurboQuant's per-layer tables: one codebook and one sign vector per projection, shared by all of a layer's experts
# (a runtime keeps them resident; they are no part of any expert's page, even when a layer has as many experts as the
# sign vector has entries).
_PER_LAYER_PARAMS = {"codebook", "signs"}


def _per_expert_axis(t: Tensor, experts: int) -> bool:
    """A stacked routed-expert tensor holds one slice per expert (its leading axis), unlike the per-layer tables."""
    return t.name.param not in _PER_LAYER_PARAMS and bool(t.entry.shape) and t.entry.shape[0] == experts


def _experts(ckpt: Checkpoint) -> ExpertSummary | None:
    routed = [t for t in ckpt.tensors if t.name.role is Role.ROUTED_EXPERT]
    if not routed:
        return None
    layers: dict[int, list[Tensor]] = defaultdict(list)
    for t in routed:
        layers[t.name.layer if t.name.layer is not None else -1].append(t)
    counts = {i: _expert_count(ts) for i, ts in layers.items()}
    # Measure one expert in the first layer that is complete (a partial download may cut a layer short).
    first = min(i for i, c in counts.items() if c == max(counts.values()))
    n_first = counts[first]
    by_proj: Counter[str] = Counter()
    params_one = 0
    first_expert = min((t.name.expert for t in layers[first] if t.name.expert is not None), default=None)
    for t in layers[first]:
        if t.name.stacked and _per_expert_axis(t, n_first):
            by_proj[t.name.projection or "?"] += t.nbytes // n_first
            params_one += t.params // n_first
        elif t.name.expert is not None and t.name.expert == first_expert:
            by_proj[t.name.projection or "?"] += t.nbytes
            params_one += t.params
    return ExpertSummary(
        moe_layers=len(layers),
        experts_per_layer=ckpt.config.num_experts or max(counts.values()),
        top_k=ckpt.config.top_k,
        expert_layers=sum(counts.values()),
        params_per_expert=params_one,
        bytes_per_expert=sum(by_proj.values()),
        bytes_by_projection=dict(sorted(by_proj.items(), key=lambda kv: _PROJ_ORDER.get(kv[0], 9))),
        routed_params=sum(t.params for t in routed),
        routed_bytes=sum(t.nbytes for t in routed),
    )


def select_tensors(ckpt: Checkpoint, pattern: str | None = None) -> list[Tensor]:
    """Tensors whose name matches a shell glob (all when `pattern` is None), in name order."""
    ts = ckpt.tensors if not pattern else [t for t in ckpt.tensors if fnmatch.fnmatchcase(t.entry.name, pattern)]
    return sorted(ts, key=lambda t: t.entry.name)


def tensor_row(t: Tensor) -> dict[str, Any]:
    n = t.name
    return {"name": t.entry.name, "shard": t.entry.shard, "dtype": t.entry.dtype, "shape": list(t.entry.shape),
            "bytes": t.nbytes, "params": t.params, "role": n.role.value, "layer": n.layer, "expert": n.expert,
            "projection": n.projection, "attention": n.attention, "format": t.format}

"""`--max-active-experts K`: route each token to K experts instead of the model's native top-k, by setting the top-k
its own router reads, so the K highest-scoring experts are kept and their weights renormalised exactly as the
model's router renormalises (K3: sigmoid scores plus correction bias, top-k weights normalised; deepseek_v3 alike;
qwen3_moe: softmax, renormalised when the model says so). A family whose router has no top-k we know is refused."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from tqbench.errors import TqbenchError


@dataclass(frozen=True, kw_only=True)
class ActiveExperts:
    native: int
    active: int
    layers: int  # MoE layers changed

    @property
    def cut(self) -> float:
        return self.native / self.active


def _knob(module: nn.Module) -> tuple[object, str] | None:
    """(object, attribute) holding a MoE block's top-k, for the routers we know."""
    if "switch_mlp" not in module:
        return None
    args = getattr(module, "args", None)
    if args is not None and hasattr(args, "num_experts_per_token"):  # kimi_k3 (the args object is shared)
        return args, "num_experts_per_token"
    gate = module.get("gate") if isinstance(module, nn.Module) else None
    if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "norm_topk_prob"):  # deepseek_v3
        return gate, "top_k"
    if hasattr(module, "top_k") and hasattr(module, "norm_topk_prob"):  # qwen3_moe
        return module, "top_k"
    return None


def top_k(block: nn.Module) -> int | None:
    """The number of experts a MoE block routes each token to now; None for a module that is not a MoE block whose
    router tqbench knows."""
    knob = _knob(block)
    return int(getattr(*knob)) if knob is not None else None


def native_top_k(model: nn.Module) -> int:
    """The top-k the model was trained with (0: no MoE router tqbench knows)."""
    for _, m in model.named_modules():
        knob = _knob(m)
        if knob is not None:
            return int(getattr(model, "_tqbench_native_top_k", None) or getattr(*knob))
    return 0


def set_active_experts(model: nn.Module, k: int) -> ActiveExperts:
    """Make every MoE layer route to `k` experts (0: native). Raises TqbenchError for a router we cannot change."""
    knobs = []
    seen = set()
    for _, m in model.named_modules():
        knob = _knob(m)
        if knob is not None:
            knobs.append(knob)
    if not knobs:
        raise TqbenchError("--max-active-experts: this model has no MoE router whose top-k tqbench knows how to "
                           "change (kimi_k3, deepseek_v3, qwen3_moe)")
    native = getattr(model, "_tqbench_native_top_k", None) or getattr(*knobs[0])
    model._tqbench_native_top_k = native  # what the model was trained with, kept across changes
    current = getattr(*knobs[0])
    k = k or native
    if not 0 < k <= native:
        raise TqbenchError(f"--max-active-experts {k}: choose 1..{native} (the model routes to {native}), or 0 for "
                           "native")
    if k == current:
        return ActiveExperts(native=native, active=k, layers=0)
    for obj, attr in knobs:
        if id(obj) not in seen:
            seen.add(id(obj))
            setattr(obj, attr, k)
    return ActiveExperts(native=native, active=k, layers=len(knobs))


def routing_changed(model: nn.Module, streamer=None) -> bool:
    """Whether the model routes otherwise than it was trained to: fewer experts per token (set_active_experts), or
    cache-aware routing on (a streamer whose config has a margin; tqbench.stream.attach.CacheRoutedBlock)."""
    native = getattr(model, "_tqbench_native_top_k", None)
    if native is not None:
        for _, m in model.named_modules():
            k = top_k(m)
            if k is not None:
                if k != native:
                    return True
                break
    return streamer is not None and streamer.config.cache_routing > 0

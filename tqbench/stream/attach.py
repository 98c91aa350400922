"""Swapping a loaded model's routed experts for streamed ones, before their stacked arrays are ever evaluated."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tqbench.errors import TqbenchError
from tqbench.layout.names import mlx_module_path
from tqbench.stream.store import ExpertStore, StoreError
from tqbench.stream.streamer import Streamer


class _Hidden:
    """Holds objects out of the module tree (parameters(), update(), eval never see them)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class StreamedExperts(nn.Module):
    """Takes the place of a MoE layer's SwitchGLU: the same SwitchGLU, called on slots the streamer filled."""

    def __init__(self, layer: int, inner: nn.Module, streamer: Streamer):
        super().__init__()
        self.layer = layer
        self._hidden = _Hidden(inner=inner, streamer=streamer)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        h = self._hidden
        if h.streamer.park is not None:  # a layer-major prefill gathers every chunk's call (tqbench.runtime.prefill)
            return h.streamer.park(self.layer, h.inner, x, indices)
        return h.streamer.run(self.layer, h.inner, x, indices)


class LookaheadBlock(nn.Module):
    """Wraps a MoE block: before it runs, the next streamed layer's router is applied to this block's input and the
    streamer starts reading those experts once this block's own are in."""

    def __init__(self, block: nn.Module, next_layer: int, next_router: Any, streamer: Streamer):
        super().__init__()
        self.block = block
        self._hidden = _Hidden(next_layer=next_layer, router=next_router, streamer=streamer)

    def __call__(self, x: mx.array) -> mx.array:
        h = self._hidden
        if x.ndim < 2 or x.shape[-2] == 1:  # decode only
            h.streamer.guess(h.next_layer, h.router(x))
        return self.block(x)


class CacheRoutedBlock(nn.Module):
    """Wraps a streamed MoE block for cache-aware routing: in decode (one position), the block's selection bias gets
    `margin` added for each of its layer's experts resident in the streamer's cache (pinned or cached) now, for this
    call only. So an uncached expert is passed over for a resident one whose score plus bias is within `margin` of its
    own, and the weights stay the model's: its unbiased scores of the experts selected, renormalised as it does. The
    picks the router would have made are handed to the streamer, which counts the substitutions."""

    def __init__(self, block: nn.Module, layer: int, bias_at: tuple[nn.Module, str], native: Any, margin: float,
                 streamer: Streamer):
        super().__init__()
        self.block = block
        self._hidden = _Hidden(layer=layer, bias_at=bias_at, native=native, margin=margin, streamer=streamer)

    def __call__(self, x: mx.array) -> mx.array:
        h = self._hidden
        if x.ndim >= 2 and x.shape[-2] > 1:  # a prefill chunk routes natively
            return self.block(x)
        h.streamer.routed_natively(h.layer, h.native(x))  # traced before the bias changes
        holder, name = h.bias_at
        bias = holder[name]
        holder[name] = bias + mx.array(h.margin * h.streamer.resident_mask(h.layer))
        try:
            return self.block(x)
        finally:
            holder[name] = bias


def selection_bias(block: nn.Module) -> tuple[nn.Module, str] | None:
    """(module, attribute) of the bias a MoE block's router adds to its scores to select experts, but not to weight
    them (kimi_k3's block, deepseek_v3's gate: e_score_correction_bias); None for a router without one."""
    if "e_score_correction_bias" in block and "gate" in block:  # kimi_k3
        return block, "e_score_correction_bias"
    gate = block.get("gate") if isinstance(block, nn.Module) else None
    if isinstance(gate, nn.Module) and "e_score_correction_bias" in gate and hasattr(gate, "norm_topk_prob"):
        return gate, "e_score_correction_bias"  # deepseek_v3
    return None


def router(block: nn.Module) -> Any:
    """A function x -> the expert indices `block`'s own router would pick, for the families we know; else None."""
    if "gate" not in block:
        return None
    gate = block["gate"]
    args = getattr(block, "args", None)
    if args is not None and hasattr(args, "num_experts_per_token") and "e_score_correction_bias" in block:
        from mlx_lm.models.kimi_k3 import _group_expert_select  # kimi_k3

        return lambda x: _group_expert_select(gate(x), block.e_score_correction_bias, top_k=args.num_experts_per_token,
                                              n_group=args.num_expert_group, topk_group=args.topk_group,
                                              routed_scaling_factor=args.routed_scaling_factor,
                                              renormalize=args.moe_renormalize)[0]
    if hasattr(gate, "top_k") and hasattr(gate, "norm_topk_prob"):  # deepseek_v3: the gate returns (inds, scores)
        return lambda x: gate(x)[0]
    if hasattr(block, "top_k"):  # qwen3_moe: softmax top-k
        return lambda x: mx.argpartition(gate(x), kth=-block.top_k, axis=-1)[..., -block.top_k:]
    return None


def attach(model: nn.Module, streamer: Streamer) -> list[str]:
    """Replace every streamed layer's `switch_mlp` with StreamedExperts whose projections read the streamer's pools.
    Returns the replaced module paths. Raises StoreError when a layer's module is not in the model."""
    modules = dict(model.named_modules())
    store: ExpertStore = streamer.store
    new = []
    for n, lay in sorted(store.layers.items()):
        candidates = (mlx_module_path(f"{lay.module}.switch_mlp"), f"{lay.module}.switch_mlp")
        path = next((p for p in candidates if p in modules), None)
        if path is None:
            raise StoreError(f"layer {n}: the model has no {candidates[0]} to stream", store.root)
        inner = modules[path]
        pool = streamer.pool_of[n]
        for part in lay.parts:
            proj = getattr(inner, part.projection, None)
            if proj is None or part.param not in proj:
                raise StoreError(f"layer {n}: {path}.{part.projection} has no {part.param!r} to stream", store.root)
            setattr(proj, part.param, pool.arrays[(part.projection, part.param)])
        new.append((path, StreamedExperts(n, inner, streamer)))
    model.update_modules(_tree(new))
    blocks = [p.rpartition(".switch_mlp")[0] for p, _ in new]
    originals = [modules[b] for b in blocks]  # before any wrapping: their routers are the model's own
    if streamer.config.cache_routing:
        _wrap_for_cache_routing(model, blocks, originals, sorted(store.layers), streamer)
    if streamer.config.lookahead:
        _wrap_for_lookahead(model, blocks, originals, sorted(store.layers), streamer)
    return [p for p, _ in new]


def _wrap_for_cache_routing(model: nn.Module, blocks: list[str], originals: list[nn.Module], layers: list[int],
                            streamer: Streamer) -> None:
    wraps = []
    for path, block, layer in zip(blocks, originals, layers):
        bias_at, native = selection_bias(block), router(block)
        if bias_at is None or native is None:
            raise TqbenchError(f"--cache-routing: {path}'s router has no selection bias to favour cached experts "
                               "with (kimi_k3 and deepseek_v3 have one); leave it at 0 for this model")
        wraps.append((path, CacheRoutedBlock(block, layer, bias_at, native=native, margin=streamer.config.cache_routing,
                                             streamer=streamer)))
    model.update_modules(_tree(wraps))


def _wrap_for_lookahead(model: nn.Module, blocks: list[str], originals: list[nn.Module], layers: list[int],
                        streamer: Streamer) -> None:
    modules = dict(model.named_modules())
    wraps = []
    for i in range(len(blocks) - 1):
        r = router(originals[i + 1])
        if r is None:
            raise StoreError(f"look-ahead: no router tqbench knows in {blocks[i + 1]}", streamer.store.root)
        wraps.append((blocks[i], LookaheadBlock(modules[blocks[i]], layers[i + 1], r, streamer)))
    model.update_modules(_tree(wraps))


def _tree(pairs: list[tuple[str, nn.Module]]) -> dict:
    from mlx.utils import tree_unflatten

    return tree_unflatten(pairs)

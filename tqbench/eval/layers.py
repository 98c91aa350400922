"""The quick mode of `tqbench eval --layers`: both models run each decoder layer on the same input, the reference
model's own input to that layer (teacher forcing), so each layer's error is its own and not the sum of the layers
before it.

The reference runs its normal forward pass with every decoder layer wrapped by a tap that keeps the layer's
arguments and output; then each of MODEL's layers runs on the kept arguments. Arguments are kept as the layer got
them: arrays as they are, and other objects (Kimi K3's attention-residual blocks, which a layer appends to) as a
shallow copy taken before the call, so both models see the same state."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tqbench.errors import TqbenchError


def layer_list(model: nn.Module) -> list:
    """The list the model's forward pass iterates (mlx-lm's `model.layers` may be a copy of it)."""
    first = model.layers[0] if len(model.layers) else None
    for _, m in model.named_modules():
        layers = m.get("layers") if isinstance(m, dict) else None
        if isinstance(layers, list) and layers and layers[0] is first:
            return layers
    raise TqbenchError("--layers: cannot find this model's decoder layers")


def _kept(v: Any) -> Any:
    if v is None or isinstance(v, (mx.array, int, float, str, bool)):
        return v
    return copy.copy(v)


def _hidden(out: Any) -> mx.array:
    """A layer's hidden-state output (K3's layers return (h, blocks))."""
    return out[0] if isinstance(out, tuple) else out


class _Tap:
    """Stands in for one decoder layer in the reference model: calls it and keeps (args, kwargs, output)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.calls: list[tuple[tuple, dict, mx.array]] = []

    def __getattr__(self, name: str) -> Any:  # the forward pass reads attributes such as K3's is_linear
        return getattr(self.layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kept = (tuple(_kept(a) for a in args), {k: _kept(v) for k, v in kwargs.items()})
        out = self.layer(*args, **kwargs)
        self.calls.append((*kept, _hidden(out)))
        return out


def describe(layer: nn.Module) -> tuple[str, str]:
    """(attention class, MLP class) of a decoder layer, as mlx-lm names them."""
    attn = next((type(layer[k]).__name__ for k in ("self_attn", "attention", "attn") if k in layer), "")
    mlp = next((type(layer[k]).__name__ for k in ("mlp", "block_sparse_moe", "feed_forward") if k in layer), "")
    return attn, mlp


def layer_errors(model: nn.Module, reference: nn.Module, inputs: mx.array) -> list[tuple[float, float]]:
    """Per decoder layer, (sum |out_M - out_S|^2, sum |out_S|^2) in float32 over the batch `inputs`, each of
    MODEL's layers run on the reference layer's own input. Evaluated before returning."""
    ref_layers, layers = layer_list(reference), layer_list(model)
    if len(ref_layers) != len(layers):
        raise TqbenchError(f"--layers: the models have {len(layers)} and {len(ref_layers)} decoder layers")
    taps = [_Tap(layer) for layer in ref_layers]
    ref_layers[:] = taps
    try:
        mx.eval(reference(inputs))
    finally:
        ref_layers[:] = [t.layer for t in taps]
    sums = []
    for tap, layer in zip(taps, layers):
        diff = ref = mx.array(0.0)
        for args, kwargs, want in tap.calls:
            args = tuple(_kept(a) for a in args)  # a fresh copy per call: a layer may append to what it gets
            got = _hidden(layer(*args, **{k: _kept(v) for k, v in kwargs.items()}))
            w = want.astype(mx.float32)
            diff = diff + mx.square(got.astype(mx.float32) - w).sum()
            ref = ref + mx.square(w).sum()
        mx.eval(diff, ref)
        sums.append((float(diff.item()), float(ref.item())))
        tap.calls.clear()
    return sums

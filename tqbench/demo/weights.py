"""Weights sources for the demo writer: a function from a tensor of the plan to its data in the file dtype (bf16 as
uint16 bits, routed experts as mxfp4 U8). Two of them: seeded random weights (each tensor from its own seed, chosen by
its name) and the float parameters of an mlx-lm kimi_k3 model mapped back to the K3 source names (the inverse of
mlx-lm's `sanitize`). Never imports MLX."""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Mapping
from functools import lru_cache

import numpy as np

from tqbench.demo.spec import DemoSpec
from tqbench.quant.mxfp4 import pack_mxfp4
from tqbench.shards.header import TensorSpec
from tqbench.shards.writer import to_bf16

# A weights source: the data of one tensor of the plan, in its file dtype (bf16 as uint16 bits, experts as U8).
WeightSource = Callable[[TensorSpec], np.ndarray]


def random_weights(seed: int) -> WeightSource:
    """Seeded random weights (each tensor from its own seed, chosen by name)."""
    return lambda t: _array(seed, t)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


@lru_cache(maxsize=1)
def _expert(seed: int, base: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """One routed expert matrix, std 1/sqrt(fan_in), packed to mxfp4 (seeded by its name without the suffix)."""
    w = _rng(seed, base).standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)
    return pack_mxfp4(w)


def _array(seed: int, t: TensorSpec) -> np.ndarray:
    """The tensor's data in its file dtype (bf16 as uint16 bits), chosen by its name."""
    name, shape = t.name, t.shape
    rng = _rng(seed, name)
    if name.endswith((".weight_packed", ".weight_scale")):
        base, packed = name.rsplit(".", 1)[0], name.endswith("_packed")
        packed_w, scales = _expert(seed, base, shape[0], shape[1] * (2 if packed else 32))
        return packed_w if packed else scales
    if name.endswith("norm.weight"):
        x = np.ones(shape)
    elif name.endswith(".A_log"):  # log of a decay rate in [1, 16], as mlx-lm and transformers initialise it
        x = np.log(rng.uniform(1.0, 16.0, shape))
    elif name.endswith(".dt_bias"):  # inverse softplus of a step in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        x = dt + np.log(-np.expm1(-dt))
    elif name.endswith(".e_score_correction_bias"):  # skewed: low-numbered experts are favoured
        x = np.linspace(0.3, -0.3, shape[0]) + 0.05 * rng.standard_normal(shape)
    elif name.endswith("embed_tokens.weight"):
        x = rng.standard_normal(shape, dtype=np.float32)
    else:  # projections [out, in] and conv1d [D, 1, k]: std 1/sqrt(fan_in)
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(math.prod(shape[1:]) ** -0.5)
    x = x.astype(np.float32)
    return to_bf16(x) if t.dtype == "BF16" else x


def mlx_weights(spec: DemoSpec, params: Mapping[str, np.ndarray],
                packed: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> WeightSource:
    """A weights source from the float parameters of mlx-lm's kimi_k3 `Model` built for `spec` (names as
    `mlx.utils.tree_flatten(model.parameters())` gives them): the inverse of that model's `sanitize`.

    Routed experts are packed with our exact mxfp4 packer, `A_log`, `dt_bias` and the router bias stay F32 and the rest
    is rounded to bf16. mlx-lm keeps one `A_log` per KDA head and reads the first `heads` values of the source's
    `[heads * head_dim]` tensor, so the per-head values are written there, repeated to fill the tensor.

    `packed` ({switch_mlp parameter name: (codes, scales)}) gives routed experts already packed, e.g. from their fp32
    values before `params` kept them in bf16; those are written as they are."""
    p = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    P = spec.kda_num_heads * spec.kda_head_dim

    @lru_cache(maxsize=1)
    def expert(key: str, e: int) -> tuple[np.ndarray, np.ndarray]:
        if packed is not None and key in packed:
            return packed[key][0][e], packed[key][1][e]
        return pack_mxfp4(p[key][e])

    def value(name: str) -> np.ndarray:
        n = name.removeprefix("language_model.")
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", n)
        if m is None:
            return p["language_model." + n]
        lp, rest = f"language_model.model.layers.{m.group(1)}", m.group(2)
        if x := re.match(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_(packed|scale)$", rest):
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[x.group(2)]
            packed, scales = expert(f"{lp}.mlp.switch_mlp.{proj}.weight", int(x.group(1)))
            return packed if x.group(3) == "packed" else scales
        if rest == "block_sparse_moe.gate.e_score_correction_bias":
            return p[f"{lp}.mlp.e_score_correction_bias"]
        if rest.startswith("block_sparse_moe."):
            return p[f"{lp}.mlp.{rest.removeprefix('block_sparse_moe.')}"]
        a = f"{lp}.self_attn."
        if x := re.match(r"self_attn\.([qkv])_proj\.weight$", rest):
            return p[a + "qkv_proj.weight"][P * "qkv".index(x.group(1)):][:P]
        if x := re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest):  # MLX [3P, k, 1] -> source [P, 1, k]
            return p[a + "qkv_conv.conv.weight"][P * "qkv".index(x.group(1)):][:P].transpose(0, 2, 1)
        if rest == "self_attn.A_log":
            return np.resize(p[a + "A_log"], P)
        if rest == "self_attn.kv_b_proj.weight":  # embed_q [H, kv_lora, nope] + unembed_out [H, v, kv_lora]
            wk, wv = p[a + "embed_q.weight"], p[a + "unembed_out.weight"]
            return np.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(-1, wk.shape[1])
        return p[f"{lp}.{rest}"]

    def source(t: TensorSpec) -> np.ndarray:
        x = value(t.name)
        if x.shape != t.shape:
            raise ValueError(f"{t.name}: the model gives shape {x.shape}, the K3 layout wants {t.shape}")
        if t.dtype == "U8":
            return x
        x = np.ascontiguousarray(x, dtype=np.float32)
        return to_bf16(x) if t.dtype == "BF16" else x

    return source

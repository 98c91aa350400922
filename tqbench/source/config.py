"""`config.json`: the few architecture facts tqbench needs, read from flat or multimodal (`text_config`) configs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqbench.errors import CheckpointError


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    raw: dict[str, Any] = field(repr=False)
    model_type: str
    hidden_size: int | None
    num_layers: int | None
    vocab_size: int | None
    num_experts: int  # routed experts per MoE layer (0: dense model)
    top_k: int
    first_dense: int  # leading layers with a dense MLP
    kda_layers: tuple[int, ...]  # 0-indexed linear-attention layers
    quantization: dict[str, Any] | None  # quantization_config / quantization block

    @property
    def text(self) -> dict[str, Any]:
        return self.raw.get("text_config") or self.raw

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_config(directory: Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    return parse_config(read_config_json(directory), path)


def read_config_json(directory: Path) -> dict[str, Any]:
    """A model directory's config.json, checked to be a model config (a JSON object with a model_type, at the top level
    or under text_config): the one reader of it. Raises CheckpointError naming the directory or the file."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError("no config.json: not a model directory", directory)
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"invalid JSON ({e})", path) from None
    if not isinstance(raw, dict):
        raise CheckpointError("not a JSON object", path)
    if not _model_type(raw):
        raise CheckpointError("no model_type (at the top level or under text_config): not a model config", path)
    return raw


def _model_type(raw: dict[str, Any]) -> str | None:
    """The model type at the top level, else under a multimodal `text_config`; None when neither has one."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    for value in (raw.get("model_type"), text.get("model_type")):
        if isinstance(value, str) and value.strip():
            return value
    return None


def parse_config(raw: dict[str, Any], source: str | Path | None = None) -> ModelConfig:
    """The facts tqbench reads, each checked: a count that is not a whole number >= 0 (a string, a list, a negative
    number) is a CheckpointError naming `source` (the config file) and the field."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    linear = text.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise CheckpointError("linear_attn_config is not an object", source)
    kda_layers = linear.get("kda_layers") or []
    if not isinstance(kda_layers, list) or not all(_count(i) and i > 0 for i in kda_layers):
        raise CheckpointError(f"linear_attn_config.kda_layers {kda_layers!r} is not a list of layer numbers (from 1)",
                              source)
    kda = tuple(i - 1 for i in kda_layers)  # the config lists them 1-indexed
    quant = _first(raw, "quantization_config", "quantization") or _first(text, "quantization_config", "quantization")

    def count(*keys: str, default: Any = None) -> Any:
        value = _first(text, *keys, default=default)
        if value is not None and not _count(value):
            key = next(k for k in keys if text.get(k) is not None)
            raise CheckpointError(f"{key} {value!r} is not a whole number >= 0", source)
        return value

    return ModelConfig(
        raw=raw,
        model_type=_model_type(raw) or "unknown",
        hidden_size=count("hidden_size", "d_model", "n_embd"),
        num_layers=count("num_hidden_layers", "n_layer", "num_layers"),
        vocab_size=count("vocab_size"),
        num_experts=count("num_experts", "n_routed_experts", "num_local_experts", default=0),
        top_k=count("num_experts_per_token", "num_experts_per_tok", "moe_topk", "top_k", default=0),
        first_dense=count("first_k_dense_replace", default=0),
        kda_layers=kda,
        quantization=quant if isinstance(quant, dict) else None,
    )


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0

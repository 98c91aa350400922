"""Names in a converted checkpoint: files, per-expert modules, and the mlx-lm module path a source module becomes."""

from __future__ import annotations

import re

from tqbench.shards.header import INDEX_FILE

__all__ = ["INDEX_FILE", "EXPERT_MAP", "REPORT", "SHARD_NAME"]
EXPERT_MAP = "expert_map.json"
REPORT = "convert-report.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the shards a conversion writes


def shard_file(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def per_expert_name(source_expert_module: str, expert: int | str) -> str:
    """The module of expert `expert` named like a source per-expert module (`<moe>.experts.7.w1` -> ...E.w1)."""
    i = source_expert_module.rfind(".experts.")
    return f"{source_expert_module[:i]}.experts.{expert}.{source_expert_module[i + len('.experts.'):].partition('.')[2]}"


def stacked_expert_name(stacked_module: str, projection: str, expert: int | str) -> str:
    """`<moe>.switch_mlp.gate_proj` of a stacked source -> `<moe>.experts.E.gate_proj`."""
    moe = stacked_module.rpartition(".switch_mlp.")[0] or stacked_module.rpartition(".experts")[0]
    return f"{moe}.experts.{expert}.{projection}_proj"


# Source names -> mlx-lm module paths, for the families whose sanitize() renames (kimi_k3: block_sparse_moe -> mlp;
# per-expert w1/w3/w2 or gate/up/down -> one stacked switch_mlp projection).
_MLX_RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(?:\d+|\*)\.(?:w1|gate_proj)$"), ".switch_mlp.gate_proj"),
    (re.compile(r"\.experts\.(?:\d+|\*)\.(?:w3|up_proj)$"), ".switch_mlp.up_proj"),
    (re.compile(r"\.experts\.(?:\d+|\*)\.(?:w2|down_proj)$"), ".switch_mlp.down_proj"),
]


def mlx_module_path(module: str) -> str:
    """The path mlx-lm's model has for a source module after its sanitize() (best effort for unknown families:
    names mlx-lm keeps are returned unchanged)."""
    for pattern, repl in _MLX_RENAMES:
        module = pattern.sub(repl, module)
    return module

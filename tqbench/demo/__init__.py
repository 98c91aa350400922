"""The built-in demo model: a tiny Kimi K3 in the layout of Moonshot's HF release.

Same config keys, tensor names, dtypes and mxfp4 compressed-tensors experts as the real checkpoint, so every tool can be
tried on it and `mlx_lm.load` runs it. Two kinds share one writer (`write_checkpoint`, which takes a weights source):

- the shipped demo (`tqbench/demo/checkpoint/`, copied into the user cache by `ensure_demo`): trained on the Python
  standard library's own source by `scripts/train_demo.py` (see docs/demo-model.md); its weights come from an mlx-lm
  model's parameters through `mlx_weights`;
- seeded random checkpoints of any `DemoSpec` (`write_source`, for tests and scaled-up benchmark models): each tensor
  from its own seed, so the files are byte-identical for a given spec and seed.

One concept per module: `install` (the shipped checkpoint and its cached copy), `spec` (the shape, its config and
tensors), `weights` (random weights, the inverse of mlx-lm's name mapping), `tokenizer` (the random demo's BPE) and
`writer` (the checkpoint writer). Nothing here imports MLX. The code that trained the shipped demo (its corpus, its
conversations, its optimizer) is the top-level `training` package, which the wheel does not carry.
"""

from tqbench.demo.install import DEMO_VERSION, SHIPPED_DEMO, demo_path, ensure_demo
from tqbench.demo.spec import (
    CHAT_SPEC,
    DEMO_SPECS,
    SHIPPED_SPEC,
    TRAINED_SPEC,
    DemoSpec,
    source_config,
    special_ids,
    tensor_plan,
    text_config,
)
from tqbench.demo.tokenizer import DEMO_CORPUS, demo_tokenizer_ranks
from tqbench.demo.weights import WeightSource, mlx_weights, random_weights
from tqbench.demo.writer import build_atomically, split_shards, write_checkpoint, write_source

__all__ = [
    "CHAT_SPEC",
    "DEMO_CORPUS",
    "DEMO_SPECS",
    "DEMO_VERSION",
    "SHIPPED_DEMO",
    "SHIPPED_SPEC",
    "TRAINED_SPEC",
    "DemoSpec",
    "WeightSource",
    "build_atomically",
    "demo_path",
    "demo_tokenizer_ranks",
    "ensure_demo",
    "mlx_weights",
    "random_weights",
    "source_config",
    "special_ids",
    "split_shards",
    "tensor_plan",
    "text_config",
    "write_checkpoint",
    "write_source",
]

"""Reading source checkpoints: shard headers, config, tensor roles, summaries. Never reads tensor data."""

from tqbench.source.checkpoint import Checkpoint, MissingShard, Tensor
from tqbench.source.opening import open_checkpoint, scan_checkpoint
from tqbench.source.naming import Role, TensorName, classify
from tqbench.source.summary import Summary, select_tensors, summarize

__all__ = ["Checkpoint", "MissingShard", "Role", "Summary", "Tensor", "TensorName", "classify", "open_checkpoint", "scan_checkpoint",
           "select_tensors", "summarize"]

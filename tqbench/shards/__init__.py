"""Safetensors shard files: header reading, the one tensor record (TensorSpec), atomic streaming writes."""

from tqbench.shards.header import DTYPE_SIZES, ShardHeader, TensorSpec, read_header
from tqbench.shards.writer import ShardWriter, header_bytes, save_shard

__all__ = ["DTYPE_SIZES", "ShardHeader", "ShardWriter", "TensorSpec", "header_bytes", "read_header", "save_shard"]

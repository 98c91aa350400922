"""Safetensors shard files: header reading, the one tensor record (TensorSpec), atomic streaming writes."""

from tqbench.shards.header import DTYPE_SIZES, ShardHeader, TensorSpec, read_header
from tqbench.shards.writer import ResumeError, ShardWriter, WriterMark, header_bytes, save_shard

__all__ = ["DTYPE_SIZES", "ResumeError", "ShardHeader", "ShardWriter", "TensorSpec", "WriterMark", "header_bytes",
           "read_header", "save_shard"]

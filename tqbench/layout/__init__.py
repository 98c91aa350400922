"""The converted checkpoint format: names, units and shards, the expert map and the quantization block.

Writers (the conversion) and readers (inspection, runtimes) share these modules, so the format has one home.
It sits below the recipe and the conversion and imports neither.
"""

from tqbench.layout.expert_map import ExpertMap, LayerExperts, TensorRange
from tqbench.layout.names import EXPERT_MAP, INDEX_FILE, REPORT, mlx_module_path, shard_file
from tqbench.layout.quantization import ModuleQuant, QuantizationBlock, quantization_block

__all__ = ["EXPERT_MAP", "INDEX_FILE", "REPORT", "ExpertMap", "LayerExperts", "ModuleQuant", "QuantizationBlock",
           "TensorRange", "mlx_module_path", "quantization_block", "shard_file"]

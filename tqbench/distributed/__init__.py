"""Several processes, one model: layers split across ranks with MLX's own distributed layer (tqbench.distributed.world)."""

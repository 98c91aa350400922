"""tqbench: a workbench for running giant Mixture-of-Experts models on one machine with MLX."""

__version__ = "0.1.0"

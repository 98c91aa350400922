"""tqbench: a workbench for running giant Mixture-of-Experts models on one machine with MLX."""

import os as _os

__version__ = "0.1.0"


def _keep_mlx_kernels() -> None:
    """MLX's CUDA build keeps the kernels it compiles at run time (about 80 s of them before a K3-shaped model's first
    token on an H200) under /tmp, which a reboot empties; keep them beside tqbench's own cubins instead, in a folder
    per MLX version as MLX does. A MLX_PTX_CACHE_DIR the user set wins."""
    if "MLX_PTX_CACHE_DIR" in _os.environ:
        return
    try:
        from importlib.metadata import version

        from tqbench.paths import cache_dir

        _os.environ["MLX_PTX_CACHE_DIR"] = str(cache_dir() / "cuda" / f"mlx-{version('mlx')}" / "ptx")
    except Exception:  # noqa: BLE001 - no metadata: MLX's own default stays
        pass


_keep_mlx_kernels()

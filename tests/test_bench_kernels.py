"""benchmarks/kernels.py on a machine without CUDA: `--launch-cost` times CUDA launches only and says so in one line
(the GPU run is the lead's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_launch_cost_without_cuda_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--launch-cost", "--skip-timing"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["--launch-cost times CUDA kernel launches (NVRTC's cubin against MLX's build); "
                                     "the default device here is Device(cpu, 0) without CUDA"]

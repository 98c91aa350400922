#!/usr/bin/env python3
"""Registers per thread of the fused kernels as ptxas allocates them (sm_90, the H200), without a GPU: the
calibration of tqbench.runtime.kernel_layout's register estimate, over every level count, 1..4 rows of x, and both
the H200's layouts with 64-bit offsets and Metal's with 32-bit offsets and `mulhi` (compiled as CUDA: `__umulhi`).

    pip download --no-deps nvidia-cuda-nvrtc nvidia-cuda-cuobjdump -d wheels
    for w in wheels/*.whl; do python -m zipfile -e "$w" cuda/; done
    chmod +x cuda/nvidia/cu13/bin/cuobjdump
    python scripts/kernel_registers.py --cuda cuda/nvidia/cu13 --out results/kernel-registers-sm90.json

Each row: the layout, the estimate, ptxas's registers and spilled bytes (stack frame and local memory, cuobjdump
-res-usage), the spilled bytes when compiled again with --maxrregcount=128 (a thread of 128 registers, as on Apple
GPUs: uncapped, ptxas takes more registers than it needs when they are free), and NVRTC's compile seconds on this
machine. Apple's compiler allocates differently; this is the nearest measurement without a
Mac.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cuda_builds_sass import nvrtc_cubin
from tqbench.runtime import kernel_layout as L
from tqbench.runtime import kernel_source as S
from tqbench.runtime import kernels as K

N, OUT = 4096, 7168
APPLE = 128  # registers an Apple GPU thread has before spilling: each kernel is compiled again capped at this


def measure(lib, cuda: Path, spec: S.Spec, metal_arith: bool) -> dict:
    cuda_dialect = S.DIALECTS["cuda"]
    if metal_arith:  # Metal's integer arithmetic in CUDA's spelling
        S.DIALECTS["cuda"] = dataclasses.replace(cuda_dialect, mulhi="__umulhi")
    try:
        source = S.cuda_program(spec, "tq")
    finally:
        S.DIALECTS["cuda"] = cuda_dialect
    t0 = time.perf_counter()
    cubin = nvrtc_cubin(lib, source, ["--gpu-architecture=sm_90"])
    compile_s = time.perf_counter() - t0
    regs, spill = usage(cuda, cubin)
    _, spill_128 = usage(cuda, nvrtc_cubin(lib, source, ["--gpu-architecture=sm_90", f"--maxrregcount={APPLE}"]))
    return dict(registers=regs, spill_bytes=spill, spill_bytes_at_128=spill_128, compile_s=round(compile_s, 2),
                cubin_bytes=len(cubin))


def usage(cuda: Path, cubin: bytes) -> tuple[int, int]:
    """(registers, bytes a thread spills: its stack frame and local memory) of a cubin's kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(cuda / "bin" / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return int(m[1]), int(m[2]) + int(m[4])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", type=Path, required=True, help="unpacked CUDA wheels: lib/libnvrtc.so.*, bin/cuobjdump")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    lib = ctypes.CDLL(str(next((a.cuda / "lib").glob("libnvrtc.so*"))))
    rows = []
    for levels in S.LEVELS:
        for batch in range(1, 5):
            for variant in ("h200", "metal"):
                if variant == "metal" and batch > L.kernel_batch(levels, N, OUT, 1, "metal"):
                    continue
                backend = "metal" if variant == "metal" else "cuda"
                spec = K.make_spec(levels, 64, N, OUT, 1, batch, False, backend=backend,
                                   wide=variant == "h200")
                est = L.registers(spec, "metal" if variant == "metal" else "cuda")
                got = measure(lib, a.cuda, spec, variant == "metal")
                row = dict(levels=levels, batch=batch, variant=variant, rows=spec.rows, lanes=spec.lanes,
                           tiles=spec.tiles, prefetch=spec.prefetch, estimate=est, **got)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        record = dict(schema="tqbench.kernel-registers/1", command="python " + " ".join(sys.argv),
                      date=time.strftime("%Y-%m-%d"), arch="sm_90", n=N, out=OUT, cap=APPLE,
                      machine=dict(cpu_count=os.cpu_count(), platform=platform.platform()), rows=rows)
        a.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Compile one fused TurboQuant kernel both ways and compare the machine code, without a GPU.

    pip download --no-deps nvidia-cuda-nvrtc nvidia-cuda-cuobjdump nvidia-cuda-runtime -d wheels
    for w in wheels/*.whl; do python -m zipfile -e "$w" cuda/; done
    LD_LIBRARY_PATH=cuda/nvidia/cu13/lib python scripts/cuda_builds_sass.py --cuda cuda/nvidia/cu13 3 4096 7168

A: the program tqbench compiles with NVRTC (`kernels.cuda_program`: no includes, its own fp16 widening). B: the same
template body as `mx.fast.cuda_kernel` wraps it (CUDA's fp16/bf16 headers, C++ names, `__half` parameters). Both go
through NVRTC for sm_90 (the H200) and `cuobjdump`; printed: registers, stack, local memory, instruction count,
global loads by width, and the cubin's size (which `mx.fast.precompiled_cuda_kernel` receives with every launch).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

from tqbench.runtime import kernels as K


def nvrtc_cubin(lib: ctypes.CDLL, source: str, options: list[str]) -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    failed = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    if failed:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        raise SystemExit(f"NVRTC: {log.value.decode(errors='replace')[:3000]}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, out)
    return out.raw


def summary(cuobjdump: Path, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    lines = [ln for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    loads = collections.Counter(m for ln in lines for m in re.findall(r"\b(LDG\.[A-Z0-9_.]+)", ln))
    return (f"registers {usage[1]}, stack {usage[2]}, shared {usage[3]}, local {usage[4]}; {len(lines)} instructions; "
            f"loads {dict(sorted(loads.items()))}; cubin {len(cubin):,} bytes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", type=Path, required=True, help="unpacked CUDA wheels: lib/libnvrtc.so.*, bin/cuobjdump, "
                                                             "include/cuda_fp16.h")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("levels", type=int, choices=K.LEVELS)
    p.add_argument("n", type=int)
    p.add_argument("out", type=int)
    a = p.parse_args()
    lib = ctypes.CDLL(str(next((a.cuda / "lib").glob("libnvrtc.so*"))))
    spec = K.make_spec(a.levels, a.group, a.n, a.out, 1, a.batch, False)
    header, body = K.kernel_source(spec, "cuda")
    mlx_like = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + header
                + "namespace mlx { namespace core { namespace cu {\n__global__ void custom_kernel_tq(const float* x, "
                "const unsigned int* w, const __half* scales, const __half* codebook, float* y) {\n"
                + body + "}\n}}}\n")
    arch = f"--gpu-architecture={a.arch}"
    for name, source, options in (("A tqbench (NVRTC, no includes)", K.cuda_program(spec, "tq"), [arch]),
                                  ("B as mx.fast.cuda_kernel wraps it", mlx_like,
                                   [arch, f"--include-path={a.cuda / 'include'}"])):
        print(f"{name}: {summary(a.cuda / 'bin' / 'cuobjdump', nvrtc_cubin(lib, source, options))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

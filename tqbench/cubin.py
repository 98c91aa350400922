"""tqbench's hand-written CUDA kernels, compiled once per machine.

`mx.fast.cuda_kernel` compiles its source with MLX's device headers in every process (2-5 s a kernel on an H200) and
MLX 0.32 keeps no disk copy of custom kernels, so a model whose Linears need dozens of kernel shapes paid minutes at
every start. Here the kernels are plain CUDA C with no includes: NVRTC (the library MLX's CUDA build loads anyway)
compiles each once for the GPU's architecture, the cubin is kept under tqbench's cache directory, and MLX launches it
with `mx.fast.precompiled_cuda_kernel`. A cubin's file name holds a digest of its source, the architecture and
NVRTC's version, so a changed kernel or toolkit never loads a stale one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from tqbench.atomic import write_bytes
from tqbench.paths import cache_dir


@dataclass(kw_only=True)
class CompileStats:
    """What this process did for its kernels (the benchmarks read it)."""

    compiled: int = 0  # cubins compiled by NVRTC
    compile_s: float = 0.0
    loaded: int = 0  # cubins read from the cache directory


STATS = CompileStats()
_lock = threading.Lock()


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process already mapped (MLX's CUDA build maps NVRTC's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if re.search(rf"/{stem}\.so[.\d]*$", path):
                    return path
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    for name in filter(None, [_loaded_library("libnvrtc"), "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("tqbench's CUDA kernels need NVRTC (libnvrtc), which MLX's CUDA build ships; not found")


@lru_cache(maxsize=1)
def architecture() -> str:
    """sm_XY of GPU 0."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    major, minor = ctypes.c_int(), ctypes.c_int()
    if (cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) or  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
            cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0)):  # ..._MINOR
        raise RuntimeError("could not read the GPU's compute capability from the CUDA driver")
    return f"sm_{major.value}{minor.value}"


@lru_cache(maxsize=1)
def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(source: str, arch: str, filename: str = "tqbench.cu") -> bytes:
    """Compile CUDA C to a cubin for `arch` with NVRTC; a compile error raises with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    headers = (0, None, None)  # no headers: count, sources, names
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), *headers):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        if lib.nvrtcCompileProgram(prog, 1, opts):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {filename}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)):
            raise RuntimeError(f"NVRTC gave no cubin for {arch}")
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def keep_mlx_kernels() -> None:
    """Point MLX's own run-time kernel cache at a folder per MLX version under tqbench's cache directory, unless the
    user set MLX_PTX_CACHE_DIR. MLX's CUDA build keeps the kernels it compiles (about 80 s of them before a K3-shaped
    model's first token on an H200) under /tmp, which a reboot empties. MLX reads the variable at its first run-time
    compile, so model loading and conversion call this before they start."""
    if "MLX_PTX_CACHE_DIR" not in os.environ:
        import mlx.core as mx

        os.environ["MLX_PTX_CACHE_DIR"] = str(cache_dir() / "cuda" / f"mlx-{mx.__version__}" / "ptx")


def cached_cubin(stem: str, source_of: Callable[[str], str]) -> tuple[str, bytes]:
    """(kernel name, cubin) of the kernel `source_of(name)` defines: read from the cache directory, or compiled and
    written there (atomically) the first time on this machine.

    The name is `stem` plus a digest of the source, the architecture and NVRTC's version: MLX keeps one module per
    kernel name in a process, and the cache keeps one file per name."""
    arch = architecture()
    key = hashlib.sha1(f"{arch} nvrtc {_nvrtc_version()}\n{source_of(stem)}".encode()).hexdigest()[:16]
    name = f"{stem}_{key}"
    path = cache_dir() / "cuda" / f"{name}.cubin"
    with _lock:
        try:
            cubin = path.read_bytes()
            STATS.loaded += 1
            return name, cubin
        except OSError:
            pass
        t0 = time.perf_counter()
        cubin = compile_cubin(source_of(name), arch, f"{stem}.cu")
        STATS.compiled += 1
        STATS.compile_s += time.perf_counter() - t0
    try:  # the cache is a convenience: where it cannot be written, each process compiles its kernels once
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, cubin, fsync=False)
    except OSError:
        pass
    return name, cubin

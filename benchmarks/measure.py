"""Measurement helpers the benchmarks share: their size options (--quick and one option per size), a process's memory
(peak and current RSS), whether OpenBLAS is loaded, and the page cache (how much of some files it holds, and dropping
them from it) so a read measures the disk, not memory."""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import sys
from pathlib import Path

import numpy as np

OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0"


def with_openblas() -> None:
    """Re-execute the running script with Debian's OpenBLAS preloaded (MLX's Linux CPU wheel ships a reference BLAS,
    about 50x slower) when the library exists, LD_PRELOAD is unset and `--no-openblas` was not given."""
    if (sys.platform.startswith("linux") and "LD_PRELOAD" not in os.environ and os.path.exists(OPENBLAS)
            and "--no-openblas" not in sys.argv):
        os.environ["LD_PRELOAD"] = OPENBLAS
        os.execv(sys.executable, [sys.executable, *sys.argv])


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024

def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def openblas_mapped() -> bool | None:
    """Whether an OpenBLAS library is mapped into this process (None where /proc is absent)."""
    try:
        with open("/proc/self/maps") as f:
            return "libopenblas" in f.read()
    except OSError:
        return None


def resident_fraction(files: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore on a shared read-only mapping), None if unsupported."""
    try:
        import ctypes
        import mmap
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        resident = total = 0
        for f in files:
            size = f.stat().st_size
            if not size:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                        return None
                    resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                    total += n
                finally:
                    libc.munmap(ctypes.c_void_p(addr), size)
            finally:
                os.close(fd)
        return resident / total if total else None
    except Exception:
        return None


def output_digest(dst: Path) -> str:
    """sha256 over a converted model's files (names and bytes) except the conversion report, whose timings differ
    from run to run (comparing whole-tree sizes made the check flaky: "seconds": 0.4 is shorter than 0.336)."""
    from tqbench.layout.names import REPORT

    h = hashlib.sha256()
    for f in sorted(p for p in dst.rglob("*") if p.is_file() and p.name != REPORT):
        h.update(str(f.relative_to(dst)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def drop_cache(files: list[Path]) -> bool:
    """fsync each file and advise the kernel to drop its cached pages (no root needed; Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def add_size_options(p, defaults: dict, quick: dict, quick_help: str | None = None) -> None:
    """A benchmark's size options: --quick (the `quick` sizes) and one --NAME per entry of `defaults` (None unless
    given, so `sizes` can tell)."""
    p.add_argument("--quick", action="store_true", help=quick_help or f"smoke run: {quick}")
    for k, v in defaults.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), help=f"default {v} (--quick: {quick[k]})")


def sizes(a, defaults: dict, quick: dict) -> dict:
    """The sizes a run uses: `quick` or `defaults`, and each size given on the command line instead."""
    return {**(quick if a.quick else defaults), **{k: getattr(a, k) for k in defaults if getattr(a, k) is not None}}

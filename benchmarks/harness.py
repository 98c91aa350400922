"""The benchmark harness: what every benchmark and measuring script shares. Measurements run in child processes
(`run_child` starts one, the child reports with `emit`), the machine and checkout a run measured (`machine_info`), a
process's memory (peak and current RSS) and whether OpenBLAS is loaded, the page cache (how much of some files it
holds, and dropping them from it) so a read measures the disk, not memory, digests of converted output, size options
(--quick and one option per size), and the JSON and log lines the scripts write."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0"
REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "BENCH-RESULT "  # the line of a child's stdout that carries its result


def with_openblas() -> None:
    """Re-execute the running script with Debian's OpenBLAS preloaded (MLX's Linux CPU wheel ships a reference BLAS,
    about 50x slower) when the library exists, LD_PRELOAD is unset and `--no-openblas` was not given."""
    if (sys.platform.startswith("linux") and "LD_PRELOAD" not in os.environ and os.path.exists(OPENBLAS)
            and "--no-openblas" not in sys.argv):
        os.environ["LD_PRELOAD"] = OPENBLAS
        os.execv(sys.executable, [sys.executable, *sys.argv])


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: on Linux its address space's high-water mark (VmHWM), which
    starts afresh at exec; ru_maxrss would not do for a child: Linux carries the parent's peak over fork and exec
    (a child of a 500 MiB parent reports 513 MiB while holding 14). Elsewhere ru_maxrss (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
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


# --- child processes --------------------------------------------------------------------------------------------------


def process_usage() -> dict:
    """What this process used so far: peak and current RSS, OpenBLAS, CPU seconds (user + system), its pid."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return dict(peak_rss=peak_rss_bytes(), rss_at_exit=current_rss_bytes(), openblas_mapped=openblas_mapped(),
                cpu_seconds_total=ru.ru_utime + ru.ru_stime, pid=os.getpid())


def emit(result: dict) -> None:
    """A child's result, with its process usage, on the line of stdout that `run_child` reads."""
    print(RESULT_MARK + json.dumps({**result, **process_usage()}), flush=True)


def run_child(script: Path | str, mode: str, args: dict, timeout: float, env: dict | None = None,
              cwd: Path | None = None) -> dict:
    """Run `script --child MODE ARGS-JSON` in a fresh Python process and return the result it emitted, with the
    process's wall seconds (`process_wall_s`); `env` is added to this process's environment."""
    cmd = [sys.executable, str(script), "--child", mode, json.dumps(args)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                       cwd=cwd)
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if p.returncode or not lines:
        raise RuntimeError(f"{mode} child failed (exit {p.returncode}):\n{p.stderr[-4000:]}{p.stdout[-2000:]}")
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result["process_wall_s"] = wall
    return result


def median(xs: list) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def source_text() -> str:
    """This repository's Python source (tqbench/), in a fixed order: real code, far more than 8,192 tokens of it (the
    long prompts of benchmarks/prefill.py and scripts/gpu_prompt_check.py)."""
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "tqbench").rglob("*.py")))


# --- models


def convert_demo(work: Path) -> Path:
    """The shipped demo converted with tq4 into `work/demo-tq4` (once: an existing output is reused)."""
    dest = work / "demo-tq4"
    if not (dest / "model.safetensors.index.json").is_file():
        code = ("import sys; from tqbench.convert import convert; from tqbench.demo import ensure_demo; "
                "from tqbench.recipe import Recipe; [None for _ in convert(ensure_demo(), sys.argv[1], "
                "Recipe.parse('tq4'))]")
        env = dict(os.environ, TQBENCH_CACHE_DIR=str(work / "cache-convert"), PYTHONPATH=str(REPO))
        subprocess.run([sys.executable, "-c", code, str(dest)], check=True, env=env, cwd=REPO)
    return dest


# --- the machine and the checkout -------------------------------------------------------------------------------------


def machine_info(work: Path | None = None, relevant: tuple[str, ...] = ()) -> dict:
    """The machine a run measured: CPUs, memory and load, Python, MLX (and mlx-lm, numpy, the GPU where CUDA is
    there), OpenBLAS in LD_PRELOAD, the work directory's file system (free bytes, device) and the checkout (commit,
    whether it is dirty, and the uncommitted files among `relevant`, the paths a measurement depends on)."""
    info: dict = dict(cpu_count=os.cpu_count(), platform=platform.platform(), machine=platform.machine(),
                      python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                      ld_preload=os.environ.get("LD_PRELOAD"),
                      openblas_preloaded="libopenblas" in os.environ.get("LD_PRELOAD", ""))
    try:
        import mlx.core as mx

        info.update(mlx_version=mx.__version__, mlx_device=str(mx.default_device()), numpy_version=np.__version__)
        if mx.cuda.is_available():
            info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                         capture_output=True, text=True).stdout.strip()
    except Exception as e:  # a machine without MLX (or its GPU build) still reports the rest
        info["mlx_version"] = f"unavailable: {e}"
    try:
        from importlib.metadata import version

        info["mlx_lm_version"] = version("mlx-lm")
    except Exception:
        pass
    try:
        info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info["load_average"] = os.getloadavg()
    except (ValueError, OSError, AttributeError):
        pass
    if work is not None:
        info["work_dir"] = str(work)
        try:
            st = os.statvfs(work)
            info["work_fs_free_bytes"] = st.f_bavail * st.f_frsize
            dev = subprocess.run(["df", "--output=source,fstype", str(work)], capture_output=True, text=True).stdout
            info["work_device"] = " ".join(dev.split()[2:]) or None
        except OSError:
            pass
    info.update(git_state(relevant))
    return info


def git_state(relevant: tuple[str, ...] = ()) -> dict:
    """The checkout's commit, whether tracked files changed, and which of those under `relevant` did."""
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        state: dict = dict(git_commit=head.strip() or None, git_dirty=bool(dirty.strip()))
        if relevant:
            mine = _git("status", "--porcelain", "--", *relevant)
            state["git_dirty_relevant"] = [ln[3:] for ln in mine.splitlines()]
        return state
    except OSError:
        return {}


def changed_paths(a: str | None, b: str | None, relevant: tuple[str, ...]) -> list[str]:
    """Files under `relevant` that differ between commits a and b."""
    return _git("diff", "--name-only", a, b, "--", *relevant).split() if a and b else []


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout


# --- what the scripts write -------------------------------------------------------------------------------------------


def dump_json(obj) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[\s*([-\d.e, \n]+?)\s*\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text) + "\n"


def log(msg: str) -> None:
    """A progress line with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

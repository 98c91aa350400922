"""The machine a plan is for: its memory, its GPU working-set limit (estimated per platform, or MLX's own on a Mac)
and the read bandwidth of the disk holding a model (measured once per disk, cached). The fit rules that judge a
plan against it are tqbench/recipe/fit.py's. Sizes are bytes, GB = 10^9 and GiB = 2^30.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqbench.atomic import write_json
from tqbench.errors import TqbenchError
from tqbench.paths import cache_dir

GB, GiB, MiB = 10**9, 2**30, 2**20
OS_MINIMUM = 1_500_000_000  # what a raised wired limit leaves the OS at least
DISK_TEST_BYTES = 128 * MiB
DISK_BLOCK = 8 * MiB  # about one K3 expert page per read


@dataclass(frozen=True, kw_only=True)
class Machine:
    memory_bytes: int
    gpu_limit_bytes: int  # the GPU working-set limit now
    raisable_limit_bytes: int | None  # macOS: what the wired limit may be raised to; None elsewhere
    platform: str  # sys.platform of the machine planned for
    disk_bytes_per_s: float | None = None
    disk_source: str = "not measured"


# --- the machine ---------------------------------------------------------------------------------------------------

def physical_memory() -> int:
    """This machine's RAM in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - every supported OS has these
        raise TqbenchError("cannot read this machine's memory size; pass --memory") from None


def default_gpu_limit(memory: int, platform: str) -> int:
    """macOS: Metal's default working-set limit as TurboQuant-MLX measured it; elsewhere all memory."""
    if platform != "darwin":
        return memory
    return int(memory * (0.66 if memory <= 36 * GB else 0.75))


def raisable_limit(memory: int, platform: str) -> int | None:
    """macOS: the highest advisable `iogpu.wired_limit_mb`, in bytes (whole MiB); None elsewhere."""
    if platform != "darwin":
        return None
    return min(int(memory * 0.9), memory - OS_MINIMUM) // MiB * MiB


def _metal_limit() -> int | None:
    """This Mac's current working-set limit from MLX, if MLX and Metal are there."""
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info["max_recommended_working_set_size"])
    except Exception:
        return None


def machine(memory: int | None = None, gpu_limit: int | None = None, platform: str | None = None,
            disk_bytes_per_s: float | None = None, disk_source: str | None = None) -> Machine:
    """A machine to plan for: this one by default, or the memory/limit/platform given."""
    platform = platform or sys.platform
    here = memory is None and platform == sys.platform
    memory = physical_memory() if memory is None else memory
    if gpu_limit is None:
        gpu_limit = (_metal_limit() if here and platform == "darwin" else None) or default_gpu_limit(memory, platform)
    source = disk_source or ("given" if disk_bytes_per_s is not None else "not measured")
    return Machine(memory_bytes=memory, gpu_limit_bytes=gpu_limit,
                   raisable_limit_bytes=raisable_limit(memory, platform), platform=platform,
                   disk_bytes_per_s=disk_bytes_per_s, disk_source=source)


# --- disk bandwidth ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DiskSpeed:
    bytes_per_s: float
    method: str  # O_DIRECT, F_NOCACHE, fadvise DONTNEED, or page cache (then the figure is inflated)
    size: int
    directory: str
    measured_at: float
    cached: bool = False
    own_files: bool = False  # read from the checkpoint's own files (its directory was not writable), not a test file

    @property
    def source(self) -> str:
        """Where the figure comes from, as every face says it: `measured, O_DIRECT` or `measured earlier, ...`."""
        files = ", reading the checkpoint's files" if self.own_files else ""
        return f"measured{' earlier' if self.cached else ''}, {self.method}{files}"


def disk_cache_file() -> Path:
    return cache_dir() / "disk.json"


def disk_key(path: str | Path | None) -> str:
    """The cache key of the disk holding `path` (the temp directory's when None): its device number."""
    return str(os.stat(path if path is not None else tempfile.gettempdir()).st_dev)


def cached_disk_speed(path: str | Path | None) -> DiskSpeed | None:
    """The cached figure for the disk holding `path`, or None (never measures)."""
    return _cached(_read_cache(), disk_key(path))


def disk_speed(path: str | Path | None) -> DiskSpeed:
    """The one read-bandwidth figure for the disk holding `path` (a checkpoint or model directory), which every face
    shows: `tqbench plan`, the TUI's Recipe screen and a streamed chat. The cached figure for that disk, else one
    measurement cached under the disk's device number, so that every directory on the disk gets the same figure: a
    test file written and read back in `path` (~0.5 s), or, when `path` is not a writable directory, up to as much of
    its own safetensors files read (nothing written). Raises OSError when neither can be done."""
    known = cached_disk_speed(path)
    if known is not None:
        return known
    where = Path(path if path is not None else tempfile.gettempdir())
    if where.is_dir() and os.access(where, os.W_OK):
        return measure_disk(where)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    return _remember(disk_key(where), replace(file_read_speed(files), own_files=True))


def measure_disk(directory: str | Path | None = None, size: int = DISK_TEST_BYTES, block: int = DISK_BLOCK,
                 refresh: bool = False) -> DiskSpeed:
    """Sequential read bandwidth of the disk holding `directory` (default: the temp directory), from a short test:
    write `size` bytes to a temp file there, sync, then read it back in `block`-sized reads, bypassing the page cache
    where the OS allows (O_DIRECT on Linux, F_NOCACHE on macOS, else posix_fadvise DONTNEED). A file system that
    ignores both (tmpfs, some overlays) serves the reads from memory and inflates the figure: `method` says which
    path ran. Results are cached per device in `cache_dir()/disk.json`; `refresh` measures again."""
    directory = Path(directory or tempfile.gettempdir())
    key = disk_key(directory)
    if not refresh and (known := _cached(_read_cache(), key)) is not None:
        return known
    block = max(mmap.PAGESIZE, block // mmap.PAGESIZE * mmap.PAGESIZE)
    size = max(block, size // block * block)
    fd, tmp = tempfile.mkstemp(prefix=".tqbench-disk-", dir=directory)
    try:
        data = os.urandom(block)
        for offset in range(0, size, block):
            os.pwrite(fd, data, offset)
        os.fsync(fd)
        method, seconds = _timed_read(fd, tmp, size, block)
    finally:
        os.close(fd)
        os.unlink(tmp)
    return _remember(key, DiskSpeed(bytes_per_s=size / seconds, method=method, size=size, directory=str(directory),
                                    measured_at=time.time()), refresh)


def file_read_speed(files: list[Path], limit: int = DISK_TEST_BYTES, block: int = DISK_BLOCK) -> DiskSpeed:
    """Sequential read bandwidth from existing files (a checkpoint's shards): up to `limit` bytes in whole
    `block`-sized reads, the page cache bypassed where the OS allows (as measure_disk). Writes nothing and caches
    nothing (disk_speed caches it). Raises OSError when nothing can be read."""
    block = max(mmap.PAGESIZE, block // mmap.PAGESIZE * mmap.PAGESIZE)
    done, seconds, method = 0, 0.0, "O_DIRECT"
    for f in sorted(files, key=lambda f: -os.path.getsize(f)):
        n = min(os.path.getsize(f), limit - done) // block * block
        if n <= 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            m, t = _timed_read(fd, str(f), n, block)
        finally:
            os.close(fd)
        method = m if m != "O_DIRECT" else method
        done, seconds = done + n, seconds + t
        if done >= limit:
            break
    if not done:
        raise OSError("no file holds a whole read block")
    return DiskSpeed(bytes_per_s=done / seconds, method=method, size=done, directory=str(Path(files[0]).parent),
                     measured_at=time.time())


def _read_cache() -> dict:
    try:
        doc = json.loads(disk_cache_file().read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached(cache: dict, key: str) -> DiskSpeed | None:
    entry = cache.get(key)
    try:
        return DiskSpeed(**{**entry, "cached": True}) if isinstance(entry, dict) else None
    except TypeError:
        return None  # an older or foreign entry: measured again


def _remember(key: str, speed: DiskSpeed, replace_known: bool = False) -> DiskSpeed:
    """Cache `speed` as its disk's figure and return it. When another process cached a figure for the disk meanwhile
    (and not `replace_known`), that one is kept and returned, so that every face shows one figure per disk."""
    cache = _read_cache()
    if not replace_known and (known := _cached(cache, key)) is not None:
        return known
    entry = asdict(speed)
    entry.pop("cached")
    cache[key] = entry
    try:
        disk_cache_file().parent.mkdir(parents=True, exist_ok=True)
        write_json(disk_cache_file(), cache, fsync=False)
    except OSError:
        pass  # a read-only cache directory only costs a measurement next time
    return speed


def _timed_read(fd: int, path: str, size: int, block: int) -> tuple[str, float]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct and hasattr(os, "preadv"):
        try:
            rfd = os.open(path, os.O_RDONLY | direct)
        except OSError:
            rfd = -1
        if rfd >= 0:
            try:
                buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
                return "O_DIRECT", _read_all(lambda off: os.preadv(rfd, [buf], off), size, block)
            except OSError:
                pass  # the file system refused direct reads
            finally:
                os.close(rfd)
    method = "page cache (may be inflated)"
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            method = "F_NOCACHE"
        except OSError:
            pass
    elif hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        method = "fadvise DONTNEED"
    buf = bytearray(block)
    return method, _read_all(lambda off: os.preadv(fd, [buf], off) if hasattr(os, "preadv")
                             else len(os.pread(fd, block, off)), size, block)


def _read_all(read, size: int, block: int) -> float:
    start = time.perf_counter()
    for offset in range(0, size, block):
        if read(offset) <= 0:
            raise OSError("short read")
    return max(time.perf_counter() - start, 1e-9)


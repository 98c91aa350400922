"""Will it fit: a plan's footprint against a machine's memory, GPU working-set limit and disk bandwidth.

Rules (docs/expert-streaming.md):
- resident: the whole model + a 3 GB reserve (1.1 GB runtime + 1.9 GB KV cache) fits under the GPU working-set limit;
- resident after raising the limit (macOS): it fits under the limit `sudo sysctl iogpu.wired_limit_mb=N` allows. The
  default Metal limit is estimated as TurboQuant-MLX measured it (66% of RAM up to 36 GB, 75% above); the raised limit
  is 90% of RAM while leaving the OS at least 1.5 GB (TurboQuant-MLX's planner rule);
- streaming (MoE only): non-expert weights + reserve + one layer's top-k experts fit; the expert cache gets
  the rest: budget = limit - resident bytes - 3 GB (TurboQuant-MLX's `--cache-budget-gb auto`);
- otherwise it does not fit. Dense models are resident or do not fit.
Disk bound: tok/s <= bandwidth / (MoE layers x K x bytes per expert x (1 - hit rate)). Without a given hit rate the
estimate is the fraction of experts the cache holds (uniform routing); real routing is skewed, so real hit rates are
higher. Everything here is a plain frozen value; sizes are bytes, GB = 10^9 and GiB = 2^30.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from fractions import Fraction
from pathlib import Path

from tqbench.atomic import write_json
from tqbench.errors import TqbenchError
from tqbench.paths import cache_dir

GB, GiB, MiB = 10**9, 2**30, 2**20
RUNTIME_RESERVE = 1_100_000_000
KV_RESERVE = 1_900_000_000
RESERVE = RUNTIME_RESERVE + KV_RESERVE
OS_MINIMUM = 1_500_000_000  # what a raised wired limit leaves the OS at least
DISK_TEST_BYTES = 128 * MiB
DISK_BLOCK = 8 * MiB  # about one K3 expert page per read


class Verdict(StrEnum):
    RESIDENT = "resident"
    RESIDENT_RAISED = "resident after raising the GPU wired limit"
    STREAMING = "streaming"
    NO_FIT = "does not fit"


@dataclass(frozen=True)
class Footprint:
    """What a converted model needs: all of it, the non-expert part, and the routed-expert pages."""

    total_bytes: int
    resident_bytes: int  # everything but routed-expert pages
    streamed_bytes: int  # routed-expert weight/scales, paged per expert
    moe_layers: int = 0
    top_k: int = 0
    bytes_per_expert: int = 0  # one expert's page in one layer (the largest layer's when they differ)

    @property
    def is_moe(self) -> bool:
        return self.streamed_bytes > 0


@dataclass(frozen=True)
class Machine:
    memory_bytes: int
    gpu_limit_bytes: int  # the GPU working-set limit now
    raisable_limit_bytes: int | None  # macOS: what the wired limit may be raised to; None elsewhere
    platform: str  # sys.platform of the machine planned for
    disk_bytes_per_s: float | None = None
    disk_source: str = "not measured"


@dataclass(frozen=True)
class Fit:
    verdict: Verdict
    memory_bytes: int
    gpu_limit_bytes: int
    limit_bytes: int  # the limit the verdict assumes (raised where that is the advice)
    reserve_bytes: int
    needed_bytes: int  # resident: total + reserve; streaming: resident + reserve + one layer's top-k experts
    wired_limit_mb: int | None  # N for `sudo sysctl iogpu.wired_limit_mb=N` when the advice is to raise it
    command: str | None
    cache_budget_bytes: int | None  # auto expert-cache budget (MoE models that fit only)
    top_k: int
    reduced_k: int
    bytes_per_token: int  # expert bytes one token reads at native top-k (0 for dense models)
    bytes_per_token_reduced: int  # at reduced_k
    hit_rate: float | None
    hit_rate_source: str  # given, cache fraction (uniform routing), resident, dense model, does not fit
    disk_bytes_per_s: float | None
    tok_s_ceiling: float | None  # disk-bound ceiling at top_k; None when not disk-bound or no bandwidth
    tok_s_ceiling_reduced: float | None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


# --- sizes -------------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]i?)?(b?)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """`512GB` -> 512 * 10^9, `64GiB` -> 64 * 2^30, `1.5TB`, `4096` (bytes). Exact: decimal arithmetic, and the result
    must be a whole number of bytes. K/M/G/T without `i` are decimal (SI), with `i` binary."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise TqbenchError(f"cannot read {text!r} as a size (examples: 512GB, 64GiB, 1.5TB, 4096)")
    unit = (m.group(2) or "").lower()
    value = Fraction(m.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise TqbenchError(f"size {text!r} is not a whole number of bytes")
    return int(value)


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
    return Machine(memory, gpu_limit, raisable_limit(memory, platform), platform, disk_bytes_per_s, source)


# --- the verdict ---------------------------------------------------------------------------------------------------

def assess(fp: Footprint, m: Machine, hit_rate: float | None = None, reduced_k: int | None = None) -> Fit:
    """The verdict, cache budget, bytes per token and disk-bound ceilings of one footprint on one machine."""
    if hit_rate is not None and not 0.0 <= hit_rate <= 1.0:
        raise TqbenchError(f"hit rate must be between 0 and 1, got {hit_rate}")
    top_k = fp.top_k if fp.is_moe else 0
    reduced = (reduced_k if reduced_k is not None else max(1, top_k // 2)) if fp.is_moe else 0
    if fp.is_moe and not 1 <= reduced <= max(top_k, 1):
        raise TqbenchError(f"reduced K must be between 1 and the native top-k {top_k}, got {reduced}")
    raised = max(m.gpu_limit_bytes, m.raisable_limit_bytes or 0)
    whole = fp.total_bytes + RESERVE
    streaming = fp.resident_bytes + RESERVE + top_k * fp.bytes_per_expert

    if whole <= m.gpu_limit_bytes:
        verdict, limit, needed = Verdict.RESIDENT, m.gpu_limit_bytes, whole
    elif whole <= raised:
        verdict, limit, needed = Verdict.RESIDENT_RAISED, raised, whole
    elif fp.is_moe and streaming <= raised:
        verdict, limit, needed = Verdict.STREAMING, raised, streaming
    else:
        verdict, limit, needed = Verdict.NO_FIT, raised, whole if not fp.is_moe else streaming
    wired = limit // MiB if verdict is not Verdict.NO_FIT and limit > m.gpu_limit_bytes else None
    command = f"sudo sysctl iogpu.wired_limit_mb={wired}" if wired else None

    budget = None
    if fp.is_moe and verdict is not Verdict.NO_FIT:
        budget = max(0, limit - fp.resident_bytes - RESERVE)
    per_token = fp.moe_layers * top_k * fp.bytes_per_expert
    per_token_reduced = fp.moe_layers * reduced * fp.bytes_per_expert
    if not fp.is_moe:
        hit, hit_source = None, "dense model"
    elif verdict is Verdict.NO_FIT:
        hit, hit_source = None, "does not fit"
    elif verdict in (Verdict.RESIDENT, Verdict.RESIDENT_RAISED):
        hit, hit_source = 1.0, "resident"
    elif hit_rate is not None:
        hit, hit_source = hit_rate, "given"
    else:
        hit, hit_source = min(1.0, (budget or 0) / fp.streamed_bytes), "cache fraction (uniform routing)"
    return Fit(verdict, m.memory_bytes, m.gpu_limit_bytes, limit, RESERVE, needed, wired, command, budget, top_k,
               reduced, per_token, per_token_reduced, hit, hit_source, m.disk_bytes_per_s,
               ceiling(m.disk_bytes_per_s, per_token, hit), ceiling(m.disk_bytes_per_s, per_token_reduced, hit))


def ceiling(disk_bytes_per_s: float | None, bytes_per_token: int, hit_rate: float | None) -> float | None:
    """Disk-bound tokens per second: bandwidth / (bytes per token x miss rate). None when nothing is read from disk
    (no experts, a hit rate of 1, or no bandwidth known)."""
    if not disk_bytes_per_s or not bytes_per_token or hit_rate is None or hit_rate >= 1.0:
        return None
    return disk_bytes_per_s / (bytes_per_token * (1.0 - hit_rate))


# --- disk bandwidth ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
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
    return _remember(key, DiskSpeed(size / seconds, method, size, str(directory), time.time()), refresh)


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
    return DiskSpeed(done / seconds, method, done, str(Path(files[0]).parent), time.time())


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


"""The machine the Recipe screen plans for: this one by default, or a typed memory size and disk bandwidth.

The UI never runs the disk test by itself (it writes 128 MiB and takes seconds): the default bandwidth is the cached
measurement `tqbench plan` leaves (per disk, in tqbench.recipe.fit.disk_cache_file()) for the checkpoint's disk or
the temp directory's, as the CLI looks them up; without one, DEFAULT_DISK_GBPS.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqbench.errors import TqbenchError
from tqbench.recipe.fit import GB, Machine, disk_cache_file, machine, parse_size

# A typical PCIe 4 NVMe SSD reads ~6-7 GB/s (docs/expert-streaming.md); Apple internal SSDs ~13-17.5 GB/s.
DEFAULT_DISK_GBPS = 6.0


@dataclass(frozen=True)
class DiskDefault:
    gbps: float
    source: str  # "measured (O_DIRECT)" (a cached measurement) or "typical NVMe, assumed"


def default_disk(path: Path | str | None) -> DiskDefault:
    """The cached measurement for the disk holding `path` (else the temp directory), or DEFAULT_DISK_GBPS."""
    try:
        cache = json.loads(disk_cache_file().read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache, dict):
        for directory in (path, tempfile.gettempdir()):
            if directory is None:
                continue
            try:
                entry = cache.get(str(os.stat(directory).st_dev))
            except OSError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float)) \
                    and entry["bytes_per_s"] > 0:
                method = entry.get("method")
                return DiskDefault(entry["bytes_per_s"] / GB, f"measured ({method})" if method else "measured")
    return DiskDefault(DEFAULT_DISK_GBPS, "typical NVMe, assumed")


def read_memory(text: str) -> int | None:
    """A typed memory size in bytes (`512GB`, `64GiB`); None for an empty field (this machine).
    Raises TqbenchError with a one-line message."""
    text = text.strip()
    if not text:
        return None
    value = parse_size(text)
    if value <= 0:
        raise TqbenchError(f"memory size must be positive, got {text!r}")
    return value


def read_gbps(text: str, default: float) -> float:
    """A typed disk bandwidth in GB/s; `default` for an empty field. Raises TqbenchError with a one-line message."""
    text = text.strip().removesuffix("GB/s").removesuffix("gb/s").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise TqbenchError(f"cannot read {text!r} as GB/s (example: 6 or 1.8)") from None
    if not value > 0 or value == float("inf"):
        raise TqbenchError(f"disk bandwidth must be a positive number of GB/s, got {text!r}")
    return value


def plan_machine(memory: int | None, gbps: float) -> Machine:
    """What `tqbench plan --memory M --disk-gbps G` plans for (memory None: this machine)."""
    return machine(memory, None, None, gbps * GB)

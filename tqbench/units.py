"""Human-readable sizes and counts, shared by the CLI and the TUI. GB and GiB are always told apart."""

from __future__ import annotations

import humanize


def gb(n: int | float) -> str:
    """Decimal units: 1.56 TB (576 B below a kB, as B everywhere, not humanize's "576 Bytes")."""
    return f"{int(n)} B" if abs(n) < 1000 else humanize.naturalsize(n, format="%.2f")


def bandwidth(bytes_per_s: float) -> str:
    """A disk's read bandwidth, as every face shows it: `0.83 GB/s`."""
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def gib(n: int | float) -> str:
    """Binary units: 1.42 TiB (576 B below a KiB)."""
    return f"{int(n)} B" if abs(n) < 1024 else humanize.naturalsize(n, binary=True, format="%.2f")


def size(n: int | float) -> str:
    """Both: `1.56 TB (1.42 TiB)`."""
    return f"{gb(n)} ({gib(n)})"


def count(n: int | float) -> str:
    """Parameter counts: 2.78 T, 105.36 B, 33.03 M."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))


def clock(seconds: float | None) -> str:
    """Time left as h:mm:ss (rich's own progress columns write it so); unknown: -:--:--."""
    if seconds is None:
        return "-:--:--"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"

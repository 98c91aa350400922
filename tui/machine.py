"""The machine the Recipe screen plans for: this one by default, or a typed memory size and disk bandwidth.

The disk bandwidth by default is the engine's one figure for the checkpoint's disk (tqbench.machine.disk_speed, as
`tqbench plan` and a streamed chat show it: the cached measurement, else one short measurement, cached per disk); the
Recipe editor runs it in a thread worker. This module only reads what the user types.
"""

from __future__ import annotations

from tqbench.errors import TqbenchError
from tqbench.machine import Machine, machine
from tqbench.recipe.fit import parse_size


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


def read_gbps(text: str, default: float | None) -> float | None:
    """A typed disk bandwidth in GB/s; `default` for an empty field (None while it is being measured).
    Raises TqbenchError with a one-line message."""
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


def plan_machine(memory: int | None, disk_bytes_per_s: float | None, disk_source: str | None = None) -> Machine:
    """What `tqbench plan --memory M` plans for with this disk bandwidth (memory None: this machine; bandwidth
    None: unknown)."""
    return machine(memory, None, None, disk_bytes_per_s, disk_source)

"""UI state kept between runs: the checkpoint opened last, and where each checkpoint was last converted with each
recipe (JSON in tqbench.paths.state_file())."""

from __future__ import annotations

from pathlib import Path

from tqbench.state import load_state as _load
from tqbench.state import save_state as _save


def source_name(ckpt) -> str:
    """How a screen names a checkpoint (tqbench.source.Checkpoint): its directory, or the hub repository."""
    return ckpt.label if ckpt.origin else display_path(ckpt.path)


def source_ref(ckpt) -> str:
    """What opens the checkpoint again: its directory, or `owner/name@revision` on the hub."""
    return f"{ckpt.origin.repo_id}@{ckpt.origin.revision}" if ckpt.origin else str(ckpt.path)


def last_checkpoint() -> Path | None:
    """The remembered checkpoint directory, if it is recorded and still exists."""
    last = _load().get("last_checkpoint")
    if isinstance(last, str) and Path(last).is_dir():
        return Path(last)
    return None


def remember_checkpoint(path: Path) -> None:
    """Record `path` (absolute) as the last checkpoint."""
    data = _load()
    data["last_checkpoint"] = str(Path(path).resolve())
    _save(data)


def remember_conversion(source: Path, recipe: str, dest: Path, shard_size: str) -> None:
    """Record where `source` was last converted with `recipe` (and the shard size typed), so the Convert screen offers
    the same destination again (to resume it)."""
    data = _load()
    conversions = data.get("conversions")
    if not isinstance(conversions, dict):
        conversions = {}
    conversions[f"{Path(source).resolve()}|{recipe}"] = {"dest": str(Path(dest).resolve()),
                                                         "shard_size": shard_size}
    data["conversions"] = conversions
    _save(data)


def last_conversion(source: Path, recipe: str) -> tuple[Path, str] | None:
    """The destination and shard size `source` was last converted into with `recipe`, if recorded."""
    conversions = _load().get("conversions")
    entry = conversions.get(f"{Path(source).resolve()}|{recipe}") if isinstance(conversions, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("dest"), str) and isinstance(entry.get("shard_size"), str):
        return Path(entry["dest"]), entry["shard_size"]
    return None


def display_path(path: Path) -> str:
    """A short form of `path` for the screen: relative to the working directory if under it, else `~/...`."""
    p = Path(path).expanduser()
    try:
        absolute = p.resolve()
    except OSError:
        return str(p)
    for base, prefix in ((Path.cwd(), ""), (Path.home(), "~/")):
        if base == Path(base.anchor):
            continue  # everything is under the root: no shorter form
        try:
            rel = absolute.relative_to(base)
        except ValueError:
            continue
        return prefix + str(rel) if str(rel) != "." else (prefix.rstrip("/") or ".")
    return str(absolute)

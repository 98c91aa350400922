"""UI state kept between runs: the checkpoint opened last (JSON in tqbench.paths.state_file())."""

from __future__ import annotations

import json
from pathlib import Path

from tqbench.paths import state_file


def last_checkpoint() -> Path | None:
    """The remembered checkpoint directory, if it is recorded and still exists."""
    try:
        data = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None
    last = data.get("last_checkpoint") if isinstance(data, dict) else None
    if isinstance(last, str) and Path(last).is_dir():
        return Path(last)
    return None


def remember_checkpoint(path: Path) -> None:
    """Record `path` (absolute) as the last checkpoint; a cache that cannot be written is not an error."""
    file = state_file()
    try:
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data["last_checkpoint"] = str(Path(path).resolve())
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(file.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(file)
    except OSError:
        pass


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

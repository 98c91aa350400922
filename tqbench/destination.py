"""Where a conversion goes, as a face asks for it: the default output directory, the output directory and shard size
a user typed (read and checked before anything is planned), and what a destination's status lets the user do.

No MLX here (tqbench.convert imports it): a face reads its fields on its own thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqbench.errors import TqbenchError
from tqbench.recipe import Recipe, parse_size
from tqbench.writable import OutputError, check_output_dir

if TYPE_CHECKING:
    from tqbench.convert import DestinationStatus

DEFAULT_SHARD_SIZE = "5GiB"  # as a user types it


@dataclass(frozen=True, kw_only=True)
class Output:
    """An output directory and shard size to plan a conversion for."""

    dest: Path
    shard_size: int


def default_dest(source: Path, recipe_name: str) -> Path:
    """`<source dir>-<canonical recipe name>` next to the source (`tq4` -> `-tq4-g64`): where a conversion of `source`
    with that recipe goes unless the user names another directory (the TUI's Convert screen, `tqbench chat`'s demo)."""
    return source.parent / f"{source.name}-{Recipe.parse(recipe_name).name}"


def source_base(ckpt) -> Path:
    """The path a checkpoint's outputs are named after (`default_dest`) and remembered by: its directory, or for a hub
    repository `./<name>` (its directory in the Hugging Face cache is no place for an output)."""
    return Path.cwd() / ckpt.origin.repo_id.rsplit("/", 1)[-1] if ckpt.origin else ckpt.path


def read_output(source: Path, dest: str, shard_size: str) -> Output:
    """The output typed for converting `source`; OutputError (one line) when the directory is missing, the source or
    inside it, cannot be made or written into (`check_output_dir`), or the shard size is unreadable or not
    positive."""
    dest = dest.strip()
    if not dest:
        raise OutputError("type an output directory")
    path = Path(dest).expanduser()
    try:
        size = parse_size(shard_size.strip())
    except TqbenchError as e:
        raise OutputError(f"shard size: {e}") from None
    if size <= 0:
        raise OutputError("shard size: must be positive")
    src, target = source.resolve(), path.resolve()
    if target == src or src in target.parents:
        raise OutputError("the output directory must not be the source or inside it")
    check_output_dir(path)
    return Output(dest=path, shard_size=size)


def can_start(status: DestinationStatus) -> bool:
    """Converting into the destination starts or resumes without deleting anything."""
    return status.state in ("new", "resumable")


def can_replace(status: DestinationStatus) -> bool:
    """Converting into the destination needs its conversion deleted first (after the user agreed): one of another
    recipe or source, or a complete one converted again. Files that are no conversion are never replaced."""
    return status.state in ("conflict", "complete")


def kept_shards(status: DestinationStatus, replace: bool) -> tuple[bool, ...]:
    """Per output shard, whether a run starting now finds it finished: none of them when it replaces the output."""
    return (False,) * len(status.finished) if replace else status.finished

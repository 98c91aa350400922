"""Sharing a model's learned profile: export it to a file, import a file in its place (`tqbench profile export` and
`import`, and the TUI's Profile screen)."""

from __future__ import annotations

from pathlib import Path

from tqbench.profile.choose import identify, read_file
from tqbench.profile.profile import Profile, ProfileError
from tqbench.profile.store import ProfileStore


def export_learned(model: str | Path, store: ProfileStore, dest: str | Path | None = None) -> Profile:
    """The model's learned profile, written atomically to `dest` if given (as `Profile.to_text`). Raises ProfileError
    (one line) when nothing was learned yet, OSError when `dest` cannot be written."""
    from tqbench.atomic import write_bytes

    fp, geo = identify(model)
    p = store.load(fp, geo)
    if p.routings <= 0:
        raise ProfileError(f"no learned profile for this model yet (fingerprint {fp}): chat with it first", model)
    if dest is not None:
        write_bytes(Path(dest), p.to_text().encode())
    return p


def import_file(model: str | Path, file: str | Path, store: ProfileStore,
                force: bool = False) -> tuple[Profile, Profile]:
    """Replace the model's learned profile with `file`, validated first (read_file: nothing is stored when it fails).
    Returns (the imported profile, the learned one it replaced)."""
    fp, geo = identify(model)
    p = read_file(file, fp, geo, force)
    old = store.load(fp, geo)
    store.put(p)
    return p, old

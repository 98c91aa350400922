"""Sharing a model's learned profile: export it to a file, import a file in its place (`tqbench profile export` and
`import`, and the TUI's Chat and Profile screens). An export the user did not name goes to `default_export_file`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tqbench.paths import cache_dir
from tqbench.profile.choose import identify, read_file
from tqbench.profile.profile import Profile, ProfileError
from tqbench.profile.store import ProfileStore, opened


def _exports_directory() -> Path:
    """Where exports go unless the user names a file: `profile-exports` in the user cache directory (absolute)."""
    return Path(os.path.abspath(cache_dir() / "profile-exports"))


def default_export_file(model: str | Path) -> Path:
    """The file a face exports the model's learned profile to unless the user names one (the Chat screen's e, the
    Profile screen's e as its proposal): `profile-exports/<the model directory's name>.json` in the user cache
    directory, absolute."""
    return _exports_directory() / f"{Path(os.path.abspath(model)).name}.json"


def export_learned(model: str | Path, store: ProfileStore | None = None, dest: str | Path | None = None) -> Profile:
    """The model's learned profile, written atomically to `dest` if given (as `Profile.to_text`). Raises ProfileError
    (one line) when nothing was learned yet, OSError when `dest` cannot be written. The exports directory is made
    when missing; any other directory must exist (a mistyped one is refused, not created)."""
    from tqbench.atomic import write_bytes

    fp, geo = identify(model)
    with opened(store) as store:
        p = store.load(fp, geo)
    if p.routings <= 0:
        raise ProfileError(f"no learned profile for this model yet (fingerprint {fp}): chat with it first", model)
    if dest is not None:
        dest = Path(dest)
        if Path(os.path.abspath(dest)).parent == _exports_directory():
            dest.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(dest, p.to_text().encode())
    return p


def import_file(model: str | Path, file: str | Path, store: ProfileStore | None = None,
                force: bool = False) -> tuple[Profile, Profile]:
    """Replace the model's learned profile with `file`, validated first (read_file: nothing is stored when it fails).
    Returns (the imported profile, the learned one it replaced)."""
    fp, geo = identify(model)
    p = read_file(file, fp, geo, force)
    with opened(store) as store:
        old = store.load(fp, geo)
        store.put(p)
    return p, old


@dataclass(frozen=True, kw_only=True)
class Forgotten:
    fingerprint: str
    routings: float  # of the learned profile forgotten (0 when there was none)
    gone: bool  # there was one to forget


def forget_learned(model: str | Path, store: ProfileStore | None = None) -> Forgotten:
    """Forget the model's learned profile (`tqbench profile reset`); shipped profiles and files stay."""
    fp, geo = identify(model)
    with opened(store) as store:
        old = store.load(fp, geo)
        return Forgotten(fingerprint=fp, routings=old.routings, gone=store.reset(fp))

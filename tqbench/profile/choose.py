"""Which profile a session starts from. Precedence: a file the user gave (`--profile FILE`) > the learned profile
once it has MATURE routings > a profile shipped with the model (in its directory, or in tqbench's `profiles/` for a
model whose fingerprint it names) > none."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqbench.profile.fingerprint import Geometry, fingerprint, geometry
from tqbench.profile.profile import MATURE, Profile, ProfileError, check_fits, from_dict, from_seed_files
from tqbench.profile.store import ProfileStore

SHIPPED_NAMES = ("tqbench-profile.json", "hot_experts.json")  # looked for in a model directory


@dataclass(frozen=True)
class Choice:
    source: str  # "file", "learned", "shipped", "none"
    where: str | None  # the file or store it came from
    profile: Profile | None
    fingerprint: str
    geometry: Geometry


def read_file(file: str | Path, fp: str, geo: Geometry, force: bool = False) -> Profile:
    """A profile file: ours, or the seed system's pin list / usage profile. Raises ProfileError (one line)."""
    where = str(file)
    try:
        doc = json.loads(Path(file).read_text())
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror}", where) from None
    except ValueError as e:
        raise ProfileError(f"invalid JSON ({e})", where) from None
    if isinstance(doc, dict) and "schema" in doc:
        p = from_dict(doc, where)
        check_fits(p, fp, geo, where, force)
        p.fingerprint = fp
        return p
    p = from_seed_files(doc, fp, geo, where)
    if p is None:
        raise ProfileError("neither a tqbench profile nor a pin list / usage profile", where)
    return p


def choose(model: str | Path, file: str | Path | None = None, force: bool = False,
           store: ProfileStore | None = None, mature: int | None = None) -> Choice:
    fp, geo = fingerprint(model), geometry(model)
    if file is not None:
        return Choice("file", str(file), read_file(file, fp, geo, force), fp, geo)
    if store is not None:
        learned = store.load(fp, geo)
        if learned.routings >= (MATURE if mature is None else mature) and learned.routings > 0:
            return Choice("learned", str(store.directory), learned, fp, geo)
    for candidate in _shipped(Path(model)):
        try:
            return Choice("shipped", str(candidate), read_file(candidate, fp, geo), fp, geo)
        except ProfileError:
            continue  # a shipped file for another model
    return Choice("none", None, None, fp, geo)


def _shipped(model: Path) -> list[Path]:
    from tqbench.paths import shipped_profiles

    out = [model / n for n in SHIPPED_NAMES if (model / n).is_file()]
    d = shipped_profiles()
    if d.is_dir():
        out += sorted(d.glob("*.json"))
    return out

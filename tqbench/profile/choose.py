"""Which profile a session starts from. Precedence: a file the user gave (`--profile FILE`) > the learned profile
once it has MATURE routings > a profile shipped with the model (in its directory, or in tqbench's `profiles/` for a
model whose fingerprint it names) > none."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqbench.profile.fingerprint import Geometry, fingerprint, geometry
from tqbench.profile.profile import MATURE, Profile, ProfileError, check_fits, from_dict, from_seed_files
from tqbench.profile.store import ProfileStore

if TYPE_CHECKING:
    from tqbench.stream.store import ExpertStore

SHIPPED_NAMES = ("tqbench-profile.json", "hot_experts.json")  # looked for in a model directory


@dataclass(frozen=True, kw_only=True)
class Choice:
    source: str  # "file", "learned", "shipped", "none"
    where: str | None  # the file or store it came from
    profile: Profile | None
    fingerprint: str
    geometry: Geometry


def identify(model: str | Path, experts: ExpertStore | None = None) -> tuple[str, Geometry]:
    """A model directory's fingerprint and geometry. Raises a one-line TqbenchError for a directory that is no model
    with streamable routed experts."""
    try:
        return fingerprint(model, experts), geometry(model, experts)
    except OSError as e:
        raise ProfileError(f"not a model directory tqbench can profile ({e.strerror or e})", model) from None
    except ValueError as e:
        raise ProfileError(f"not a model directory tqbench can profile ({e})", model) from None


def _json(file: str | Path) -> object:
    try:
        return json.loads(Path(file).read_text())
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror}", file) from None
    except ValueError as e:
        raise ProfileError(f"invalid JSON ({e})", file) from None


def read_profile(file: str | Path) -> Profile:
    """A profile file of ours (schema SCHEMA), on its own: no model to check it against (merge, diff)."""
    doc = _json(file)
    if isinstance(doc, dict) and "schema" not in doc and ("pin" in doc or "num_experts" in doc):
        raise ProfileError("a pin list / usage profile names no model: `tqbench profile import` it into a model "
                           "first, then export it", file)
    return from_dict(doc, str(file))


def read_file(file: str | Path, fp: str, geo: Geometry, force: bool = False, seed_ok: bool = True) -> Profile:
    """A profile file: ours, or (`seed_ok`) the seed system's pin list / usage profile. Raises ProfileError (one
    line)."""
    where = str(file)
    doc = _json(file)
    if isinstance(doc, dict) and "schema" in doc:
        p = from_dict(doc, where)
        check_fits(p, fp, geo, where, force)
        p.fingerprint = fp
        return p
    if not seed_ok:
        raise ProfileError("not a tqbench profile (no schema, so no model fingerprint to match)", where)
    p = from_seed_files(doc, fp, geo, where)
    if p is None:
        raise ProfileError("neither a tqbench profile nor a pin list / usage profile", where)
    return p


def choose(model: str | Path, file: str | Path | None = None, force: bool = False,
           store: ProfileStore | None = None, mature: int | None = None, experts: ExpertStore | None = None,
           cold: bool = False) -> Choice:
    """`experts`: the model's tqbench.stream.ExpertStore when the caller has one open (not read again). `cold`:
    no profile whatever exists (a baseline for comparisons)."""
    fp, geo = identify(model, experts)
    if cold:
        return Choice(source="none", where="cold", profile=None, fingerprint=fp, geometry=geo)
    if file is not None:
        return Choice(source="file", where=str(file), profile=read_file(file, fp, geo, force), fingerprint=fp,
                      geometry=geo)
    if store is not None:
        learned = store.load(fp, geo)
        if learned.routings >= (MATURE if mature is None else mature) and learned.routings > 0:
            return Choice(source="learned", where=str(store.directory), profile=learned, fingerprint=fp, geometry=geo)
    for candidate, in_model in _shipped(Path(model)):
        try:
            return Choice(source="shipped", where=str(candidate),
                          profile=read_file(candidate, fp, geo, seed_ok=in_model), fingerprint=fp, geometry=geo)
        except ProfileError:
            continue  # a shipped file for another model
    return Choice(source="none", where=None, profile=None, fingerprint=fp, geometry=geo)


def _shipped(model: Path) -> list[tuple[Path, bool]]:
    """Candidates, with whether each sits in the model's own directory: there a seed-system file (no fingerprint)
    belongs to the model; in tqbench's `profiles/` only a file whose fingerprint matches does."""
    from tqbench.paths import shipped_profiles

    out = [(model / n, True) for n in SHIPPED_NAMES if (model / n).is_file()]
    d = shipped_profiles()
    if d.is_dir():
        out += [(f, False) for f in sorted(d.glob("*.json"))]
    return out

"""A hot-expert profile: how often each (layer, expert) was routed, decode and prefill kept apart, for one model
(its fingerprint and geometry). One JSON schema for the store, export and import; the seed system's two file kinds
(a pin list, a usage profile) are read too.

Decay is per session: when a session first saves, the stored counts are multiplied by DECAY once, then its own
counts are added. A session is the unit of "what the user is working on", so the last sessions outweigh older ones
whatever their length; a per-routing decay would let one long session erase everything before it, and would tie the
profile's memory to token counts rather than to work.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tqbench.errors import TqbenchError
from tqbench.profile.fingerprint import Geometry

SCHEMA = "tqbench.profile/1"
DECAY = 0.8  # applied once per session to what earlier sessions stored
MATURE = 20_000  # routings before a learned profile is trusted over a shipped one
# A prompt's routings count as much as decode's when ranking: prompts are read from disk too, and weighing them 0.25
# pinned worse (benchmarks/profile.py: 38.6% against 39.7% hits on the second domain's sessions).
PREFILL_WEIGHT = 1.0
# Share of the expert cache's slots pinned from a profile of the user's own work (learned, or a file given), and from
# one shipped with the model (made from other text). benchmarks/profile.py, the same sessions after a domain switch:
# cold 31.7%, learned at 0.1 34.8%, at 0.6 38.6%; the shipped profile at 0.1 29.6% (below cold).
PIN_SHARE, SHIPPED_PIN_SHARE = 0.5, 0.1
MAX_EXPERTS = 1 << 20  # per layer: a profile claiming more is malformed (its counts would not fit in memory)


class ProfileError(TqbenchError):
    """A profile file or store entry that cannot be used."""


@dataclass(kw_only=True)
class Profile:
    fingerprint: str
    geometry: Geometry
    decode: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> float64 counts per expert
    prefill: dict[int, np.ndarray] = field(default_factory=dict)
    routings: float = 0.0  # decayed total of decode + prefill routings
    sessions: int = 0

    @classmethod
    def empty(cls, fingerprint: str, geometry: Geometry) -> Profile:
        z = {n: np.zeros(geometry.experts) for n in geometry.layers}
        return cls(fingerprint=fingerprint, geometry=geometry, decode=z, prefill={n: a.copy() for n, a in z.items()})

    def counts(self, prefill_weight: float = PREFILL_WEIGHT) -> dict[int, np.ndarray]:
        """Per layer: decode counts plus `prefill_weight` x prefill's."""
        return {n: self.decode[n] + prefill_weight * self.prefill[n] for n in self.geometry.layers}

    def ranked(self, prefill_weight: float = PREFILL_WEIGHT) -> list[tuple[int, int]]:
        """Every (layer, expert) with a count, hottest first; counts are compared as each layer's share of its own
        routings, so every layer gets its hot experts (a global list would favour the busiest layers)."""
        keys = []
        for n, c in self.counts(prefill_weight).items():
            total = c.sum()
            if total > 0:
                keys += [(float(c[e] / total), n, int(e)) for e in np.flatnonzero(c)]
        keys.sort(key=lambda k: (-k[0], k[1], k[2]))
        return [(n, e) for _, n, e in keys]

    def coverage(self, layer: int, share: float, prefill_weight: float = PREFILL_WEIGHT) -> int:
        """How many experts of `layer` cover `share` of its routings."""
        c = np.sort(self.counts(prefill_weight)[layer])[::-1]
        total = c.sum()
        if total <= 0:
            return 0
        return int(np.searchsorted(np.cumsum(c) / total, share - 1e-12) + 1)

    def add(self, other: Profile, weight: float = 1.0) -> None:
        for n in self.geometry.layers:
            self.decode[n] += weight * other.decode[n]
            self.prefill[n] += weight * other.prefill[n]
        self.routings += weight * other.routings

    def scaled(self, factor: float) -> Profile:
        return Profile(fingerprint=self.fingerprint, geometry=self.geometry,
                       decode={n: a * factor for n, a in self.decode.items()},
                       prefill={n: a * factor for n, a in self.prefill.items()}, routings=self.routings * factor,
                       sessions=self.sessions)

    def to_dict(self, pins: int | None = None) -> dict[str, Any]:
        ranked = self.ranked()
        return {"schema": SCHEMA, "fingerprint": self.fingerprint, "model": self.geometry.to_dict(),
                "routings": round(self.routings, 3), "sessions": self.sessions,
                "counts": {"decode": {str(n): _list(a) for n, a in self.decode.items()},
                           "prefill": {str(n): _list(a) for n, a in self.prefill.items()}},
                "pins": [list(k) for k in (ranked if pins is None else ranked[:pins])]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_text(self) -> str:
        """The file `tqbench profile export` writes (see dumps)."""
        return dumps(self.to_dict())


def dumps(doc: dict[str, Any]) -> str:
    """A profile document as a file: indented, each list of numbers on one line (a layer's counts, a pin), so the
    file reads and diffs line by line."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[([^\[\]{}]*)\]", lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]",
                  text) + "\n"


def _list(a: np.ndarray) -> list:
    return [int(v) if v == int(v) else round(float(v), 4) for v in a.tolist()]  # whole counts without ".0"


def from_dict(doc: Any, where: str) -> Profile:
    """Our schema; raises ProfileError naming `where` and the field that is missing or wrong."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ProfileError(f"not a tqbench profile (schema {_brief(repr(found))}, expected {SCHEMA!r})", where)

    def malformed(what: str) -> ProfileError:
        return ProfileError(f"malformed profile: {what}", where)

    def field(*keys: str) -> Any:
        """doc[keys[0]][keys[1]]...; a missing one is named: `no "model.top_k" field`."""
        value = doc
        for i, key in enumerate(keys):
            if not isinstance(value, dict):
                raise malformed(f'"{".".join(keys[:i])}" is not an object')
            if key not in value:
                raise malformed(f'no "{".".join(keys[:i + 1])}" field')
            value = value[key]
        return value

    def whole(*keys: str, least: int, most: int | None = None) -> int:
        value = field(*keys)
        if not _is_whole(value) or value < least:
            raise malformed(f'"{".".join(keys)}" is not a {"positive" if least else "non-negative"} whole number')
        if most is not None and value > most:
            raise malformed(f'"{".".join(keys)}" is {int(value):,}, more than any model has ({most:,} at most)')
        return int(value)

    def text(*keys: str) -> str:
        value = field(*keys)
        if not isinstance(value, str):
            raise malformed(f'"{".".join(keys)}" is not a string')
        return value

    layers = field("model", "layers")
    if (not isinstance(layers, list) or not all(_is_whole(n) and n >= 0 for n in layers)
            or len(set(layers)) != len(layers)):
        raise malformed('"model.layers" is not a list of distinct layer numbers')
    geo = Geometry(model_type=text("model", "model_type"), layers=tuple(int(n) for n in layers),
                   experts=whole("model", "experts", least=1, most=MAX_EXPERTS), top_k=whole("model", "top_k", least=0))
    p = Profile.empty(text("fingerprint"), geo)
    for kind in ("decode", "prefill"):
        counts = field("counts", kind)
        if not isinstance(counts, dict):
            raise malformed(f'"counts.{kind}" is not an object')
        for key, values in counts.items():
            n = _layer_number(key)
            if n is None:
                raise malformed(f'"counts.{kind}" has the key {json.dumps(key)}, which is no layer number')
            if n not in p.decode:
                raise ProfileError(f"counts for layer {n}, which the profile's model has no MoE layer", where)
            a = _counts(values, geo.experts)
            if a is None:
                raise ProfileError(f"layer {n} {kind} counts: expected {geo.experts} non-negative numbers", where)
            getattr(p, kind)[n] = a
    routings = _number(field("routings"))
    if routings is None or routings < 0:
        raise ProfileError(f"routings {_brief(json.dumps(doc['routings']))}: expected a non-negative number", where)
    p.routings = routings
    p.sessions = whole("sessions", least=0) if "sessions" in doc else 0
    return p


def _brief(text: str, most: int = 40) -> str:
    """A value quoted in an error line, cut to `most` characters."""
    return text if len(text) <= most else text[:most - 3] + "..."


def _number(value: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (true and false, NaN, a number past float's range)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _is_whole(value: Any) -> bool:
    x = _number(value)
    return x is not None and x.is_integer()


def _layer_number(key: str) -> int | None:
    """A counts key: "3" -> 3; None for a key that is no layer number."""
    return int(key) if key.isdecimal() and len(key) < 10 else None


def _counts(values: Any, experts: int) -> np.ndarray | None:
    """A layer's counts: `experts` non-negative numbers, else None."""
    if not isinstance(values, list) or len(values) != experts or any(_number(v) is None for v in values):
        return None
    a = np.asarray(values, dtype=np.float64)
    return None if (a < 0).any() else a


def from_seed_files(doc: Any, fingerprint: str, geo: Geometry, where: str) -> Profile | None:
    """The seed system's files: a pin list {"pin": [[layer, expert], ...]} (hottest first) or a usage profile
    {"version", "num_experts", "routings", "counts": {"<layer>": [...]}}. None when `doc` is neither."""
    if not isinstance(doc, dict):
        return None
    p = Profile.empty(fingerprint, geo)
    if isinstance(doc.get("pin"), list):
        pins = doc["pin"]
        for rank, pair in enumerate(pins):
            if not (isinstance(pair, list) and len(pair) == 2 and all(_is_whole(x) for x in pair)):
                raise ProfileError(f"pin {rank}: {_brief(json.dumps(pair))} is not [layer, expert]", where)
            n, e = int(pair[0]), int(pair[1])
            _check_key(n, e, geo, where)
            p.decode[n][e] += len(pins) - rank  # hottest first: a descending weight keeps the order
        p.routings = float(sum(a.sum() for a in p.decode.values()))
        return p
    if isinstance(doc.get("counts"), dict) and "num_experts" in doc:
        if not _is_whole(doc["num_experts"]) or not 1 <= doc["num_experts"] <= MAX_EXPERTS:
            raise ProfileError('malformed usage profile: "num_experts" is not a positive whole number', where)
        if int(doc["num_experts"]) != geo.experts:
            raise ProfileError(f"usage profile for {int(doc['num_experts'])} experts per layer; this model has "
                               f"{geo.experts}", where)
        for key, values in doc["counts"].items():
            n = _layer_number(key)
            if n is None:
                raise ProfileError(f'malformed usage profile: "counts" has the key {json.dumps(key)}, which is no '
                                   "layer number", where)
            _check_key(n, 0, geo, where)
            a = _counts(values, geo.experts)
            if a is None:
                raise ProfileError(f"layer {n}: expected {geo.experts} non-negative counts", where)
            p.decode[n] = a
        routings = _number(doc.get("routings", 0))
        if routings is None or routings < 0:
            raise ProfileError('malformed usage profile: "routings" is not a non-negative number', where)
        p.routings = routings or float(sum(a.sum() for a in p.decode.values()))
        return p
    return None


def _check_key(layer: int, expert: int, geo: Geometry, where: str) -> None:
    if layer not in geo.layers:
        raise ProfileError(f"layer {layer} is not one of the model's MoE layers ({geo.layers[0]}..{geo.layers[-1]})",
                           where)
    if not 0 <= expert < geo.experts:
        raise ProfileError(f"expert {expert} of layer {layer}: the model has {geo.experts} per layer", where)


def check_fits(p: Profile, fingerprint: str, geo: Geometry, where: str, force: bool = False) -> None:
    """A profile made for another model is refused; with `force`, one of the same geometry is accepted."""
    if (p.geometry.layers, p.geometry.experts) != (geo.layers, geo.experts):
        raise ProfileError(f"made for {len(p.geometry.layers)} MoE layers x {p.geometry.experts} experts; this model "
                           f"has {len(geo.layers)} x {geo.experts}", where)
    if p.fingerprint != fingerprint and not force:
        raise ProfileError(f"made for another model (fingerprint {p.fingerprint}, this one {fingerprint}); --force "
                           "uses it anyway, the geometry matches", where)

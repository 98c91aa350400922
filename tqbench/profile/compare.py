"""Two profiles together: a weighted merge of them, and how far their hot sets overlap per layer (`tqbench profile
merge` and `diff`).

Counts are weighed as pins are chosen (`Profile.counts()`: decode + prefill), so "hot" here means what a session would
pin."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tqbench.profile.fingerprint import Geometry
from tqbench.profile.profile import Profile, ProfileError
from tqbench.profile.summary import hottest

DIFF_SHARE = 0.8  # a layer's hot set for `diff`: the fewest experts covering this share


def hot_set(p: Profile, layer: int, share: float = DIFF_SHARE) -> set[int]:
    """The fewest experts of `layer` that cover `share` of its routings."""
    return set(hottest(p, layer)[: p.coverage(layer, share)])


def _same_geometry(a: Profile, b: Profile, names: tuple[str, str]) -> None:
    ga, gb = a.geometry, b.geometry
    if (ga.layers, ga.experts) != (gb.layers, gb.experts):
        raise ProfileError(f"different geometry: {names[0]} has {_shape(ga)}, {names[1]} {_shape(gb)}")


def _shape(g: Geometry) -> str:
    span = f" (layers {g.layers[0]}..{g.layers[-1]})" if g.layers else ""
    return f"{len(g.layers)} MoE layers{span} x {g.experts} experts"


def merge(a: Profile, b: Profile, weight_a: float = 1.0, weight_b: float = 1.0, force: bool = False,
          names: tuple[str, str] = ("A", "B")) -> Profile:
    """weight_a x a + weight_b x b, counts and routings alike, for a's model. The geometry must match; profiles of
    two models (different fingerprints) merge only with `force`."""
    for w in (weight_a, weight_b):
        if not np.isfinite(w) or w < 0:
            raise ProfileError(f"weight {w}: weights are non-negative numbers")
    if weight_a + weight_b <= 0:
        raise ProfileError("both weights are 0: the merge would be empty")
    _same_geometry(a, b, names)
    if a.fingerprint != b.fingerprint and not force:
        raise ProfileError(f"{names[0]} and {names[1]} were made for different models (fingerprints {a.fingerprint} "
                           f"and {b.fingerprint}); --force merges them anyway (keyed to {names[0]}'s), the geometry "
                           "matches")
    out = a.scaled(weight_a)
    out.add(b, weight_b)
    out.sessions = a.sessions + b.sessions
    return out


@dataclass(frozen=True, kw_only=True)
class DiffSide:
    """One of the two profiles compared."""

    name: str  # as the comparison calls it (the CLI: its file)
    fingerprint: str
    routings: float  # to 3 decimals

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "routings": self.routings, "file": self.name}


@dataclass(frozen=True, kw_only=True)
class LayerDiff:
    layer: int
    hot_a: int  # experts in a's hot set
    hot_b: int
    common: int
    jaccard: float | None  # common / either, to 4 decimals; None: both hot sets empty
    a_covers_b: float | None  # the share of b's routings on a's hot set; None: b has none
    b_covers_a: float | None

    def to_dict(self) -> dict:
        return {"layer": self.layer, "hot_a": self.hot_a, "hot_b": self.hot_b, "common": self.common,
                "jaccard": self.jaccard, "a_covers_b": self.a_covers_b, "b_covers_a": self.b_covers_a}


@dataclass(frozen=True, kw_only=True)
class OverallDiff:
    """The (layer, expert) hot sets pooled over the layers."""

    hot_a: int
    hot_b: int
    common: int
    jaccard: float | None
    mean_jaccard: float | None  # the mean of the layers' indices (layers with a hot set)
    a_covers_b: float | None
    b_covers_a: float | None

    def to_dict(self) -> dict:
        return {"hot_a": self.hot_a, "hot_b": self.hot_b, "common": self.common, "jaccard": self.jaccard,
                "mean_jaccard": self.mean_jaccard, "a_covers_b": self.a_covers_b, "b_covers_a": self.b_covers_a}


@dataclass(frozen=True, kw_only=True)
class ProfileDiff:
    share: float  # a layer's hot set: the fewest experts covering this share of its routings
    a: DiffSide
    b: DiffSide
    same_model: bool  # the same fingerprint
    layers: tuple[LayerDiff, ...]
    overall: OverallDiff

    def to_dict(self) -> dict:
        """`tqbench profile diff --json`."""
        return {"share": self.share, "a": self.a.to_dict(), "b": self.b.to_dict(), "same_model": self.same_model,
                "layers": [x.to_dict() for x in self.layers], "overall": self.overall.to_dict()}


def _covers(hot: set[int], counts: np.ndarray) -> float | None:
    total = float(counts.sum())
    return round(float(counts[sorted(hot)].sum()) / total, 4) if total > 0 and hot else (0.0 if total > 0 else None)


def diff(a: Profile, b: Profile, share: float = DIFF_SHARE, names: tuple[str, str] = ("A", "B")) -> ProfileDiff:
    """Per layer, the hot sets (the fewest experts covering `share` of the layer's routings) of `a` and `b`: their
    sizes, common experts, Jaccard index, and the share of each profile's routings the other's hot set serves (what
    pinning one profile's hot set would serve of the other's traffic). Overall: the Jaccard index of the pooled
    (layer, expert) hot sets, the mean of the layers' indices, and the pooled served shares. `names`: what errors
    and the result call the two profiles."""
    if not 0 < share <= 1:
        raise ProfileError(f"share {share}: expected a number in (0, 1]")
    _same_geometry(a, b, names)
    ca, cb = a.counts(), b.counts()
    layers, pa, pb, indices = [], set(), set(), []
    served_ab = served_ba = 0.0
    for n in a.geometry.layers:
        ha, hb = hot_set(a, n, share), hot_set(b, n, share)
        pa |= {(n, e) for e in ha}
        pb |= {(n, e) for e in hb}
        union = ha | hb
        if union:
            indices.append(len(ha & hb) / len(union))
        served_ab += float(cb[n][sorted(ha)].sum()) if ha else 0.0
        served_ba += float(ca[n][sorted(hb)].sum()) if hb else 0.0
        jaccard = round(len(ha & hb) / len(union), 4) if union else None
        layers.append(LayerDiff(layer=n, hot_a=len(ha), hot_b=len(hb), common=len(ha & hb), jaccard=jaccard,
                                a_covers_b=_covers(ha, cb[n]), b_covers_a=_covers(hb, ca[n])))
    total_a = sum(float(c.sum()) for c in ca.values())
    total_b = sum(float(c.sum()) for c in cb.values())
    overall = OverallDiff(hot_a=len(pa), hot_b=len(pb), common=len(pa & pb),
                          jaccard=round(len(pa & pb) / len(pa | pb), 4) if pa | pb else None,
                          mean_jaccard=round(float(np.mean(indices)), 4) if indices else None,
                          a_covers_b=round(served_ab / total_b, 4) if total_b > 0 else None,
                          b_covers_a=round(served_ba / total_a, 4) if total_a > 0 else None)
    return ProfileDiff(share=share, a=DiffSide(name=names[0], fingerprint=a.fingerprint, routings=round(a.routings, 3)),
                       b=DiffSide(name=names[1], fingerprint=b.fingerprint, routings=round(b.routings, 3)),
                       same_model=a.fingerprint == b.fingerprint, layers=tuple(layers), overall=overall)

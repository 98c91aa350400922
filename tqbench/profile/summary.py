"""A profile's summary per layer: its routings, its hottest experts, and how many experts cover 50/80/90% of its
routings; totals over the layers.

Counts are weighed as pins are chosen (`Profile.counts()`: decode + prefill), so "hot" here means what a session would
pin."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tqbench.profile.fingerprint import Geometry
from tqbench.profile.profile import Profile

SHARES = (0.5, 0.8, 0.9)  # coverage figures: experts needed for this share of a layer's routings


def share_key(share: float) -> str:
    """0.8 -> "80" (JSON keys of coverage figures)."""
    return f"{share * 100:g}"


def hottest(p: Profile, layer: int) -> list[int]:
    """The layer's experts with a count, hottest first (ties: lower expert number first)."""
    c = p.counts()[layer]
    return [int(e) for e in np.lexsort((np.arange(c.size), -c)) if c[e] > 0]


@dataclass(frozen=True, kw_only=True)
class HotExpert:
    expert: int
    share: float  # of its layer's routings, to 4 decimals


@dataclass(frozen=True, kw_only=True)
class Coverage:
    share: float  # e.g. 0.8
    experts: int  # the fewest experts covering that share of the routings

    @property
    def key(self) -> str:
        return share_key(self.share)


def _coverage_dict(coverage: tuple[Coverage, ...]) -> dict[str, int]:
    return {c.key: c.experts for c in coverage}


@dataclass(frozen=True, kw_only=True)
class LayerSummary:
    layer: int
    decode: float  # routings, to 3 decimals
    prefill: float
    experts_used: int  # experts with a count
    top: tuple[HotExpert, ...]  # hottest first
    coverage: tuple[Coverage, ...]  # one per share

    def to_dict(self) -> dict:
        return {"layer": self.layer, "decode": self.decode, "prefill": self.prefill, "experts_used": self.experts_used,
                "top": [[h.expert, h.share] for h in self.top], "coverage": _coverage_dict(self.coverage)}


@dataclass(frozen=True, kw_only=True)
class ProfileSummary:
    fingerprint: str
    geometry: Geometry
    routings: float  # to 3 decimals, as the decode and prefill sums
    sessions: int
    decode: float  # the layers' (rounded) decode routings summed
    prefill: float
    coverage: tuple[Coverage, ...]  # the layers' figures summed, one per share
    experts: int  # (layer, expert) pairs of the model
    layers: tuple[LayerSummary, ...]

    @property
    def experts_used(self) -> int:
        return sum(x.experts_used for x in self.layers)

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "geometry": self.geometry.to_dict(), "routings": self.routings,
                "sessions": self.sessions, "decode": self.decode, "prefill": self.prefill,
                "coverage": _coverage_dict(self.coverage), "experts": self.experts,
                "layers": [x.to_dict() for x in self.layers]}


def summary(p: Profile, top: int = 8, shares: tuple[float, ...] = SHARES) -> ProfileSummary:
    """Per layer: decode and prefill routings, experts used, the `top` hottest with their share of the layer's
    routings, and the experts needed to cover each of `shares`; totals over the layers."""
    counts = p.counts()
    layers = []
    for n in p.geometry.layers:
        c = counts[n]
        total = float(c.sum())
        layers.append(LayerSummary(
            layer=n, decode=round(float(p.decode[n].sum()), 3), prefill=round(float(p.prefill[n].sum()),
                                                                              3), experts_used=int((c > 0).sum()),
            top=tuple(HotExpert(expert=e, share=round(float(c[e] / total), 4)) for e in hottest(p, n)[:top]),
            coverage=tuple(Coverage(share=s, experts=p.coverage(n, s)) for s in shares)))
    coverage = tuple(Coverage(share=s,
                              experts=sum(x.coverage[i].experts for x in layers)) for i, s in enumerate(shares))
    return ProfileSummary(fingerprint=p.fingerprint, geometry=p.geometry, routings=round(p.routings, 3),
                          sessions=p.sessions, decode=round(sum(x.decode for x in layers), 3),
                          prefill=round(sum(x.prefill for x in layers), 3), coverage=coverage,
                          experts=len(p.geometry.layers) * p.geometry.experts, layers=tuple(layers))

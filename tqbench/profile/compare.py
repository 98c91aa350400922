"""What the `tqbench profile` commands (and the TUI) show about profiles, as plain data: a profile's summary per layer
(its top experts, and how many experts cover 50/80/90% of its routings), the overview of a model's profiles, a
weighted merge of two profiles, and how far two profiles' hot sets overlap per layer.

Counts are weighed as pins are chosen (`Profile.counts()`: decode + prefill), so "hot" here means what a
session would pin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tqbench.profile.choose import choose, identify, read_file, read_profile
from tqbench.profile.profile import MATURE, Profile, ProfileError
from tqbench.profile.store import ProfileStore

SHARES = (0.5, 0.8, 0.9)  # coverage figures: experts needed for this share of a layer's routings
DIFF_SHARE = 0.8  # a layer's hot set for `diff`: the fewest experts covering this share


def share_key(share: float) -> str:
    """0.8 -> "80" (JSON keys of coverage figures)."""
    return f"{share * 100:g}"


def hottest(p: Profile, layer: int) -> list[int]:
    """The layer's experts with a count, hottest first (ties: lower expert number first)."""
    c = p.counts()[layer]
    return [int(e) for e in np.lexsort((np.arange(c.size), -c)) if c[e] > 0]


def hot_set(p: Profile, layer: int, share: float = DIFF_SHARE) -> set[int]:
    """The fewest experts of `layer` that cover `share` of its routings."""
    return set(hottest(p, layer)[: p.coverage(layer, share)])


def summary(p: Profile, top: int = 8, shares: tuple[float, ...] = SHARES) -> dict[str, Any]:
    """Per layer: decode and prefill routings, experts used, the `top` hottest with their share of the layer's
    routings, and the experts needed to cover each of `shares`; totals over the layers."""
    counts = p.counts()
    layers = []
    for n in p.geometry.layers:
        c = counts[n]
        total = float(c.sum())
        layers.append({"layer": n, "decode": round(float(p.decode[n].sum()), 3),
                       "prefill": round(float(p.prefill[n].sum()), 3), "experts_used": int((c > 0).sum()),
                       "top": [[e, round(float(c[e] / total), 4)] for e in hottest(p, n)[:top]],
                       "coverage": {share_key(s): p.coverage(n, s) for s in shares}})
    return {"fingerprint": p.fingerprint, "geometry": p.geometry.to_dict(), "routings": round(p.routings, 3),
            "sessions": p.sessions, "decode": round(sum(x["decode"] for x in layers), 3),
            "prefill": round(sum(x["prefill"] for x in layers), 3),
            "coverage": {share_key(s): sum(x["coverage"][share_key(s)] for x in layers) for s in shares},
            "experts": len(p.geometry.layers) * p.geometry.experts, "layers": layers}


def overview(model: str | Path, store: ProfileStore, file: str | Path | None = None, force: bool = False,
             top: int = 8) -> dict[str, Any]:
    """What `tqbench profile show` reports for a model: the profile shown (`file` if given, else the learned one if
    it has any routings, else what a chat would start from), and what a chat without --profile starts from."""
    return overview_profile(model, store, file, force, top)[0]


def overview_profile(model: str | Path, store: ProfileStore, file: str | Path | None = None, force: bool = False,
                     top: int = 8) -> tuple[dict[str, Any], Profile]:
    """`overview`, and the profile it describes (an empty one when there is none)."""
    fp, geo = identify(model)
    chat = choose(model, store=store)
    if file is not None:
        p, source, where = read_file(file, fp, geo, force), "file", str(file)
    else:
        learned = store.load(fp, geo)
        if learned.routings > 0:
            p, source, where = learned, "learned", str(store.directory)
        else:
            p, source, where = chat.profile, chat.source, chat.where
    doc: dict[str, Any] = {"model": str(model), "source": source, "where": where,
                           "chat": {"source": chat.source, "where": chat.where}, "mature_at": MATURE,
                           "warnings": list(store.warnings)}
    if p is None:
        p = Profile.empty(fp, geo)
    doc.update(summary(p, top))
    doc["fingerprint"] = fp
    return doc, p


def overview_file(file: str | Path, top: int = 8) -> tuple[dict[str, Any], Profile]:
    """A profile file of ours on its own, no model to check it against: `overview`'s document (model and chat None)
    and the profile."""
    p = read_profile(file)
    doc: dict[str, Any] = {"model": None, "source": "file", "where": str(file), "chat": None, "mature_at": MATURE,
                           "warnings": []}
    doc.update(summary(p, top))
    return doc, p


def _same_geometry(a: Profile, b: Profile, names: tuple[str, str]) -> None:
    ga, gb = a.geometry, b.geometry
    if (ga.layers, ga.experts) != (gb.layers, gb.experts):
        raise ProfileError(f"different geometry: {names[0]} has {_shape(ga)}, {names[1]} {_shape(gb)}")


def _shape(g) -> str:
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


def _covers(hot: set[int], counts: np.ndarray) -> float | None:
    total = float(counts.sum())
    return round(float(counts[sorted(hot)].sum()) / total, 4) if total > 0 and hot else (0.0 if total > 0 else None)


def diff(a: Profile, b: Profile, share: float = DIFF_SHARE, names: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Per layer, the hot sets (the fewest experts covering `share` of the layer's routings) of `a` and `b`: their
    sizes, common experts, Jaccard index, and the share of each profile's routings the other's hot set serves (what
    pinning one profile's hot set would serve of the other's traffic). Overall: the Jaccard index of the pooled
    (layer, expert) hot sets, the mean of the layers' indices, and the pooled served shares."""
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
        layers.append({"layer": n, "hot_a": len(ha), "hot_b": len(hb), "common": len(ha & hb),
                       "jaccard": round(len(ha & hb) / len(union), 4) if union else None,
                       "a_covers_b": _covers(ha, cb[n]), "b_covers_a": _covers(hb, ca[n])})
    total_a = sum(float(c.sum()) for c in ca.values())
    total_b = sum(float(c.sum()) for c in cb.values())
    return {"share": share, "a": {"fingerprint": a.fingerprint, "routings": round(a.routings, 3)},
            "b": {"fingerprint": b.fingerprint, "routings": round(b.routings, 3)},
            "same_model": a.fingerprint == b.fingerprint, "layers": layers,
            "overall": {"hot_a": len(pa), "hot_b": len(pb), "common": len(pa & pb),
                        "jaccard": round(len(pa & pb) / len(pa | pb), 4) if pa | pb else None,
                        "mean_jaccard": round(float(np.mean(indices)), 4) if indices else None,
                        "a_covers_b": round(served_ab / total_b, 4) if total_b > 0 else None,
                        "b_covers_a": round(served_ba / total_a, 4) if total_a > 0 else None}}

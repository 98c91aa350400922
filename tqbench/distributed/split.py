"""`tqbench plan --machines N`: a plan's model split across N machines of one size, as a pipeline runs it (rank 0
the last layers, mlx-lm's split), and what each rank then holds, streams and reads per token.

Every rank holds the modules outside the layers (embedding, final norm, head: mlx-lm's pipeline keeps them on every
rank) plus its own layers' modules; its routed experts are streamed when they do not fit, with its own cache. A
token passes through the ranks one after another, so its time is the sum of theirs: the disk-bound ceiling of the
whole is 1 / sum over ranks of (bytes read / its disk's bandwidth), every machine's disk alike."""

from __future__ import annotations

from dataclasses import dataclass

from tqbench import units
from tqbench.errors import TqbenchError
from tqbench.machine import Machine
from tqbench.recipe.fit import Fit, Footprint, assess
from tqbench.recipe.plan import Plan


def layer_split(layers: int, ranks: int, model_type: str) -> list[tuple[int, int]]:
    """[start, end) per rank, rank 0 first, as mlx-lm's `pipeline(group)` gives them: kimi_k3 gives the extra layers
    to the first segments (the highest ranks), the shared PipelineMixin to the lowest ranks."""
    base, extra = divmod(layers, ranks)
    out = []
    for r in range(ranks):
        if model_type == "kimi_k3":
            seg = ranks - r - 1
            start = seg * base + min(seg, extra)
            out.append((start, start + base + (1 if seg < extra else 0)))
        else:
            sizes = [base + (1 if i < extra else 0) for i in range(ranks)]
            start = sum(sizes[r + 1:])
            out.append((start, start + sizes[r]))
    return out


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    rank: int
    layers: tuple[int, int]  # [start, end)
    footprint: Footprint  # what this rank holds and streams
    fit: Fit  # on one machine of the size planned for

    def to_dict(self) -> dict:
        f = self.footprint
        return {"rank": self.rank, "layers": list(self.layers), "total_bytes": f.total_bytes,
                "resident_bytes": f.resident_bytes, "streamed_bytes": f.streamed_bytes, "moe_layers": f.moe_layers,
                "fit": self.fit.to_dict()}


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    machines: int
    ranks: tuple[RankPlan, ...]

    @property
    def fits(self) -> bool:
        return all(r.fit.verdict.value != "does not fit" for r in self.ranks)

    @property
    def bytes_per_token(self) -> int | None:
        """Expert bytes one token reads from disk, all ranks (at each rank's hit-rate estimate); None if one does
        not fit."""
        if not self.fits:
            return None
        return round(sum(r.fit.bytes_per_token * (1 - (r.fit.hit_rate or 0.0)) for r in self.ranks
                         if r.fit.hit_rate is not None))

    @property
    def tok_s_ceiling(self) -> float | None:
        """1 / the sum of the ranks' read times per token; None when nothing is read or a bandwidth is unknown."""
        if not self.fits:
            return None
        seconds = 0.0
        for r in self.ranks:
            if r.fit.tok_s_ceiling is not None:
                seconds += 1 / r.fit.tok_s_ceiling
            elif r.fit.hit_rate is not None and r.fit.hit_rate < 1.0 and r.fit.bytes_per_token:
                return None  # it reads, at an unknown speed
        return 1 / seconds if seconds else None

    def to_dict(self) -> dict:
        return {"machines": self.machines, "fits": self.fits, "bytes_per_token": self.bytes_per_token,
                "tok_s_ceiling": self.tok_s_ceiling, "ranks": [r.to_dict() for r in self.ranks]}


def split_plan(plan: Plan, machine: Machine, machines: int, hit_rate: float | None = None) -> SplitPlan:
    """`plan` on `machines` machines like `machine`, its decoder layers split as a pipeline splits them. Raises
    TqbenchError when there are fewer layers than machines."""
    layers = 1 + max((m.layer for m in plan.modules if m.layer is not None), default=-1)
    if not 1 <= machines <= layers:
        raise TqbenchError(f"--machines {machines}: give 1 to {layers} (one layer per machine at least)")
    spans = layer_split(layers, machines, plan.model_type)
    shared = sum(m.bytes for m in plan.modules if m.layer is None)
    e = plan.experts
    out = []
    for r, (start, end) in enumerate(spans):
        mine = [m for m in plan.modules if m.layer is not None and start <= m.layer < end]
        total = shared + sum(m.bytes for m in mine)
        streamed = sum(m.streamed_bytes for m in mine)
        moe = len({m.layer for m in mine if m.streamed_bytes})
        fp = Footprint(total_bytes=total, resident_bytes=total - streamed, streamed_bytes=streamed, moe_layers=moe,
                       top_k=e.top_k if e and moe else 0, bytes_per_expert=e.bytes_per_expert if e and moe else 0)
        out.append(RankPlan(rank=r, layers=(start, end), footprint=fp, fit=assess(fp, machine, hit_rate)))
    return SplitPlan(machines=machines, ranks=tuple(out))


def split_lines(recipe: str, s: SplitPlan) -> list[str]:
    """The plan on several machines, as the CLI prints it: one line per rank and one for the whole."""
    lines = [f"{recipe} on {s.machines} machines of this size (pipeline: rank 0 runs the last layers):"]
    for r in s.ranks:
        f, fp = r.fit, r.footprint
        cache = f", cache {units.gb(f.cache_budget_bytes)}" if f.verdict.value == "streaming" else ""
        reads = (f", {units.gb(f.bytes_per_token * (1 - f.hit_rate))} read per token"
                 if f.hit_rate is not None and f.hit_rate < 1 and f.bytes_per_token else "")
        lines.append(f"  rank {r.rank}: layers {r.layers[0]}-{r.layers[1] - 1}, {units.gb(fp.total_bytes)} "
                     f"({units.gb(fp.streamed_bytes)} of experts): {f.verdict.value}{cache}{reads}")
    if not s.fits:
        lines.append("  the whole: does not fit (a rank above does not)")
    elif not s.bytes_per_token:
        lines.append("  the whole: nothing read from disk per token (every rank holds its experts)")
    else:
        ceiling = f", disk-bound ceiling {s.tok_s_ceiling:.2f} tok/s" if s.tok_s_ceiling else ""
        lines.append(f"  the whole: {units.gb(s.bytes_per_token)} read per token{ceiling}")
    return lines

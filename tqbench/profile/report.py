"""The profile report: what `tqbench profile show` and the TUI's Profile screen both show of an overview, as text.

`number` writes a routing count, `count` any other count (experts, sessions, pins), `shape` a model's MoE geometry,
CHAT_STARTS what a chat starts from, and `coverage_report(summary)` the coverage table: one row per MoE layer, then the
total (`all`), whose `cells()` are the texts of its columns. Each face lays the rows out its own way (a rich table,
plain lines, a DataTable) and formats no count itself.

Formats: every count has thousands separators. Routing counts are decayed, so not always whole: whole when within 1e-6
of a whole number or at least 100, else to one decimal (1,234 or 12.5); a hot expert as `252 0.7%` (its share of the
layer's routings); experts, sessions and pins are whole (3,136).
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.profile.fingerprint import Geometry
from tqbench.profile.summary import ProfileSummary

CHAT_STARTS = {"learned": "starts from the learned profile", "shipped": "starts from the shipped profile",
               "none": "starts cold (no profile)"}  # by the source a chat without --profile starts from


def number(x: float) -> str:
    """A routing count: 1,234 or 12.5."""
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-6 or abs(x) >= 100 else f"{x:,.1f}"


def count(n: int) -> str:
    """A whole count: 3,136."""
    return f"{n:,}"


def shape(g: Geometry) -> str:
    """`kimi_k3: 7 MoE layers x 448 experts, top-8`."""
    return f"{g.model_type}: {len(g.layers)} MoE layers x {g.experts} experts, top-{g.top_k}"


@dataclass(frozen=True, kw_only=True)
class CoverageRow:
    label: str  # the layer number, or "all"
    decode: str
    prefill: str
    experts_used: int
    coverage: tuple[int, ...]  # the experts covering each of the report's shares
    hottest: str  # `252 0.7%, 87 0.7%` (as many as the summary lists), `-` for none; the total row: `of 3,136 experts`
    section_end: bool = False  # the last layer's row: the total follows

    def cells(self) -> tuple[str, ...]:
        """The texts of the report's columns (`CoverageReport.columns`), the hottest experts not included."""
        return (self.label, self.decode, self.prefill, count(self.experts_used), *map(count, self.coverage))


@dataclass(frozen=True, kw_only=True)
class CoverageReport:
    shares: tuple[str, ...]  # of the coverage columns, in percent: "50", "80", "90"
    rows: tuple[CoverageRow, ...]  # one per MoE layer, then the total

    @property
    def columns(self) -> tuple[str, ...]:
        """The headers up to the hottest experts (whose header each face words its own way)."""
        return ("layer", "decode", "prefill", "used", *(f"{k}%" for k in self.shares))


def coverage_report(s: ProfileSummary) -> CoverageReport:
    rows = [CoverageRow(label=str(x.layer), decode=number(x.decode), prefill=number(x.prefill),
                        experts_used=x.experts_used, coverage=tuple(c.experts for c in x.coverage),
                        hottest=", ".join(f"{h.expert} {h.share:.1%}" for h in x.top) or "-",
                        section_end=x is s.layers[-1])
            for x in s.layers]
    rows.append(CoverageRow(label="all", decode=number(s.decode), prefill=number(s.prefill),
                            experts_used=s.experts_used, coverage=tuple(c.experts for c in s.coverage),
                            hottest=f"of {s.experts:,} experts"))
    return CoverageReport(shares=tuple(c.key for c in s.coverage), rows=tuple(rows))

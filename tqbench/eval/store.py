"""Evaluations remembered for the Recipe screen: for a source checkpoint (its fingerprint, as conversions record it)
and a recipe, the latest `tqbench eval` of that recipe's conversion against the source, with the text and token
count it was measured on, and the latest `tqbench eval --tools` of it (kept apart, shown with the text figures). A
diskcache store under the user cache (`$TQBENCH_CACHE_DIR/evals`), entries as JSON."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqbench.errors import TqbenchError
from tqbench.eval.records import EvalReport
from tqbench.paths import cache_dir


@dataclass(frozen=True, kw_only=True)
class RecipeQuality:
    """What one evaluated recipe lost against its source, on `tokens` tokens of `texts`."""

    recipe: str
    source_fingerprint: str
    texts: str  # the texts' names joined by ", " ("code, chat": the demo's held-out texts)
    tokens: int
    window: int
    text_digest: str
    perplexity: float
    source_perplexity: float
    kl: float
    top1_agreement: float
    top5_overlap: float
    greedy_share: float | None
    active_experts: int
    native_experts: int
    when: float  # time.time() of the evaluation
    tool_calls: ToolQuality | None = None  # the latest --tools evaluation of the same recipe against the same source

    @property
    def perplexity_change(self) -> float:
        """Relative to the source's perplexity (+0.041: 4.1% higher)."""
        return self.perplexity / self.source_perplexity - 1


@dataclass(frozen=True, kw_only=True)
class ToolQuality:
    """What one recipe's conversion does with the held-out tool calls against its source (`tqbench eval --tools`)."""

    cases: int
    tool_set: str  # the cases' digest (EvalReport.text_digest)
    valid_rate: float
    exact_rate: float
    agree_rate: float  # the same call as the source's
    source_exact_rate: float
    when: float


def tool_quality_of(report: EvalReport) -> ToolQuality | None:
    t = report.tools
    if report.recipe is None or t is None or t.agree is None:
        return None
    return ToolQuality(cases=t.cases, tool_set=report.text_digest, valid_rate=t.valid_rate, exact_rate=t.exact_rate,
                       agree_rate=t.agree_rate, source_exact_rate=t.source_exact_rate, when=time.time())


def quality_of(report: EvalReport, source_fingerprint: str) -> RecipeQuality | None:
    """The record of a report that compares a tqbench conversion with a reference (None otherwise)."""
    t = report.total
    if report.recipe is None or t is None or t.kl is None:
        return None
    g = report.greedy
    return RecipeQuality(recipe=report.recipe, source_fingerprint=source_fingerprint,
                         texts=", ".join(s.name for s in report.texts), tokens=t.tokens, window=report.window,
                         text_digest=report.text_digest, perplexity=t.perplexity, source_perplexity=t.ref_perplexity,
                         kl=t.kl, top1_agreement=t.top1_agreement, top5_overlap=t.top5_overlap,
                         greedy_share=g.share if g is not None else None, active_experts=report.max_active_experts,
                         native_experts=report.native_experts, when=time.time())


class EvalStore:
    def __init__(self, directory: str | Path | None = None):
        import diskcache

        self.directory = Path(directory) if directory is not None else cache_dir() / "evals"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._cache = diskcache.Cache(str(self.directory))
        except (OSError, sqlite3.Error) as e:
            raise TqbenchError(f"the evaluation store cannot be opened ({e})", self.directory) from None

    @staticmethod
    def _key(q: RecipeQuality) -> str:
        routing = "" if q.active_experts == q.native_experts else f"|k{q.active_experts}"
        return f"{q.source_fingerprint}|{q.recipe}{routing}"

    def put(self, q: RecipeQuality) -> None:
        self._cache.set(self._key(q), json.dumps(asdict(q)))

    def put_tools(self, source_fingerprint: str, recipe: str, t: ToolQuality) -> None:
        self._cache.set(f"{source_fingerprint}|{recipe}|tools", json.dumps(asdict(t)))

    def for_source(self, source_fingerprint: str) -> dict[str, RecipeQuality]:
        """recipe name -> its latest evaluation at native routing, for this source, with its tool calls' if any."""
        out, tools = {}, {}
        prefix = source_fingerprint + "|"
        for key in list(self._cache.iterkeys()):
            if not (isinstance(key, str) and key.startswith(prefix)) or "|k" in key[len(prefix):]:
                continue
            try:
                doc = json.loads(self._cache.get(key))
                if key.endswith("|tools"):
                    tools[key[len(prefix):-len("|tools")]] = ToolQuality(**doc)
                    continue
                doc.pop("tool_calls", None)
                q = RecipeQuality(**doc)
            except (TypeError, ValueError):  # an entry of another version: not shown
                continue
            out[q.recipe] = q
        return {name: replace(q, tool_calls=tools.get(name)) for name, q in out.items()}

    def close(self) -> None:
        self._cache.close()


def remembered(ckpt, store_dir: str | Path | None = None) -> dict[str, RecipeQuality]:
    """recipe name -> its latest evaluation against this opened source checkpoint (a tqbench.source.Checkpoint)."""
    from tqbench.convert.pipeline import source_fingerprint

    store = EvalStore(store_dir)
    try:
        return store.for_source(source_fingerprint(ckpt))
    finally:
        store.close()


def remember(report: EvalReport, against: Path, store_dir: str | Path | None = None) -> RecipeQuality | None:
    """Store the report when it compares a conversion with the very source it was converted from (the fingerprint
    in its convert-report.json equals the reference's). Returns what was stored. A store that cannot be opened costs
    a warning, never the evaluation."""
    from tqbench.convert.pipeline import source_fingerprint
    from tqbench.source.opening import open_checkpoint

    if quality_of(report, "") is None and tool_quality_of(report) is None:  # nothing to remember
        return None
    try:
        recorded = json.loads((Path(report.model) / "convert-report.json").read_text())["source_fingerprint"]
        fp = source_fingerprint(open_checkpoint(against))
    except (OSError, ValueError, KeyError, TypeError, TqbenchError):
        return None
    if recorded != fp:
        return None
    q, t = quality_of(report, fp), tool_quality_of(report)
    try:
        store = EvalStore(store_dir)
    except TqbenchError as e:
        print(f"tqbench: warning: {e}; this evaluation is not remembered", file=sys.stderr)
        return None
    try:
        if q is not None:
            store.put(q)
        if t is not None and report.max_active_experts == report.native_experts:
            store.put_tools(fp, report.recipe, t)
    finally:
        store.close()
    return q

"""Resident or streamed, decided before a model loads: from what the user asked (a StreamRequest) and the model's own
files (shard headers and its routed experts' layout; nothing is loaded). The plan carries the layout it read, so
loading streams from it without reading the headers again."""

from __future__ import annotations

from pathlib import Path

from tqbench.chat.events import StreamPlan
from tqbench.chat.request import StreamRequest
from tqbench.errors import TqbenchError
from tqbench.layout.names import EXPERT_MAP
from tqbench.stream.budget import auto_budget, host_tier_plan, needs_streaming
from tqbench.stream.store import ExpertStore, StoreError
from tqbench.stream.streamer import StreamConfig


def plan_streaming(path: str | Path, request: StreamRequest) -> StreamPlan:
    """Resident or streamed, and with which cache budget. Cache-aware routing asked of a model that runs resident is
    refused: there is no cache to favour."""
    plan = _plan(path, request)
    if request.cache_routing and plan.config is None:
        raise TqbenchError(f"--cache-routing favours experts in the expert cache, and this model's experts run "
                           f"resident ({plan.reason}): stream them with a cache budget, or leave cache routing at 0")
    return plan


def _plan(path: str | Path, r: StreamRequest) -> StreamPlan:
    budget = r.budget_value
    if budget == "off":
        return StreamPlan(config=None, reason="off")
    experts = expert_layout(path)
    if budget == "fit":
        if experts is None:
            return StreamPlan(config=None, reason="no routed experts")
        if not needs_streaming(path, store=experts):
            return StreamPlan(config=None, reason="fits", store=experts)
        budget, reason = "auto", "does not fit"
    else:
        reason = "asked"
    if experts is None:
        raise TqbenchError("no routed experts to stream (tqbench's expert_map.json, stacked switch_mlp tensors or "
                           "per-expert tensors); run it resident (cache budget fit or off)", path)
    budget_bytes = auto_budget(path, store=experts) if budget == "auto" else int(budget)
    host = host_tier_plan(r.host_budget_value, path, budget_bytes, store=experts)
    config = StreamConfig(budget_bytes=budget_bytes, workers=r.workers, policy=r.policy, fanout=r.fanout,
                          page_cache=r.page_cache, lookahead=r.lookahead, reads_in_flight=r.reads_in_flight,
                          host_budget_bytes=host.nbytes, cache_routing=r.cache_routing)
    return StreamPlan(config=config, reason=reason, host_why=host.why, store=experts)


def expert_layout(path: str | Path) -> ExpertStore | None:
    """The model's routed-expert layout (an ExpertStore, closed), or None when it has none to stream."""
    root = Path(path)
    if (root / EXPERT_MAP).is_file():
        store = ExpertStore.from_expert_map(root)  # a broken map is an error (named), not "no experts"
    else:
        try:
            store = ExpertStore.open(root)
        except (StoreError, TqbenchError, OSError):
            return None
    store.close()
    return store

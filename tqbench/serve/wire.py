"""tqbench's own JSON for a server's live view (/tqbench/status, /tqbench/events): the Service's records as JSON
objects, and back into the same frozen records for a face attached to a server in another process."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from tqbench.chat.events import PageIn, PrefillProgress
from tqbench.serve.service import RequestDone, ServeStatus
from tqbench.stream.stats import StreamStats

SCHEMA = "tqbench.serve/1"


def status_dict(st: ServeStatus) -> dict[str, Any]:
    d = {f.name: getattr(st, f.name) for f in fields(ServeStatus) if f.name != "stream"}
    d["hit_rate"] = st.hit_rate
    d["stream"] = st.stream.stats.to_dict() if st.stream is not None else None
    d["ranks"] = [r.to_dict() for r in st.stream.ranks] if st.stream is not None else []
    d["layers"] = [list(x) for x in st.layers]
    d["prefilling"] = asdict(st.prefilling) if st.prefilling is not None else None
    return {"schema": SCHEMA, **d}


def event_dict(ev: PageIn | RequestDone | ServeStatus) -> dict[str, Any]:
    if isinstance(ev, PageIn):
        return {"event": "page_in", **asdict(ev)}
    if isinstance(ev, RequestDone):
        return {"event": "request", **asdict(ev)}
    return {"event": "status", **status_dict(ev)}


def decode_event(d: dict[str, Any]) -> PageIn | RequestDone | ServeStatus | None:
    """A record from an event_dict (None for an event this version does not know)."""
    kind = d.get("event")
    if kind == "page_in":
        return PageIn(token=d["token"], layer=d["layer"], experts=tuple(d["experts"]), served=tuple(d["served"]),
                      bytes_read=d["bytes_read"], stall_s=d["stall_s"], cache_bytes=d.get("cache_bytes", 0))
    if kind == "request":
        return RequestDone(**{f.name: d[f.name] for f in fields(RequestDone) if f.name in d})
    if kind == "status":
        return decode_status(d)
    return None


def decode_status(d: dict[str, Any]) -> ServeStatus:
    from tqbench.chat.events import StreamReport
    from tqbench.distributed.world import RankStats

    stream = None
    if d.get("stream") is not None:
        known = {f.name for f in fields(StreamStats)}
        stats = StreamStats(**{k: v for k, v in d["stream"].items() if k in known and not isinstance(v, (dict, list))})
        prefill = d["stream"].get("prefill") or {}
        stats.prefill_hits, stats.prefill_misses = prefill.get("hits", 0), prefill.get("misses", 0)
        stats.prefill_bytes, stats.prefill_stall_s = prefill.get("critical_bytes", 0), prefill.get("stall_s", 0.0)
        ranks = tuple(RankStats(rank=r["rank"], layers=tuple(r["layers"]), streamed=r["streamed"],
                                hits_gpu=r["hits_gpu"], hits_host=r["hits_host"], misses=r["misses"],
                                critical_bytes=r["critical_bytes"], stall_s=r["stall_s"],
                                tokens=r["tokens"]) for r in d.get("ranks", ()))
        stream = StreamReport(stats=stats, disk=None, profile=None, ranks=ranks)
    plain = {f.name: d[f.name] for f in fields(ServeStatus) if f.name not in ("stream", "layers", "prefilling")
             and f.name in d}
    prefilling = PrefillProgress(**d["prefilling"]) if d.get("prefilling") else None
    return ServeStatus(**plain, stream=stream, layers=tuple((int(n), int(e)) for n, e in d.get("layers", ())),
                       prefilling=prefilling)

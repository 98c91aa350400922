"""A server's words: the lines every face shows about it (the CLI's live status and request log, the TUI's serve
panel), made here once from the Service's records."""

from __future__ import annotations

from tqbench import units
from tqbench.chat.report import cache_routing_text, rank_line
from tqbench.serve.service import RequestDone, ServeStatus

ENDINGS = {"length": "max tokens", "tool_calls": "tool calls", "cancelled": "client left"}
TOOL_GUARDS = {"greedy": "tool calls: their blocks decoded greedily, whatever the temperature (--tool-syntax greedy)",
               "schema": "tool calls: held to an offered tool and its JSON schema (--tool-syntax schema)"}
RESIDENT_LINE = "experts resident: no expert map (serve with a cache budget to watch experts page in)"


def serving_line(url: str, model: str, api_key: bool, stops: str = "Ctrl-C stops") -> str:
    key = "; every request needs the API key" if api_key else ""
    return f"serving {model} at {url}/v1 (OpenAI API){key}; {stops}"


def attached_line(st: ServeStatus) -> str:
    """A face watching a server that another process runs."""
    return f"attached to {st.model} served at {st.url}/v1 by another process"


def feed_ended_line(url: str) -> str:
    return f"{url}: the server closed its live feed (it stopped)"


def request_line(r: RequestDone) -> str:
    """One request, as the log shows it."""
    if r.outcome == "cancelled" and not r.completion_tokens:
        return f"{r.id}: the client left before the first token ({r.seconds:.2f} s)"
    end = ENDINGS.get(r.finish_reason, r.finish_reason) if r.outcome != "error" else "failed"
    cached = f" (+{r.cached_tokens} cached)" if r.cached_tokens else ""
    rate = f", {r.decode_tps:.1f} tok/s" if r.completion_tokens > 1 else ""  # one token has no decode rate
    return (f"{r.id}: {r.prompt_tokens} prompt tokens{cached}, {r.completion_tokens} generated ({end}); first token "
            f"{r.ttft_s * 1000:.0f} ms (queued {r.queued_s * 1000:.0f} ms){rate}")


def status_lines(st: ServeStatus) -> list[str]:
    """The live status: requests, queue, rates, the expert cache."""
    others = ", ".join(f"{n} {w}" for n, w in ((st.cancelled, "cancelled"), (st.failed, "failed"),
                                                (st.rejected, "rejected (queue full)"), (st.refused, "refused"))
                       if n)
    prompt = (f"; prompt {st.prefilling.done:,} of {st.prefilling.total:,} tokens processed"
              if st.prefilling is not None else "")
    lines = [f"requests {st.requests} ({st.ok} ok{', ' + others if others else ''}); running {st.running}, "
             f"queued {st.queued}{prompt}",
             f"tokens {st.prompt_tokens:,} prompt (+{st.cached_tokens:,} from the prompt cache), "
             f"{st.completion_tokens:,} generated; {st.decode_tps:.1f} tok/s, first token "
             f"{st.ttft_s * 1000:.0f} ms (last request)"]
    if st.tool_syntax in TOOL_GUARDS:
        lines.append(TOOL_GUARDS[st.tool_syntax])
    if st.stream is not None:
        s = st.stream.stats
        lines.append(f"experts: hit rate {s.hit_rate():.1%} ({s.hits:,} hits, {s.misses:,} misses), "
                     f"{units.size(s.critical_bytes)} read, stalled {s.stall_s:.2f} s; cache "
                     f"{units.size(s.cache_bytes)} of {units.size(s.budget_bytes)}")
        lines += [rank_line(r) for r in st.stream.ranks]  # several ranks: each one's, after the last request
        if s.cache_routing:
            lines.append(f"{cache_routing_text(s.cache_routing)}: {s.substitutions:,} experts routed in place of the "
                         "model's own picks")
    return lines

"""A ServeStatus as Prometheus's text exposition format (GET /metrics)."""

from __future__ import annotations

from tqbench.serve.service import ServeStatus

PREFIX = "tqbench_"


def prometheus(st: ServeStatus) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {PREFIX}{name} {help}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        for labels, value in samples:
            lines.append(f"{PREFIX}{name}{labels} {value:g}" if isinstance(value, float) else
                         f"{PREFIX}{name}{labels} {value}")

    metric("requests_total", "counter", "Completion requests by outcome (rejected: 429, refused: other 4xx).",
           [(f'{{outcome="{k}"}}', v) for k, v in (("ok", st.ok), ("cancelled", st.cancelled), ("error", st.failed),
                                                   ("rejected", st.rejected), ("refused", st.refused))])
    metric("tokens_total", "counter", "Tokens: prompt tokens processed, reused from the prompt cache, generated.",
           [('{kind="prompt"}', st.prompt_tokens), ('{kind="cached"}', st.cached_tokens),
            ('{kind="completion"}', st.completion_tokens)])
    metric("decode_tokens_per_second", "gauge", "Decode rate over the recent requests.", [("", float(st.decode_tps))])
    metric("time_to_first_token_seconds", "gauge", "The last request's time from arrival to its first token.",
           [("", float(st.ttft_s))])
    metric("prefill_seconds_total", "counter", "Seconds spent processing prompts, to their first tokens.",
           [("", float(st.prefill_s))])
    metric("prefill_tokens_done", "gauge", "The running request's prompt tokens processed so far (0: none running).",
           [("", st.prefilling.done if st.prefilling is not None else 0)])
    metric("prefill_tokens_total", "gauge", "The running request's prompt tokens to process (0: none in progress).",
           [("", st.prefilling.total if st.prefilling is not None else 0)])
    metric("requests_running", "gauge", "Requests generating now (one at a time).", [("", st.running)])
    metric("queue_length", "gauge", "Requests waiting for the engine.", [("", st.queued)])
    metric("uptime_seconds", "gauge", "Seconds since the server started.", [("", float(st.uptime_s))])
    if st.stream is not None:
        s = st.stream.stats
        metric("expert_hits_total", "counter", "Routed experts found in the expert cache, by tier.",
               [('{tier="pinned"}', s.hits_pinned), ('{tier="cache"}', s.hits_cache),
                ('{tier="prefetched"}', s.hits_prefetched), ('{tier="host"}', s.hits_host)])
        metric("expert_misses_total", "counter", "Routed experts read from disk when needed.", [("", s.misses)])
        metric("expert_read_bytes_total", "counter", "Expert bytes read on misses.", [("", s.critical_bytes)])
        metric("prefill_expert_misses_total", "counter", "Of the misses, those of prompts' processing.",
               [("", s.prefill_misses)])
        metric("prefill_expert_read_bytes_total", "counter", "Of the bytes read on misses, prompts' processing's.",
               [("", s.prefill_bytes)])
        metric("expert_stall_seconds_total", "counter", "Time forward passes waited on expert reads.",
               [("", float(s.stall_s))])
        metric("expert_cache_bytes", "gauge", "Bytes the expert cache holds.", [("", s.cache_bytes)])
        metric("expert_hit_rate", "gauge", "Hits over routings since the server started.", [("", float(s.hit_rate()))])
        ranks = st.stream.ranks  # several ranks: each one's, after the last request
        if ranks:
            metric("rank_expert_misses_total", "counter", "Routed experts read from disk when needed, by pipeline rank.",
                   [(f'{{rank="{r.rank}"}}', r.misses) for r in ranks])
            metric("rank_expert_read_bytes_total", "counter", "Expert bytes read on misses, by pipeline rank.",
                   [(f'{{rank="{r.rank}"}}', r.critical_bytes) for r in ranks])
            metric("rank_expert_stall_seconds_total", "counter", "Time forward passes waited on expert reads, by "
                   "pipeline rank.", [(f'{{rank="{r.rank}"}}', float(r.stall_s)) for r in ranks])
            metric("rank_forward_passes_total", "counter", "Forward passes, by pipeline rank (equal: in step).",
                   [(f'{{rank="{r.rank}"}}', r.tokens) for r in ranks])
        if s.cache_routing:
            metric("cache_routing_margin", "gauge", "Cache-aware routing's margin: the output is not the model's own.",
                   [("", float(s.cache_routing))])
            metric("expert_substitutions_total", "counter", "Routed experts cache routing put in place of the model's "
                   "own picks.", [("", s.substitutions)])
    return "\n".join(lines) + "\n"

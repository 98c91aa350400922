"""What expert streaming did, counted honestly: every expert a layer needed and had to wait for is a miss, whoever read
it; bytes read while the model waited are critical, bytes read ahead of need speculative."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MISS_TIMES = ("miss_timed", "miss_queue_s", "miss_read_s", "miss_buffer_wait_s", "miss_copy_s", "miss_to_gpu_s",
              "miss_to_host_s", "miss_before_reads_s", "miss_reading_s", "miss_after_reads_s")


@dataclass(kw_only=True)
class LayerTotals:
    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0


@dataclass(kw_only=True)
class StreamStats:
    budget_bytes: int = 0
    page_cache: str = "on"  # "on" (buffered reads) or "off" (bypassed)
    slot_bytes: int = 0
    slots: int = 0
    staging_bytes: int = 0
    hits_pinned: int = 0
    hits_cache: int = 0
    hits_prefetched: int = 0  # look-ahead reads that were done before the layer needed them
    hits_host: int = 0  # GPU misses copied from the host-RAM tier (tqbench.stream.host), not read
    misses: int = 0  # read from disk
    host_budget_bytes: int = 0  # the host tier (0: none)
    host_slots: int = 0
    host_bytes: int = 0  # the experts it holds now
    host_admitted: int = 0  # experts moved there from a GPU slot
    host_dropped: int = 0  # experts evicted from it (gone from both tiers)
    host_copy_s: float = 0.0  # worker seconds copying host -> slot (and the slot's old expert out)
    host_to_gpu_s: float = 0.0  # engine-thread seconds asking those slots' pages to move to the GPU
    copies: str = "numpy"  # how slots are written: "dma" (CUDA copy engines, tqbench.managed.DmaCopy) or "numpy"
    pinned_bytes: int = 0  # host memory page-locked for DMA copies (staging buffers, host-tier slots used so far)
    lookahead_reads: int = 0  # experts read ahead
    lookahead_used: int = 0  # of those, routed at the layer they were read for
    reads: int = 0
    critical_bytes: int = 0
    speculative_bytes: int = 0
    evictions: int = 0
    cache_bytes: int = 0
    cache_bytes_max: int = 0
    tokens: int = 0
    stall_s: float = 0.0
    pinned: int = 0  # experts a profile pinned
    preload_bytes: int = 0  # read at start for those pins (not misses)
    preload_reads: int = 0
    preload_s: float = 0.0
    # Where the demand page-ins' time went (seconds summed over them; timing only, see pagein._MissClock):
    # per read, queued before a worker started it, the read itself, and waiting for a free staging buffer before
    # being submitted; per expert, the copy into its slot (by a read worker: copies overlap each other and the reads,
    # so these seconds can exceed the wall time they lie in) and the GPU / host prefetch calls (engine thread, the host
    # ones once the reads are submitted); and each page-in's wall time cut in three: before the first read was
    # submitted, from then to the last read's end, and after it until the page-in returned (the last copies, to_gpu).
    # `miss_timed`: the experts those page-ins read (look-ahead reads are not included). At most `workers` reads and
    # copies run at once, and every queued or running read and every running copy holds one of the streamer's
    # read_buffers(workers) staging buffers.
    miss_timed: int = 0
    miss_queue_s: float = 0.0
    miss_read_s: float = 0.0
    miss_buffer_wait_s: float = 0.0
    miss_copy_s: float = 0.0
    miss_to_gpu_s: float = 0.0
    miss_to_host_s: float = 0.0
    miss_before_reads_s: float = 0.0
    miss_reading_s: float = 0.0
    miss_after_reads_s: float = 0.0
    # what prompts' processing (forward passes of several positions) took of the totals above; decode is the rest
    prefill_hits: int = 0
    prefill_misses: int = 0
    prefill_bytes: int = 0  # read on the critical path
    prefill_stall_s: float = 0.0
    cache_routing: float = 0.0  # the margin of cache-aware routing (0: off, the model's own routing)
    substitutions: int = 0  # routed experts the model's own routing would not have picked (per token: / tokens)
    layers: dict[int, LayerTotals] = field(default_factory=dict)

    @property
    def hits(self) -> int:
        """Routed experts not read from disk when needed (every tier)."""
        return self.hits_gpu + self.hits_host

    @property
    def hits_gpu(self) -> int:
        return self.hits_pinned + self.hits_cache + self.hits_prefetched

    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def tier_rates(self) -> dict[str, float]:
        """Shares of routed experts served by each tier: "gpu" (the slot pools), "host", "disk"."""
        n = self.hits + self.misses
        return {k: (v / n if n else 0.0) for k, v in (("gpu", self.hits_gpu), ("host", self.hits_host),
                                                     ("disk", self.misses))}

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "page_cache": self.page_cache, "slot_bytes": self.slot_bytes, "slots": self.slots,
                "staging_bytes": self.staging_bytes, "cache_bytes": self.cache_bytes,
                "cache_bytes_max": self.cache_bytes_max, "hits": self.hits, "hits_pinned": self.hits_pinned,
                "hits_cache": self.hits_cache, "hits_prefetched": self.hits_prefetched, "hits_host": self.hits_host,
                "misses": self.misses, "host_budget_bytes": self.host_budget_bytes, "host_slots": self.host_slots,
                "host_bytes": self.host_bytes, "host_admitted": self.host_admitted, "host_dropped": self.host_dropped,
                "host_copy_s": round(self.host_copy_s, 6), "host_to_gpu_s": round(self.host_to_gpu_s, 6),
                "copies": self.copies, "pinned_bytes": self.pinned_bytes,
                "tiers": {k: round(v, 4) for k, v in self.tier_rates().items()},
                "lookahead_reads": self.lookahead_reads, "lookahead_used": self.lookahead_used, "hit_rate": round(self.hit_rate(), 4),
                "reads": self.reads, "critical_bytes": self.critical_bytes,
                "speculative_bytes": self.speculative_bytes, "evictions": self.evictions, "tokens": self.tokens,
                "stall_s": round(self.stall_s, 4), "pinned": self.pinned, "preload_bytes": self.preload_bytes,
                "preload_reads": self.preload_reads,
                "preload_s": round(self.preload_s, 4),
                **{k: (getattr(self, k) if k == "miss_timed" else round(getattr(self, k), 6)) for k in MISS_TIMES},
                "prefill": {"hits": self.prefill_hits, "misses": self.prefill_misses,
                            "critical_bytes": self.prefill_bytes, "stall_s": round(self.prefill_stall_s, 4)},
                "decode": {"hits": self.hits - self.prefill_hits, "misses": self.misses - self.prefill_misses,
                           "critical_bytes": self.critical_bytes - self.prefill_bytes,
                           "stall_s": round(self.stall_s - self.prefill_stall_s, 4)},
                "cache_routing": self.cache_routing, "substitutions": self.substitutions,
                "layers": {str(k): {"hits": v.hits, "misses": v.misses, "stall_s": round(v.stall_s, 4)}
                           for k, v in sorted(self.layers.items())}}

"""The chat's words: every status line and figure a face shows about a chat, made here once. The CLI prints the
plain lines; the TUI renders the same pieces as `Span`s (a run of text and how it reads: a label, a value, or
muted), choosing only the colours. Neither face formats a number itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import humanize

from tqbench import units
from tqbench.chat.events import ModelLoaded, StreamReport
from tqbench.chat.live import GLYPHS, KINDS, PageInMap, ReplyRates
from tqbench.chat.records import ConversationStatus, ProfileInfo, StreamSetup

if TYPE_CHECKING:  # named only: importing them loads MLX
    from tqbench.chat.events import KernelsCompiling, MlxWarmedUp, MlxWarmup, PrefillProgress, ReplyDone
    from tqbench.runtime.conversation import Sampling

LABEL_WIDTH = 8  # the TUI status lines' labels ("reply   ", "prompt  ")
ENDINGS = {"length": " (max tokens)", "cancelled": " (stopped)"}  # how a reply that did not stop by itself ended
TIERS_LEGEND = "P pinned  = cache  + ahead  # disk"
HOST_TIERS_LEGEND = "P pinned  = cache  + ahead  h host  # disk"  # with a host-RAM tier


@dataclass(frozen=True, kw_only=True)
class Span:
    text: str
    kind: str = ""  # "": plain, "label", "value" (what the line is about), "muted"


Line = tuple[Span, ...]


def plain(lines: list[Line] | tuple[Line, ...]) -> str:
    """Lines of spans as plain text, one per line."""
    return "\n".join("".join(s.text for s in line) for line in lines)


# ---- loading --------------------------------------------------------------------------------------------------------

def sampling_text(s: Sampling) -> str:
    """`greedy` or `temp 0.7, top-p 0.9, top-k 40`."""
    if s.temp == 0:
        return "greedy"
    return f"temp {s.temp:g}" + (f", top-p {s.top_p:g}" if s.top_p else "") + (f", top-k {s.top_k}" if s.top_k else "")


def sampling_line(s: Sampling) -> str:
    return f"{sampling_text(s)}, up to {s.max_tokens} tokens per reply"


def loaded_line(m: ModelLoaded) -> str:
    """The CLI's line once a model is loaded: what it is, its sampling, how its experts run."""
    tq = f", {m.turboquant_modules} TurboQuant modules" if m.turboquant_modules else ""
    template = "" if m.chat_template else ", no chat template (plain text turns)"
    stream = ""
    if m.stream is not None:
        st = m.stream
        n = st.reads_in_flight
        gate = f", {n} read{'s' if n > 1 else ''} in flight" if n else ""
        stream = (f"; streaming experts: cache {units.size(st.budget_bytes)} ({st.slots} slots, {st.workers} read "
                  f"workers, {st.policy}{', fan-out' if st.fanout else ''}{', look-ahead' if st.lookahead else ''}"
                  f"{gate}, page cache {st.page_cache}); {host_tier_text(st)}")
        if st.layer_major_tokens:
            stream += f"; long prompts layer by layer, each expert read once per {st.layer_major_tokens:,} tokens"
    routed = f"; {m.experts_active} of {m.experts_native} experts per token" if m.fewer_experts else ""
    if m.stream is not None and m.stream.cache_routing:
        routed += f"; {cache_routing_text(m.stream.cache_routing)}"
    return (f"loaded {m.model_type}{tq}: {units.size(m.weight_bytes)} of resident weights in {m.seconds:.1f} s; "
            f"{sampling_line(m.sampling)}{template}{stream}{routed}")


def host_tier_text(st: StreamSetup) -> str:
    """The host-RAM tier as it was decided: its size and why, or why there is none."""
    if st.host_budget_bytes:
        same = ", unified memory: a second copy in the same RAM" if st.host_why == "asked on unified memory" else ""
        return (f"host tier {units.size(st.host_budget_bytes)} ({st.host_slots} experts, "
                f"{'auto' if st.host_why == 'auto' else 'asked'}{same})")
    return {"unified memory": "one tier (unified memory: the GPU's memory is the RAM)",
            "nothing left": "no host tier (the cache holds every expert)",
            "no room": "no host tier (free memory is below the reserve)"}.get(st.host_why, "no host tier")


def streaming_text(m: ModelLoaded) -> str | None:
    """A short line on how the experts stream (the TUI's status line); None when they are resident."""
    st = m.stream
    if st is None:
        return None
    extra = "".join(x for x, on in ((", fan-out", st.fanout), (", look-ahead", st.lookahead)) if on)
    active = f", {m.experts_active} of {m.experts_native} experts" if m.experts_active else ""
    if st.cache_routing:
        active += f", {cache_routing_text(st.cache_routing)}"
    workers = f"{st.workers} worker" + ("s" if st.workers != 1 else "")
    host = f" + host {units.gb(st.host_budget_bytes)}" if st.host_budget_bytes else ""
    return f"streaming experts: cache {units.gb(st.budget_bytes)}{host}, {workers}, {st.policy}{extra}{active}"


def cache_routing_text(margin: float) -> str:
    """How a chat whose routing favours cached experts says so (its output is not the model's own)."""
    return f"routing changed: cache routing margin {margin:g}"


def fewer_experts_warning(m: ModelLoaded) -> str | None:
    if not m.far_fewer_experts:
        return None
    return (f"warning: routing to {m.experts_active} of the model's {m.experts_native} experts per token (more than a "
            "2x cut): expect worse answers")


def model_figures(m: ModelLoaded) -> list[str]:
    """The model's figures, each kept on one line by a face that packs them (the TUI's model band)."""
    tq = f"{m.turboquant_modules:,} TurboQuant modules" if m.turboquant_modules else "no TurboQuant modules"
    return [m.model_type, tq, f"{units.gb(m.weight_bytes)} of weights", f"loaded in {m.seconds:.1f} s"]


def profile_line(p: ProfileInfo) -> str:
    src = {"file": f"from {p.where}", "learned": f"learned ({p.routings:,} routings)",
           "shipped": f"shipped ({p.where})",
           "none": "none (--cold)" if p.where == "cold" else "none yet"}[p.source]
    pins = f"; pinned {p.pinned:,} experts (preloaded in {p.preload_s:.2f} s)" if p.pinned else ""
    learn = "learning from this session" if p.learning else "not learning (--no-learn)"
    return f"hot-expert profile: {src}{pins}; {learn}"


# ---- before the first token (tqbench.runtime.warmup) ---------------------------------------------------------------

def kernels_line(ev: KernelsCompiling) -> str:
    """While tqbench's fused kernels are built for the GPU."""
    return (f"building tqbench's CUDA kernels for this GPU: {ev.done} of {ev.total} ({ev.compiled} compiled, "
            f"{ev.done - ev.compiled} from the cache), {ev.elapsed_s:.0f} s")


def kernels_done_line(ev: KernelsCompiling) -> str:
    """Once the last is built (`ev` the last event)."""
    return (f"tqbench's CUDA kernels: {ev.total} ready in {ev.elapsed_s:.1f} s ({ev.compiled} compiled by NVRTC and "
            f"kept for the next start, {ev.total - ev.compiled} from the cache)")


def prefill_line(ev: PrefillProgress) -> str:
    """A prompt's processing so far: tokens, experts read, time (what a piped chat prints and the TUI's note shows)."""
    read = f", {ev.experts_read:,} experts read ({units.gb(ev.bytes_read)})" if ev.experts_read else ""
    if ev.done >= ev.total:
        return f"prompt: {ev.total:,} tokens processed in {ev.seconds:.1f} s{read}"
    left = f", about {ev.eta_s:.0f} s left" if ev.eta_s is not None else ""
    where = (f"MoE layer {ev.layers_done} of {ev.layers}" if ev.layers else f"{ev.done:,} of {ev.total:,} tokens")
    return f"prompt of {ev.total:,} tokens: {where} ({ev.fraction:.0%}) in {ev.seconds:.1f} s{read}{left}"


def mlx_warmup_line(ev: MlxWarmup) -> str:
    """Before the first forward pass on CUDA: MLX's compiling has no progress to show."""
    if ev.first_run:
        return "warming up MLX's kernels (first run on this machine: a minute or more, no progress to show)"
    return "warming up MLX's kernels (those not in its cache yet)"


def mlx_warmed_line(ev: MlxWarmedUp) -> str:
    return (f"MLX compiled {ev.compiled} of its kernels; first token after {ev.seconds:.1f} s (the kernels are kept "
            "for the next start)")


# ---- replies --------------------------------------------------------------------------------------------------------

def decode_text(d: ReplyDone) -> str:
    """The reply's decode rate, or why there is none."""
    return f"{d.decode_rate:.1f} tok/s" if d.decode_rate is not None else "no decode rate from one token"


def prefill_text(d: ReplyDone) -> tuple[str, str]:
    """How the prompt's figure reads: (" at ", its rate), or for the process's first reply (" in ", its time): that
    is mostly MLX warming up."""
    if d.prefill_rate is None:
        return " in ", f"{d.prefill_s:.1f} s (warming up: the first pass compiles)"
    return " at ", f"{d.prefill_rate:.1f} tok/s"


def reply_line(d: ReplyDone) -> str:
    """The CLI's summary after a reply."""
    cached = f", {d.cached_tokens} reused from the cache" if d.cached_tokens else ""
    prefill = "".join(prefill_text(d))
    return (f"[{d.generated_tokens} tokens{ENDINGS.get(d.finish_reason, '')}, {decode_text(d)}; prompt "
            f"{d.prompt_tokens} tokens{prefill}{cached}; peak memory {units.size(d.peak_memory_bytes)}]")


def reply_lines(d: ReplyDone) -> tuple[Line, Line]:
    """The TUI's status after a reply: the reply's tokens, decode rate and peak memory; the prompt's tokens
    processed (prefill rate) and those reused from the cache."""
    sep = Span(text=" · ", kind="muted")
    return ((Span(text=f"{'reply':<{LABEL_WIDTH}}", kind="label"),
             Span(text=f"{d.generated_tokens} tokens{ENDINGS.get(d.finish_reason, '')}", kind="value"),
             Span(text=" at " if d.decode_rate is not None else ", "), Span(text=decode_text(d), kind="value"), sep,
             Span(text="peak memory "),
             Span(text=units.gb(d.peak_memory_bytes), kind="value")),
            (Span(text=f"{'prompt':<{LABEL_WIDTH}}", kind="label"), Span(text=f"{d.prompt_tokens} processed",
                                                                         kind="value"),
             Span(text=prefill_text(d)[0]), Span(text=prefill_text(d)[1], kind="value"), sep,
             Span(text=f"{d.cached_tokens} reused", kind="value"), Span(text=" from the cache")))


def stats_lines(m: ModelLoaded, status: ConversationStatus, report: StreamReport | None) -> list[str]:
    """The CLI's /stats: the model and conversation, the last reply, the experts' streaming and the disk."""
    lines = [f"model {m.path} ({m.model_type}), {units.size(m.weight_bytes)} of weights; conversation: "
             f"{status.turns} turn{'s' if status.turns != 1 else ''}, {status.tokens} tokens in the cache"]
    if status.last is not None:
        lines.append("last reply: " + reply_line(status.last))
    if report is not None:
        s = report.stats
        tiers = s.tier_rates()
        host = split = ""
        if s.host_budget_bytes:
            host = (f", {s.hits_host} copied from the host tier ({units.size(s.host_bytes)} of "
                    f"{units.size(s.host_budget_bytes)} held)")
            split = f" (gpu {tiers['gpu']:.1%}, host {tiers['host']:.1%}, disk {tiers['disk']:.1%})"
        lines.append(f"experts: {s.hits} hits ({s.hits_pinned} pinned, {s.hits_prefetched} read ahead in time{host}), "
                     f"{s.misses} misses, hit rate {s.hit_rate():.1%}{split}; {units.size(s.critical_bytes)} read in "
                     f"{s.reads} reads, {s.evictions} evictions; cache {units.size(s.cache_bytes)} of "
                     f"{units.size(s.budget_bytes)} (max {units.size(s.cache_bytes_max)}); stalled {s.stall_s:.2f} s "
                     f"over {s.tokens} forward passes")
        lines += [rank_line(r) for r in report.ranks]
        if s.cache_routing:
            lines.append(f"{cache_routing_text(s.cache_routing)}: {s.substitutions} experts routed in place of the "
                         f"model's own picks ({s.substitutions / max(1, s.tokens):.2f} per forward pass)")
        got, disk = report.disk_bytes_per_s_on_misses, report.disk
        if got or disk:
            lines.append("disk: " + (f"{units.bandwidth(got)} while waiting on misses" if got else "no misses yet")
                         + (f", this disk reads {units.bandwidth(disk.bytes_per_s)} ({disk.source})" if disk else ""))
    return lines


def rank_line(r) -> str:
    """One pipeline rank's streaming after the last reply (a tqbench.distributed.world.RankStats)."""
    return f"rank {r.rank} (layers {r.layers[0]}-{r.layers[1] - 1}): " + (
        f"{r.hits_gpu + r.hits_host} hits, {r.misses} misses, {units.size(r.critical_bytes)} read, stalled "
        f"{r.stall_s:.2f} s over {r.tokens} forward passes" if r.streamed else "experts resident")


# ---- the live expert view -------------------------------------------------------------------------------------------

def expert_summary(view: PageInMap, budget: int, rates: ReplyRates | None, report: StreamReport | None,
                   disk_bps: float | None = None, host_budget: int = 0) -> list[Line]:
    """The expert view's figures (at most 5 lines): hit rate split by tier, decode rate, expert bytes per token, disk
    reads per second against this disk's measured bandwidth (`disk_bps`), the cache's fill against its budget (and
    the host-RAM tier's size, `host_budget`, when there is one). `report` (after a reply) overrides the counts the view
    made from the page-ins (they agree; the engine's are authoritative)."""
    legend = HOST_TIERS_LEGEND if host_budget else TIERS_LEGEND
    host = f" + host {units.gb(host_budget)}" if host_budget else ""
    if report is not None:
        s = report.stats
        seen = {"pinned": s.hits_pinned, "cache": s.hits_cache, "prefetched": s.hits_prefetched,
                "host": s.hits_host, "miss": s.misses}
        rate, cache = s.hit_rate(), s.cache_bytes
    else:
        seen, rate, cache = view.seen, view.hit_rate(), view.cache_bytes
    total = sum(seen.values())
    if not total:
        return [(Span(text=f"no expert routed yet; cache {units.gb(budget)}{host}",
                      kind="muted"),), (Span(text=legend, kind="muted"),)]
    split: list[Span] = []
    for k in (k for k in KINDS if host_budget or k != "host"):
        split += [Span(text=" ")] if split else []
        split += [Span(text=GLYPHS[k], kind="value"), Span(text=f"{seen[k] / total:.0%}")]
    lines: list[Line] = [(Span(text="hits "), Span(text=f"{rate:.1%}", kind="value"), Span(text="  "), *split)]
    if rates is not None:
        per_token = humanize.naturalsize(rates.bytes_per_token, format="%.1f")
        lines.append((Span(text=f"{rates.tok_s:.1f} tok/s",
                           kind="value"), Span(text=" · ", kind="muted"), Span(text=per_token, kind="value"),
                      Span(text=" read per token")))
        of = f" of {units.bandwidth(disk_bps)}" if disk_bps else ""
        lines.append((Span(text="disk "), Span(text=f"{rates.read_bps / 1e6:.1f}",
                                               kind="value"), Span(text=f" MB/s{of}")))
        lines.append((Span(text="cache "), Span(text=f"{cache / budget:.0%}" if budget else "-", kind="value"),
                      Span(text=f" of {units.gb(budget)}{host}")))
    else:
        lines.append((Span(text="cache "), Span(text=units.gb(cache),
                                                kind="value"), Span(text=f" of {units.gb(budget)}{host}")))
    lines.append((Span(text=legend, kind="muted"),))
    return lines

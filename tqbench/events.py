"""The events the engine's jobs yield, at the ground floor of the house: frozen dataclasses of plain values (never a
lazy MLX array), importing nothing of tqbench, so the layer that makes an event imports it from here.

- opening a checkpoint (`tqbench.source.open_checkpoint`): ShardScanned, then CheckpointOpened;
- a conversion (`tqbench.convert.convert`): `ConvertEvent`;
- a chat's jobs: the events made below the chat (a streamer's PageIn, the generation loop's ReplyStarted, TokenOut,
  ReplyDone, the GPU's warm-up, a completion's deltas). The chat's own events, and the union each of its jobs yields,
  are in tqbench.chat.events: the one place a face takes a chat's events from.

The CLI renders them with rich; the TUI's thread workers post them as Textual messages; the server turns them into
OpenAI's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ---- opening a checkpoint, converting it -------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ShardScanned:
    """One shard header read while opening a checkpoint."""

    index: int  # 1-based
    total: int
    file: str
    tensors: int
    fetched_bytes: int = 0  # from the hub so far, opening a hub checkpoint (0: read from disk or cache)


@dataclass(frozen=True, kw_only=True)
class CheckpointOpened:
    """Opening finished; `checkpoint` is a tqbench.source.Checkpoint (immutable)."""

    checkpoint: Any


@dataclass(frozen=True, kw_only=True)
class LayerErrors:
    """Relative errors of one layer's converted units: `count` units with an error, their sum and maximum (a unit's
    error is its worst quantized module's)."""

    layer: int | None  # None: tensors outside the layers
    count: int
    total: float
    worst: float


@dataclass(frozen=True, kw_only=True)
class ConvertStarted:
    source: str
    dest: str
    recipe: str
    shards: int
    units: int
    bytes_in: int  # source bytes the conversion reads
    bytes_out: int  # bytes of the shard files it writes: tensors + headers (the ShardWritten sizes add up to it)
    tensor_bytes: int  # of which tensor data: exactly `tqbench plan`'s total
    resumed_shards: int  # shards already finished by an earlier run
    resumed_bytes_in: int
    resumed_errors: tuple[LayerErrors, ...] = ()  # per layer, what the earlier runs' finished shards recorded


@dataclass(frozen=True, kw_only=True)
class UnitConverted:
    """One tensor, or one routed expert (all its projections), converted. Rate and ETA cover this run."""

    name: str  # the first output tensor of the unit
    layer: int | None
    expert: int | None
    bytes_in: int
    bytes_out: int
    rel_error: float | None  # worst relative error among the unit's quantized modules
    done_in: int  # source bytes done, earlier runs included
    total_in: int
    elapsed: float  # seconds in this run
    rate: float  # source bytes per second in this run
    eta: float | None  # seconds left


@dataclass(frozen=True, kw_only=True)
class SourceProgress:
    """A conversion streaming its source from the hub: shards downloading ahead of the conversion, and the source
    bytes tqbench holds on disk (downloaded, not yet removed)."""

    file: str  # the shard downloading now ("" when none is)
    downloaded: int  # bytes downloaded in this run, all shards
    to_download: int  # bytes this run downloads, all shards
    rate: float  # download bytes per second in this run
    on_disk: int  # source bytes tqbench downloaded that are on disk now
    waiting: bool  # the conversion is waiting for this download

    @property
    def eta(self) -> float | None:
        return (self.to_download - self.downloaded) / self.rate if self.rate > 0 else None

    @property
    def now(self) -> str:
        """What the downloads are doing, in words every face shows."""
        if self.file:
            return self.file + (" (the conversion waits for it)" if self.waiting else "")
        if self.downloaded >= self.to_download:
            return "all downloaded"
        return "next download waits until a converted shard is removed"


@dataclass(frozen=True, kw_only=True)
class SourceRemoved:
    """A downloaded source shard deleted: every tensor it holds is converted and written durably."""

    file: str
    bytes: int
    on_disk: int  # source bytes tqbench downloaded that are still on disk


@dataclass(frozen=True, kw_only=True)
class ShardWritten:
    index: int  # 1-based
    total: int
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class ConvertFinished:
    dest: str
    seconds: float
    bytes_in: int
    bytes_out: int  # shard files: tensors + headers
    shards: int
    mean_rel_error: float | None
    max_rel_error: float | None


@dataclass(frozen=True, kw_only=True)
class Calibrated:
    """A calibrated conversion's (recipe part `cal`) calibration pass is done: it ran the source model over `tokens`
    calibration tokens, for `seconds` in all, in steps among the conversion's units."""

    tokens: int
    inputs: int  # distinct module inputs tapped
    modules: int  # quantized modules calibrated with them
    seconds: float
    file: str  # where the statistics were saved ("" unless asked: convert(keep_statistics=True))


@dataclass(frozen=True, kw_only=True)
class CalibrationProgress:
    """A calibrated conversion measuring its statistics: `done` of `total` steps (in order: module inputs, each
    counted and its modules calibrated; one pass: batches of windows), the latest at `at`. `fraction` weighs each
    input by the weights of its modules (what calibrating them costs). The steps come among the conversion's units,
    so the run's ETA is the conversion's (UnitConverted.eta)."""

    done: int
    total: int
    step: str  # "inputs" or "batches"
    at: str  # the module path of the latest input, or "batch N"
    tokens: int  # calibration tokens each step runs through
    fraction: float
    elapsed: float  # seconds since the pass started, the conversion's work between its steps included


ConvertEvent = (Calibrated | CalibrationProgress | ConvertStarted | UnitConverted | SourceProgress | SourceRemoved
                | ShardWritten | ConvertFinished)


# ---- a chat's events made below the chat ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelChosen:
    path: str
    why: str  # "last converted model", "demo (converted earlier)", "demo, converted now"


@dataclass(frozen=True, kw_only=True)
class KernelsCompiling:
    """One of the model's fused kernels is ready: `done` of `total`, `name` the latest, read from the cache directory
    when `cached`, else compiled now; `compiled` of the `done` were compiled; seconds since the first."""

    done: int
    total: int
    name: str
    cached: bool
    compiled: int
    elapsed_s: float


@dataclass(frozen=True, kw_only=True)
class ReplyStarted:
    prompt_tokens: int  # this turn's tokens the model processes
    cached_tokens: int  # tokens reused from the conversation's cache


@dataclass(frozen=True, kw_only=True)
class PrefillProgress:
    """A prompt's processing so far, before its first token (tqbench.runtime.prefill): after each chunk of it
    (mlx-lm's prefill step: 2,048 tokens), or, run layer by layer, after each MoE layer (`layers_done` of `layers`,
    for the `window` tokens after `done`) and at each window's end, and at the prompt's end: tokens done of the
    prompt's, its seconds so far, and the routed experts read from disk for it (streaming; 0 when resident)."""

    done: int
    total: int
    seconds: float
    experts_read: int = 0
    bytes_read: int = 0
    layers_done: int = 0
    layers: int = 0  # 0: chunk by chunk (or a layer-by-layer window's end)
    window: int = 0  # the tokens after `done` running layer by layer now

    @property
    def fraction(self) -> float:
        """The share of the prompt's work done."""
        if not self.total:
            return 1.0
        partly = self.window * self.layers_done / self.layers if self.layers else 0
        return (self.done + partly) / self.total

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before any work is done)."""
        f = self.fraction
        return self.seconds * (1 - f) / f if f > 0 else None


@dataclass(frozen=True, kw_only=True)
class PageIn:
    """One MoE layer call: the distinct experts its router picked and how each was served."""

    token: int  # decode step of the session (prefill chunks count as one step each)
    layer: int
    experts: tuple[int, ...]
    served: tuple[str, ...]  # per expert: "pinned", "cache", "prefetched" (look-ahead, in time), "host" (copied
    # from the host-RAM tier) or "miss" (read from disk)
    bytes_read: int
    stall_s: float  # time the layer waited for reads and slot writes
    cache_bytes: int = 0  # the expert cache's bytes after this layer (pinned and cached experts)


@dataclass(frozen=True, kw_only=True)
class MlxWarmup:
    """The process's first forward pass on CUDA is about to run: MLX compiles its own kernels in it (those its cache
    directory lacks) and reports no progress. `first_run`: that cache held none (the first run on this machine)."""

    first_run: bool
    cached: int  # kernels MLX's cache directory held before


@dataclass(frozen=True, kw_only=True)
class MlxWarmedUp:
    """The first forward pass gave its token."""

    seconds: float  # from the warm-up's start to the first token (the prompt's processing included)
    compiled: int  # kernels MLX compiled and kept meanwhile (files its cache directory gained)


@dataclass(frozen=True, kw_only=True)
class TopLogprob:
    id: int
    text: str  # the token decoded alone
    logprob: float  # natural log of its probability under the model (before temperature and top-p / top-k)


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """A generated token's log-probability and, when asked, the likeliest tokens at its position (best first)."""

    id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TokenOut:
    id: int
    text: str  # this token's new text (may be "" while a multi-byte character is incomplete)
    thinking: bool  # inside a <think> block
    logprob: TokenLogprob | None = None  # when the sampling asked for them (Sampling.logprobs)


@dataclass(frozen=True, kw_only=True)
class ReplyDone:
    text: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float
    peak_memory_bytes: int
    finish_reason: str  # "stop" (end of message), "length" (max tokens), "cancelled"
    prefill_s: float = 0.0  # the prompt's processing, to its first token
    warmup: bool = False  # the process's first generation: its prompt time includes MLX compiling (not a speed)
    routing_changed: bool = False  # routed otherwise than the model's own top-k (--max-active-experts, cache routing)
    substitutions: int = 0  # cache routing: experts routed in place of the model's own picks in this reply

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first; None with fewer than two tokens (no rate to speak of)."""
        return self.decode_tps if self.generated_tokens > 1 else None

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens per second; None in a warm-up, whose time is mostly compiling."""
        return None if self.warmup else self.prefill_tps

    def to_dict(self) -> dict[str, Any]:
        return {"event": "done", "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "prefill_tps": round(self.prefill_tps, 2),
                "prefill_s": round(self.prefill_s, 3), "warmup": self.warmup,
                "decode_tps": round(self.decode_tps, 2), "peak_memory_bytes": self.peak_memory_bytes,
                "finish_reason": self.finish_reason, "routing_changed": self.routing_changed,
                "substitutions": self.substitutions}

@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """A tool call the model made, parsed by mlx-lm's tool parser for the model's format."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass(frozen=True, kw_only=True)
class CompletionDelta:
    """A completion's new text after one token, split as the model's markers say: the answer, its reasoning, and the
    tool calls that closed with this token. All may be empty (text held back: it may be a marker or a stop string)."""

    token: int
    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprob: TokenLogprob | None = None  # this token's, when asked


@dataclass(frozen=True, kw_only=True)
class CompletionDone:
    """A completion's end: the whole answer split as its deltas were, why it ended (OpenAI's finish_reason: "stop",
    "length", "tool_calls", or "cancelled" when the caller stopped it) and the reply's figures."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    reply: ReplyDone
    logprobs: tuple[TokenLogprob, ...] = ()  # every generated token's, when asked

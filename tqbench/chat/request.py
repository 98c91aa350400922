"""What a user asks of a chat, as every face takes it, checked in one place.

The expert cache budget has one syntax everywhere: `fit` (stream only a model that does not fit in memory: the
default), `auto` (stream, with the budget `tqbench plan` computes), `off` (keep the experts resident) or a size
(`8GB`, `512MB`, `64GiB`; a bare number is GB, as `--cache-budget-gb 8` has always meant)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from tqbench.errors import TqbenchError, UsageError

BUDGET_WORDS = ("fit", "auto", "off")
HOST_WORDS = ("auto", "off")
PAGE_CACHE = ("auto", "on", "off")
POLICIES = ("lrfu-next", "lrfu", "lru")  # tqbench.stream.policies.POLICIES, the default first (importing it loads MLX)
MAX_WORKERS = 256
MAX_PIN_SHARE = 0.9
PARALLEL = ("pipeline", "tensor")  # tqbench.distributed.tensor.PARALLEL (importing it loads MLX)
PROMPT_CACHE_BYTES = 2 << 30  # completions' LRU of prompt caches (tqbench.runtime.complete), by default


def parse_budget(text: str) -> str | int:
    """`fit`, `auto` or `off` as they are, else the size in bytes (a bare number is GB)."""
    from tqbench.recipe.fit import parse_size

    t = str(text).strip()
    if t.lower() in BUDGET_WORDS:
        return t.lower()
    try:
        return parse_size(t + ("" if t[-1:].isalpha() else "GB"))
    except TqbenchError:
        raise TqbenchError(f"cache budget {text!r}: give fit, auto, off or a size (8GB, 512MB; a bare number is GB)"
                           ) from None


def parse_host_cache(text: str) -> str | int:
    """`auto` or `off` as they are, else the host tier's size in bytes (a bare number is GB; 0 is off)."""
    from tqbench.recipe.fit import parse_size

    t = str(text).strip()
    if t.lower() in HOST_WORDS:
        return t.lower()
    try:
        n = parse_size(t + ("" if t[-1:].isalpha() else "GB"))
    except TqbenchError:
        raise TqbenchError(f"host cache {text!r}: give auto, off or a size (24GB, 512MB; a bare number is GB)"
                           ) from None
    return n if n > 0 else "off"


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    """How to run routed experts, as the user said it (decided against the model's files by
    tqbench.chat.stream_plan.plan_streaming). The two sizes are parsed once, by `check()` or at first use."""

    budget: str = "fit"  # fit | auto | off | a size (see the module's docstring)
    workers: int = 4  # threads reading experts from disk
    policy: str = POLICIES[0]  # which cached expert to evict
    fanout: bool = False  # split each expert's read across the workers
    lookahead: bool = False  # during decode, read the next layer's likely experts early
    page_cache: str = "auto"  # read through the OS page cache (on), around it (off), or decide by size (auto)
    reads_in_flight: int = 0  # at most this many reads at once (0: one per worker)
    host_budget: str = "auto"  # the host-RAM tier under the expert cache: auto (CUDA: free RAM minus a reserve;
    # unified memory: none), off, or a size (tqbench.stream.host)
    cache_routing: float = 0.0  # margin by which decode may favour cached experts (0: off; changes the output)

    @cached_property
    def budget_value(self) -> str | int:
        """`budget` parsed: fit, auto, off or bytes."""
        return parse_budget(self.budget)

    @cached_property
    def host_budget_value(self) -> str | int:
        """`host_budget` parsed: auto, off or bytes."""
        return parse_host_cache(self.host_budget)

    def check(self) -> StreamRequest:
        self.budget_value, self.host_budget_value  # noqa: B018 - parsed here: a bad size is refused before any work
        if not 1 <= self.workers <= MAX_WORKERS:
            raise TqbenchError(f"prefetch workers {self.workers}: give 1 to {MAX_WORKERS}")
        if self.policy not in POLICIES:
            raise TqbenchError(f"cache policy {self.policy!r}: choose {', '.join(POLICIES)}")
        if self.page_cache not in PAGE_CACHE:
            raise TqbenchError(f"page cache {self.page_cache!r}: choose auto, on or off")
        if not 0 <= self.reads_in_flight <= MAX_WORKERS:
            raise TqbenchError(f"reads in flight {self.reads_in_flight}: give 0 (one per worker) to {MAX_WORKERS}")
        if not 0 <= self.cache_routing <= 1:
            raise TqbenchError(f"cache routing margin {self.cache_routing:g}: give 0 (off) to 1")
        return self


# How tool calls are decoded: as sampled; their blocks greedily (ToolCallsGreedy); or constrained to the offered
# tools' schemas (tqbench.runtime.grammar).
TOOL_SYNTAX = ("sample", "greedy", "schema")
TOOL_CHOICE = ("auto", "none", "required")  # OpenAI's; a tool's name asks for a call to it


@dataclass(frozen=True, kw_only=True)
class SamplingRequest:
    """Sampling the user asked for; None: the model's generation_config.json decides (tqbench.runtime.conversation.Sampling)."""

    max_tokens: int | None = None
    temp: float | None = None
    top_p: float | None = None  # 0: off
    top_k: int | None = None  # 0: off
    seed: int | None = None
    logprobs: int | None = None  # each token's log-probability and its N likeliest alternatives (Sampling.logprobs)
    tool_syntax: str | None = None  # "greedy" / "schema": guards on tool calls (Sampling.tool_syntax)

    def check(self) -> SamplingRequest:
        if self.tool_syntax not in (None, *TOOL_SYNTAX):
            raise UsageError(f"--tool-syntax {self.tool_syntax}: give {', '.join(TOOL_SYNTAX)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise TqbenchError(f"max tokens {self.max_tokens}: give 1 or more")
        if self.temp is not None and self.temp < 0:
            raise TqbenchError(f"temperature {self.temp:g}: give 0 (greedy) or more")
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise TqbenchError(f"top-p {self.top_p:g}: give 0 (off) to 1")
        if self.top_k is not None and self.top_k < 0:
            raise TqbenchError(f"top-k {self.top_k}: give 0 (off) or more")
        return self


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """Which hot-expert profile a chat starts from, and whether it learns one (tqbench.profile)."""

    file: str | None = None  # start from this file (--profile FILE) instead of the learned or shipped one
    learn: bool = True  # --no-learn turns it off
    pin_share: float | None = None  # of the expert cache's slots pinned from the profile (streaming only); None:
    # tqbench.profile.PIN_SHARE for a learned or given profile, SHIPPED_PIN_SHARE for a shipped one
    force: bool = False  # use a file made for another model of the same geometry
    store: str | None = None  # the learned profiles' directory (default: the user cache)
    mature: int | None = None  # routings before the learned profile is used (default tqbench.profile.MATURE)
    cold: bool = False  # start from no profile (still learns unless learn is off)
    prefill_weight: float | None = None  # a prompt's routings next to decode's when ranking pins (None: the default)

    def check(self) -> ProfileOptions:
        if self.cold and self.file:
            raise UsageError("--cold starts from no profile: leave out --profile")
        if self.pin_share is not None and not 0 <= self.pin_share <= MAX_PIN_SHARE:
            raise TqbenchError(f"pin share {self.pin_share:g}: give 0 to {MAX_PIN_SHARE:g}")
        return self


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """Everything a chat is opened with. `model` None: the model converted last, else the built-in demo (converted
    first if needed: tqbench.chat.choose.choose_model)."""

    model: str | None = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    system: str | None = None
    chat_template: bool = True  # False: turns are plain text (a base model's continuation)
    trust_remote_code: bool = False
    stream: StreamRequest = field(default_factory=StreamRequest)
    max_active_experts: int = 0  # route each token to this many experts (0: the model's own top-k)
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    prompt_cache_bytes: int = PROMPT_CACHE_BYTES  # completions (a server's requests) keep prompt caches up to this
    parallel: str = "pipeline"  # several ranks: each holds its layers (pipeline) or a slice of every layer (tensor)
    prompt_store: bool = True  # keep prompt checkpoints on disk and continue from them (tqbench.runtime.prompt_store)

    def check(self) -> ChatRequest:
        """Raise TqbenchError (one line) for a value the engine would refuse; returns self."""
        self.sampling.check()
        self.stream.check()
        self.profile.check()
        if self.max_active_experts < 0:
            raise TqbenchError(f"max active experts {self.max_active_experts}: give 0 (the model's own) or more")
        if self.prompt_cache_bytes < 0:
            raise TqbenchError(f"prompt cache {self.prompt_cache_bytes} bytes: give 0 (none) or more")
        if self.parallel not in PARALLEL:
            raise TqbenchError(f"parallel {self.parallel!r}: choose {' or '.join(PARALLEL)}")
        return self


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """One stateless completion (a server's request): a chat's `messages` (with `tools` for the chat template), or a
    plain `prompt` to continue. Sampling left None takes the model's defaults as the chat was opened with them."""

    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    tools: tuple[dict, ...] | None = None
    tool_choice: str = "auto"  # TOOL_CHOICE or a tool's name; other than auto, decoding is constrained to it
    parallel_tool_calls: bool = True  # False: at most one call (constrained decoding)
    response_schema: dict | None = None  # the reply is one JSON value under this schema (OpenAI's response_format)
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    stop: tuple[str, ...] = ()

    def check(self) -> CompletionRequest:
        if (self.messages is None) == (self.prompt is None):
            raise UsageError("a completion takes messages or a prompt")
        if self.messages is not None and not self.messages:
            raise TqbenchError("messages: give at least one")
        if any(not s for s in self.stop):
            raise TqbenchError("stop: an empty string would stop at once")
        if self.tool_choice != "auto" and not self.tools:
            raise TqbenchError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.response_schema is not None and self.tools and self.tool_choice != "none":
            raise TqbenchError("response_format with tools: give tool_choice none, or one of them")
        self.sampling.check()
        return self

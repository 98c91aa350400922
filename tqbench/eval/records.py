"""What `tqbench eval` is asked and what it reports: frozen records every face renders (the CLI's tables and --json,
the TUI's Recipe screen)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tqbench.chat.request import TOOL_SYNTAX, StreamRequest
from tqbench.errors import TqbenchError, UsageError

WINDOW = 256  # tokens of context per window; every window starts from an empty context
TOKENS = 4096  # predicted tokens, spread over the texts
PROMPTS = 4  # greedy agreement: prompts, each the start of a window
PROMPT_TOKENS = 32
GENERATE = 32  # tokens each model generates from each prompt
MAX_WINDOW = 1 << 20


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """One evaluation: `model` scored on the texts, and compared per token with `against` when given.
    `texts`: files of plain text (each one document), or empty for the demo's held-out code and chat."""

    model: str
    against: str | None = None
    texts: tuple[str, ...] = ()
    window: int = WINDOW
    tokens: int = TOKENS
    prompts: int = PROMPTS
    prompt_tokens: int = PROMPT_TOKENS
    generate: int = GENERATE
    layers: bool = False  # the quick mode: each layer's hidden-state error on teacher-forced inputs
    max_active_experts: int = 0  # MODEL's routing (0: its own top-k); `against` always routes natively
    stream: StreamRequest = field(default_factory=StreamRequest)
    trust_remote_code: bool = False
    store: str | None = None  # where evaluations of conversions against their source are remembered (None: the
    # user cache; tqbench.eval.store)
    decode: bool = False  # score token by token through a KV cache, as a chat decodes (always with cache routing)
    tools: bool = False  # score tool calls instead of texts (tqbench.eval.tools)
    tools_file: str | None = None  # the cases (JSONL; None: the shipped held-out set); implies tools
    tool_cases: int = 0  # the first this many cases (0: all)
    tool_temp: float = 0.0  # MODEL's calls sampled at this temperature (0: greedy; the source's are greedy)
    tool_syntax: str = "sample"  # the guard on MODEL's calls: "greedy" blocks, or "schema" (constrained decoding)

    @property
    def scores_tools(self) -> bool:
        return self.tools or self.tools_file is not None

    @property
    def token_by_token(self) -> bool:
        """Decode-shaped passes: asked, or MODEL routes with cache routing, which acts in decode only."""
        return self.decode or self.stream.cache_routing > 0

    def check(self) -> EvalRequest:
        self.stream.check()
        if not 2 <= self.window <= MAX_WINDOW:
            raise TqbenchError(f"window {self.window}: give 2 to {MAX_WINDOW} tokens")
        if self.tokens < 1:
            raise TqbenchError(f"tokens {self.tokens}: give 1 or more")
        if self.prompts < 0 or self.generate < 0 or self.prompt_tokens < 1:
            raise TqbenchError("prompts and generated tokens: give 0 or more; prompt tokens: 1 or more")
        if self.max_active_experts < 0:
            raise TqbenchError(f"max active experts {self.max_active_experts}: give 0 (the model's own) or more")
        if self.layers and self.against is None:
            raise UsageError("--layers compares two models layer by layer: give --against SRC")
        if self.layers and self.token_by_token:
            raise UsageError("--layers runs whole windows: leave out --decode and --cache-routing")
        if self.scores_tools and (self.layers or self.texts):
            raise UsageError("--tools scores tool calls, not texts: leave out --layers and --text")
        if self.tool_cases < 0:
            raise TqbenchError(f"tool cases {self.tool_cases}: give 0 (all) or more")
        if self.tool_temp < 0 or self.tool_syntax not in TOOL_SYNTAX:
            raise TqbenchError(f"tool temperature {self.tool_temp:g} / syntax {self.tool_syntax!r}: give 0 or more / "
                               + " or ".join(TOOL_SYNTAX))
        return self


@dataclass(frozen=True, kw_only=True)
class TierShares:
    """Shares of a streamed model's routed experts served by each tier: its GPU cache, the host-RAM tier, the disk."""

    gpu: float
    host: float
    disk: float

    def to_dict(self) -> dict:
        return {"gpu": round(self.gpu, 4), "host": round(self.host, 4), "disk": round(self.disk, 4)}


@dataclass(frozen=True, kw_only=True)
class EvalStarted:
    model: str
    against: str | None
    texts: tuple[str, ...]  # the texts' names
    windows: int
    window: int
    tokens: int  # predicted tokens in all
    max_active_experts: int  # MODEL routes to this many experts (its own top-k when not changed)
    native_experts: int  # the model's own top-k (0: no routed experts)
    layers: bool
    cache_routing: float = 0.0  # MODEL's cache-routing margin (0: its own routing)
    decode: bool = False  # scored token by token
    asked_tokens: int = 0  # --tokens, when the texts hold fewer windows than it asks for (0: they hold enough)
    tool_cases: int = 0  # tool calls to score (--tools; then no texts)
    tool_set: str = ""  # where the cases come from


@dataclass(frozen=True, kw_only=True)
class EvalProgress:
    stage: str  # "score", "greedy" or "layers"
    done: int  # tokens scored (score, layers) or generated (greedy)
    total: int
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        if self.done <= 0 or self.done >= self.total:
            return None if self.done <= 0 else 0.0
        return self.elapsed_s / self.done * (self.total - self.done)


@dataclass(frozen=True, kw_only=True)
class TextScore:
    """Sums over a text's predicted tokens (exact: float64 sums of each window's float32 values); the figures are
    properties. The comparison fields are None without a reference model."""

    name: str
    tokens: int
    windows: int
    nll_sum: float
    ref_nll_sum: float | None = None  # the reference model's, on the same tokens
    kl_sum: float | None = None
    top1_agree: int | None = None
    top5_overlap_sum: float | None = None  # per token: |top-5 of MODEL & top-5 of SRC| / 5
    kl_windows: tuple[float, ...] = ()  # each window's KL sum, in scoring order (how much the KL varies by window)

    @property
    def loss(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def ref_perplexity(self) -> float | None:
        return None if self.ref_nll_sum is None else math.exp(self.ref_nll_sum / self.tokens)

    @property
    def kl(self) -> float | None:
        """Mean KL(SRC || MODEL) per token, in nats."""
        return None if self.kl_sum is None else self.kl_sum / self.tokens

    @property
    def top1_agreement(self) -> float | None:
        return None if self.top1_agree is None else self.top1_agree / self.tokens

    @property
    def top5_overlap(self) -> float | None:
        return None if self.top5_overlap_sum is None else self.top5_overlap_sum / self.tokens

    def plus(self, other: TextScore, name: str) -> TextScore:
        def add(a, b):
            return None if a is None or b is None else a + b

        return TextScore(name=name, tokens=self.tokens + other.tokens, windows=self.windows + other.windows,
                         nll_sum=self.nll_sum + other.nll_sum, ref_nll_sum=add(self.ref_nll_sum, other.ref_nll_sum),
                         kl_sum=add(self.kl_sum, other.kl_sum), top1_agree=add(self.top1_agree, other.top1_agree),
                         top5_overlap_sum=add(self.top5_overlap_sum, other.top5_overlap_sum),
                         kl_windows=self.kl_windows + other.kl_windows)


@dataclass(frozen=True, kw_only=True)
class GreedyAgreement:
    """Both models generate greedily from the same prompts: how many tokens come out alike."""

    prompts: int
    generated: int  # tokens each model generated from each prompt
    alike: tuple[int, ...]  # per prompt: tokens alike before the first difference
    same_position: tuple[int, ...]  # per prompt: positions where the two tokens are equal

    @property
    def share(self) -> float:
        """Tokens generated alike (before the first difference) over tokens generated."""
        total = self.prompts * self.generated
        return sum(self.alike) / total if total else 1.0


@dataclass(frozen=True, kw_only=True)
class LayerError:
    """One decoder layer run by both models on the reference model's own input to it (teacher-forced): the relative
    error of MODEL's output, sqrt(sum |out_M - out_S|^2 / sum |out_S|^2) over every scored token."""

    layer: int
    attention: str  # the attention module's class, as mlx-lm names it
    mlp: str
    rel_error: float


# ---- tool calls (tqbench.eval.tools) ----


@dataclass(frozen=True, kw_only=True)
class CallCheck:
    """One generated call, read and checked."""

    text: str  # what the model generated
    name: str | None  # the parsed call (None: no call came out)
    arguments: Any  # parsed arguments (a dict when valid JSON)
    problem: str  # why the call is not valid ("" when it is)

    @property
    def valid(self) -> bool:
        return not self.problem


@dataclass(frozen=True, kw_only=True)
class ToolCaseResult:
    where: str
    tool: str  # the reference tool
    call: CallCheck
    exact: bool  # the call equals the reference
    source: CallCheck | None = None  # the source model's call (with --against)
    agrees: bool | None = None  # both valid and equal
    answer: str | None = None  # the reply after the reference call's result
    answered: bool | None = None  # it contains the result


@dataclass(frozen=True, kw_only=True)
class ToolScore:
    """Counts over the cases; the rates are properties (None where nothing was counted)."""

    cases: int
    valid: int
    exact: int
    source_valid: int | None  # the source's own calls (None without --against)
    source_exact: int | None
    agree: int | None  # valid and equal to the source's call
    answers: int  # cases with a result to answer from
    answered: int  # answers containing the result
    results: tuple[ToolCaseResult, ...]

    @staticmethod
    def _rate(n: int | None, of: int) -> float | None:
        return None if n is None or not of else n / of

    @property
    def valid_rate(self) -> float | None:
        return self._rate(self.valid, self.cases)

    @property
    def exact_rate(self) -> float | None:
        return self._rate(self.exact, self.cases)

    @property
    def agree_rate(self) -> float | None:
        return self._rate(self.agree, self.cases)

    @property
    def source_exact_rate(self) -> float | None:
        return self._rate(self.source_exact, self.cases)

    @property
    def answer_rate(self) -> float | None:
        return self._rate(self.answered, self.answers)

    @property
    def wrong_tool(self) -> int:
        """MODEL's valid calls that are not the reference because they call another offered tool."""
        return sum(r.call.valid and not r.exact and r.call.name != r.tool for r in self.results)

    @property
    def wrong_arguments(self) -> int:
        """MODEL's valid calls that are not the reference although they call its tool: other arguments."""
        return sum(r.call.valid and not r.exact and r.call.name == r.tool for r in self.results)

    @property
    def problems(self) -> dict[str, int]:
        """Why MODEL's calls were invalid: each kind of problem (an argument's problems as one, "arguments") and how
        many calls had it, most first."""
        counts: dict[str, int] = {}
        for r in self.results:
            if r.call.problem:
                kind = "arguments" if r.call.problem.startswith("arguments") else r.call.problem
                counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True, kw_only=True)
class EvalReport:
    model: str
    against: str | None
    recipe: str | None  # MODEL's recipe, when tqbench converted it
    window: int
    max_active_experts: int
    native_experts: int
    texts: tuple[TextScore, ...]
    total: TextScore | None  # None in the --layers mode
    greedy: GreedyAgreement | None
    layers: tuple[LayerError, ...]
    text_digest: str  # sha256 of the scored token windows: two reports compare only on the same digest
    seconds: float
    model_bytes: int  # resident bytes of MODEL (streamed experts not included)
    model_read_bytes: int | None = None  # expert bytes MODEL's streamer read from disk (None: experts resident)
    against_read_bytes: int | None = None
    cache_routing: float = 0.0  # MODEL's cache-routing margin (0: its own routing)
    decode: bool = False  # scored token by token through a KV cache (one token per pass, as a chat decodes)
    model_misses_per_token: float | None = None  # MODEL's expert misses per scored token (None: experts resident)
    model_substitutions_per_token: float | None = None  # routed experts cache routing put in place of the model's
    model_tiers: TierShares | None = None  # where MODEL's routed experts came from while scoring (None: resident)
    tools: ToolScore | None = None  # --tools: the tool calls scored (then no texts)

    @property
    def routing_changed(self) -> bool:
        """MODEL does not route as the model was trained to (fewer experts, or cache routing)."""
        return self.max_active_experts != self.native_experts or self.cache_routing > 0

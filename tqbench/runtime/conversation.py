"""A conversation with a loaded model: mlx-lm's prompt cache kept across turns, its chat template, sampler and
generation loop; tqbench adds the bookkeeping (which tokens the cache holds, so a turn processes only its new
tokens) and frozen events for the faces.

`Conversation.reply()` is a generator to run on the engine's MLX thread; every event it yields holds plain values.
Closing it mid-reply (a user's Esc or Ctrl-C) keeps what was generated: the partial reply joins the conversation and
the cache stays consistent with it.
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import mlx.core as mx

from tqbench.events import PrefillProgress, ReplyDone, ReplyStarted, TokenLogprob, TokenOut, TopLogprob
from tqbench.errors import TqbenchError
from tqbench.runtime.grammar import Constrained, logits_size
from tqbench.runtime.load import Loaded
from tqbench.runtime.prefill import prefill
from tqbench.runtime.routing import routing_changed
from tqbench.runtime.warmup import first_generation

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, kw_only=True)
class Sampling:
    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 0.0  # 0: off
    top_k: int = 0  # 0: off
    seed: int | None = None
    logprobs: int = -1  # each token's log-probability (0) and its N likeliest alternatives (N); -1: none
    tool_syntax: str = "sample"  # "greedy": tool-call blocks decode greedily whatever the sampler (ToolCallsGreedy);
    # "schema": tool calls follow the offered tools' schemas (the caller builds `grammar`: tqbench.runtime.grammar)
    grammar: str | None = None  # llguidance Lark grammar the reply follows token by token (tqbench.runtime.grammar)

    @classmethod
    def defaults(cls, generation_config: dict[str, Any], **given: Any) -> Sampling:
        """generation_config.json's max_new_tokens / temperature / top_p / top_k (greedy when do_sample is false),
        overridden by what the user gave (None = not given)."""
        gc = generation_config
        sample = gc.get("do_sample", True) is not False
        base = cls(max_tokens=int(gc.get("max_new_tokens") or cls.max_tokens),
                   temp=float(gc.get("temperature") or 0.0) if sample else 0.0,
                   top_p=float(gc.get("top_p") or 0.0) if sample else 0.0,
                   top_k=int(gc.get("top_k") or 0) if sample else 0)
        return replace(base, **{k: v for k, v in given.items() if v is not None})


@dataclass(kw_only=True)
class Conversation:
    loaded: Loaded
    system: str | None = None
    chat_template: bool = True
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # exactly what the cache holds, in order
    cache: list[Any] | None = None
    turns: int = 0  # replies since the last reset
    can_trim: bool = True  # False: never trim the cache (several ranks, one of whose caches cannot be trimmed)
    store: Any = None  # tqbench.runtime.prompt_store.PromptStore: prompt checkpoints on disk (None: none)

    def __post_init__(self) -> None:
        if self.chat_template and getattr(self.loaded.tokenizer, "chat_template", None) is None:
            self.chat_template = False  # a base model: plain text turns
        self.reset()

    def reset(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.messages = [{"role": "system", "content": self.system}] if self.system and self.chat_template else []
        self.tokens = []
        self.turns = 0
        self.cache = make_prompt_cache(self.loaded.model)

    def conversation_tokens(self, user: str) -> list[int]:
        """The whole conversation with `user` as the next turn, as the model should see it."""
        tok = self.loaded.tokenizer
        if not self.chat_template:  # plain text: each turn continues the text on a new line
            return self.tokens + list(tok.encode("\n" + user if self.tokens else user,
                                                 add_special_tokens=not self.tokens))
        text = tok.apply_chat_template(self.messages + [{"role": "user", "content": user}], tokenize=False,
                                       add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def _reuse(self, full: list[int]) -> int:
        """How many of `full`'s first tokens the cache already holds; trims or resets the cache where it diverges."""
        self.cache, common = reuse(self.loaded, self.cache, self.tokens, full, self.can_trim)
        return common

    def keep(self, n: int) -> None:
        """Keep the cache's first `n` tokens only (a rank following rank 0's turn: tqbench.distributed.turns)."""
        self.cache = keep_first(self.loaded, self.cache, self.tokens, n)

    def reset_cache(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.tokens = []
        self.cache = make_prompt_cache(self.loaded.model)

    def reply(self, user: str, sampling: Sampling = Sampling(),
              lockstep: Any = None) -> Iterator[ReplyStarted | TokenOut | ReplyDone]:
        """`lockstep` (tqbench.distributed.turns.Leader): the reply is shared with the other ranks of a pipeline."""
        full = self.conversation_tokens(user)
        cached = self._reuse(full)
        kept = self.store.longest(full, scratch_file(self.cache)) if self.store is not None else None
        if kept is not None and kept[1] > cached:  # a prompt kept on disk begins this one: continue from it
            self.cache, cached = kept
            self.tokens = list(full[:cached])
        new = full[cached:]
        yield ReplyStarted(prompt_tokens=len(new), cached_tokens=cached)
        self.tokens.extend(new)
        self.turns += 1
        if self.chat_template:
            self.messages.append({"role": "user", "content": user})

        def ended(done: ReplyDone) -> None:  # also when the reply is closed early: it joins the conversation
            self._done = done
            if self.chat_template:
                self.messages.append({"role": "assistant", "content": done.text})

        try:
            yield from generate(self.loaded, new, self.cache, sampling=sampling, cached=cached, held=self.tokens,
                                ended=ended, lockstep=lockstep, checkpoint=keeper(self.store, full))
        finally:
            if not self.tokens:  # stopped while the prompt was processed: the cache holds part of it
                self.reset_cache()

    def close(self) -> None:
        """Stop the streamer's read workers (a streamed model), if any."""
        if self.loaded.streamer is not None:
            self.loaded.streamer.close()

    @property
    def last(self) -> ReplyDone | None:
        """The last reply's summary, also after a reply was stopped early (finish_reason "cancelled")."""
        return getattr(self, "_done", None)


def reuse(loaded: Loaded, cache: list[Any], held: list[int], full: list[int], can_trim: bool = True
          ) -> tuple[list[Any], int]:
    """(the cache to continue, how many of `full`'s first tokens it holds) for a cache that holds `held`: trimmed where
    they diverge (when it can be and `can_trim`), else a new one; `held` is cut to match."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    common = 0
    for a, b in zip(held, full):
        if a != b:
            break
        common += 1
    common = min(common, len(full) - 1)  # the last token must be processed to get logits
    if common == len(held):
        return cache, common
    if common and can_trim and can_trim_prompt_cache(cache):
        return keep_first(loaded, cache, held, common), common
    return keep_first(loaded, cache, held, 0), 0


def keep_first(loaded: Loaded, cache: list[Any], held: list[int], n: int) -> list[Any]:
    """The cache holding `held`'s first `n` tokens only (trimmed in place, or a new one for 0); `held` is cut to
    match."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    if n > len(held):
        raise TqbenchError(f"a turn keeps {n} tokens of a prompt cache that holds {len(held)}: the ranks are out of "
                           "step")
    if n == len(held):
        return cache
    if n == 0:
        held.clear()
        return make_prompt_cache(loaded.model)
    if not can_trim_prompt_cache(cache):
        raise TqbenchError("a turn trims a prompt cache that cannot be trimmed: the ranks are out of step")
    trim_prompt_cache(cache, len(held) - n)
    del held[n:]
    return cache


def keeper(store: Any, prompt: list[int]) -> Callable[[list[Any]], None] | None:
    """What generate() calls with the cache once `prompt` but its last token is processed: keep that checkpoint in
    `store` (None: no store)."""
    if store is None:
        return None
    return lambda cache: store.keep(prompt[:-1], cache, scratch_file(cache))


def scratch_file(owner: object) -> Path:
    """A path of this process's to write or name a prompt checkpoint through (tqbench.runtime.prompt_store)."""
    import os

    from tqbench.paths import cache_dir

    return cache_dir() / "prompts-scratch" / f"{os.getpid()}-{id(owner)}.safetensors"


def generate(loaded: Loaded, new: list[int], cache: list[Any], sampling: Sampling, cached: int, held: list[int],
             ended: Callable[[ReplyDone], None] = lambda done: None,
             stop: tuple[str, ...] = (), lockstep: Any = None, slot: int = 0,
             checkpoint: Callable[[list[Any]], None] | None = None
             ) -> Iterator[PrefillProgress | TokenOut | ReplyDone]:
    """Process `new` on top of `cache` (which holds `cached` tokens) and generate with mlx-lm's loop: a
    PrefillProgress per chunk of a prompt of more than one token (tqbench.runtime.prefill) and once it is done, a
    TokenOut per token, then a ReplyDone. Each token the cache comes to hold is appended to `held`. `ended(done)` is
    called once however the generation ends, also when the caller closes it early (finish_reason "cancelled").

    `stop`: strings that end the reply where they appear in its text (as OpenAI's `stop`: matched on the text, not on
    token ids, and left out of it); text that could be the start of one is held back until it is known not to be.

    `checkpoint(cache)`: called once the prompt but its last token is processed (tqbench.runtime.prompt_store).

    `lockstep` (tqbench.distributed.turns): the generation runs on every rank of a pipeline: rank 0 shares it (the
    prompt cache `slot` and its first `cached` tokens, `new`, the sampling) before the first forward pass, and each
    token after that ends on every rank where it ends on rank 0."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    seed = sampling.seed if lockstep is None else lockstep.begin(slot, cached, new, sampling)
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(sampling.temp, sampling.top_p, top_k=sampling.top_k)
    if sampling.tool_syntax == "greedy" and sampling.temp > 0:
        sampler = ToolCallsGreedy.around(sampler, loaded.tokenizer)
    if sampling.grammar is not None:
        sampler = Constrained.around(sampler, loaded.tokenizer, sampling.grammar, logits_size(loaded.config))
    mx.reset_peak_memory()
    warmup = first_generation()
    streamer = loaded.streamer
    substituted = streamer.stats.substitutions if streamer is not None else 0
    read_before = _read_since(streamer, (0, 0))
    generated: list[int] = []
    text: list[str] = []
    pending = ""  # text held back: it may begin a stop string
    thinking = False
    finish, prefill_s, decode_tps = "cancelled", 0.0, 0.0
    t0 = time.perf_counter()
    progress = steps = None
    try:
        for progress in prefill(loaded, new[:-1], cache, total=len(new)):  # all but the last token, told as it goes
            yield progress
        if checkpoint is not None and len(new) > 1:  # the cache holds the prompt but its last token: a checkpoint
            checkpoint(cache)
        head_s = time.perf_counter() - t0
        steps = stream_generate(loaded.model, loaded.tokenizer, mx.array(new[-1:], dtype=mx.uint32),
                                max_tokens=sampling.max_tokens, sampler=sampler, prompt_cache=cache)
        if lockstep is not None:
            steps = lockstep.steps(steps)
        for r in steps:
            if not generated:  # the prompt is processed: its last token ran with the first step
                prefill_s = head_s + (1 / r.prompt_tps if r.prompt_tps else 0.0)
                if progress is not None:
                    read, read_bytes = _read_since(streamer, read_before)
                    yield PrefillProgress(done=len(new), total=len(new), seconds=prefill_s, experts_read=read,
                                          bytes_read=read_bytes)
            generated.append(r.token)
            held.append(r.token)  # the cache holds every token generate_step has yielded
            decode_tps = r.generation_tps
            piece = r.text
            if stop:
                pending += piece
                cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
                if cut >= 0:
                    piece, pending = pending[:cut], ""
                    text.append(piece)
                    yield TokenOut(id=r.token, text=piece, thinking=thinking)
                    finish = "stop"
                    break
                keep = _stop_prefix(pending, stop) if r.finish_reason is None else 0
                piece, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
            if r.finish_reason is not None:
                finish = r.finish_reason
                if piece:
                    text.append(piece)
                    yield TokenOut(id=r.token, text=piece, thinking=thinking,
                                   logprob=_logprob(loaded, r, sampling.logprobs))
                break
            if THINK_OPEN in piece:
                thinking = True
            text.append(piece)  # before the yield: a reply closed there keeps this token's text
            yield TokenOut(id=r.token, text=piece, thinking=thinking, logprob=_logprob(loaded, r, sampling.logprobs))
            if THINK_CLOSE in piece:
                thinking = False
    finally:
        if steps is not None:
            steps.close()  # here, on the MLX thread, not whenever it is collected
        else:  # stopped while the prompt was processed: the cache holds part of it, so nothing of it is reused
            held.clear()
        done = ReplyDone(text="".join(text), prompt_tokens=len(new), cached_tokens=cached,
                         generated_tokens=len(generated), prefill_tps=len(new) / prefill_s if prefill_s else 0.0,
                         decode_tps=decode_tps, peak_memory_bytes=int(mx.get_peak_memory()), finish_reason=finish,
                         prefill_s=prefill_s, warmup=warmup, routing_changed=routing_changed(loaded.model, streamer),
                         substitutions=(streamer.stats.substitutions - substituted) if streamer is not None else 0)
        ended(done)
    if finish == "cancelled":  # the loop ended without a final response: the caller stopped early
        finish = "length"
    yield replace(done, finish_reason=finish)


class ToolCallsGreedy:
    """A sampler that decodes a tool call's block greedily (`--tool-syntax greedy`): from the token that completes
    the tokenizer's tool-call start marker to the one that completes its end marker, the likeliest token, whatever
    the sampler around it would draw. A sampled call that breaks its format (a marker, a quote, a key misspelt) is a
    failed call for an agent; greedy decoding inside the block keeps the format the model learned, and the answer
    around it is still sampled. It follows the tokens it returns (one `.item()` a token: it waits for each)."""

    def __init__(self, sampler: Callable, start: list[int], end: list[int]) -> None:
        self.sampler, self.start, self.end = sampler, start, end
        self.recent: list[int] = []
        self.inside = False

    @classmethod
    def around(cls, sampler: Callable, tokenizer) -> Callable:
        """The sampler wrapped for this tokenizer's tool-call markers (the sampler itself when it has none)."""
        start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
        if not getattr(tokenizer, "has_tool_calling", False) or not start or not end:
            return sampler
        return cls(sampler, tokenizer.encode(start, add_special_tokens=False),
                   tokenizer.encode(end, add_special_tokens=False))

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = mx.argmax(logprobs, axis=-1) if self.inside else self.sampler(logprobs)
        self.recent = (self.recent + [int(token.reshape(-1)[0].item())])[-max(len(self.start), len(self.end)):]
        marker = self.end if self.inside else self.start
        if self.recent[-len(marker):] == marker:
            self.inside = not self.inside
        return token


def _logprob(loaded: Loaded, r, top: int) -> TokenLogprob | None:
    """The generated token's log-probability (mlx-lm's GenerationResponse.logprobs: the model's log-softmax before
    the sampler's temperature and filters) and the `top` likeliest tokens there; None when not asked (top < 0)."""
    if top < 0:
        return None
    lp = r.logprobs.reshape(-1)
    decode = loaded.tokenizer.decode
    best: tuple[TopLogprob, ...] = ()
    if top > 0:
        ids = mx.argpartition(-lp, kth=min(top, lp.shape[0]) - 1)[:top]
        values = lp[ids].astype(mx.float32)
        pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: -p[1])
        best = tuple(TopLogprob(id=i, text=decode([i]), logprob=v) for i, v in pairs)
    return TokenLogprob(id=r.token, text=decode([r.token]), logprob=float(lp[r.token].astype(mx.float32).item()),
                        top=best)


def _read_since(streamer, before: tuple[int, int]) -> tuple[int, int]:
    """(experts read, bytes read) on the critical path since `before`; (0, 0) without a streamer."""
    if streamer is None:
        return 0, 0
    return streamer.stats.misses - before[0], streamer.stats.critical_bytes - before[1]


def _stop_prefix(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins some stop string (held back: the next token may finish
    it)."""
    for n in range(min(len(text), max(len(s) for s in stop) - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stop):
            return n
    return 0

"""Completions without a conversation: each request brings its whole prompt (an OpenAI client's messages), and the
longest prefix an earlier request left in the prompt cache is reused, so a request that extends an earlier
conversation processes only its new tokens.

The cache of prompt caches is mlx-lm's `LRUPromptCache` (the one `mlx_lm.server` keeps), bounded in bytes. Runs on
the engine's MLX thread, as `Conversation.reply` does; its events are the same records (ReplyStarted, TokenOut,
ReplyDone)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from tqbench.errors import TqbenchError
from tqbench.events import ReplyDone, ReplyStarted, TokenOut
from tqbench.runtime.conversation import Sampling, generate, keep_first, keeper, reuse, scratch_file
from tqbench.runtime.load import Loaded

PROMPT_CACHE_BYTES = 2 << 30  # the LRU's default bound
PROMPT_CACHE_ENTRIES = 32
_KEY = "model"  # one model per server: the LRU's model key


def chat_prompt(loaded: Loaded, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template: bool = True) -> list[int]:
    """The tokens of `messages` as the model should see them before its reply: the model's chat template (with
    `tools` where given) or, for a model without one (or `template` False), the contents one per line."""
    tok = loaded.tokenizer
    if template and getattr(tok, "chat_template", None) is not None:
        text = _render(tok, messages, tools)
        if tools and text == _render(tok, messages, None):
            raise TqbenchError(f"this model's chat template does not render tools: it would answer without the "
                               f"{len(tools)} tool{'s' if len(tools) != 1 else ''} given (leave out `tools`)")
        return list(tok.encode(text, add_special_tokens=False))
    if tools:
        raise TqbenchError("this model has no chat template to render tools with (leave out `tools`)")
    return text_prompt(loaded, "\n".join(str(m.get("content") or "") for m in messages))


def _render(tok, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    try:
        return tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template refusing the messages (jinja raises anything)
        raise TqbenchError(f"the chat template refused these messages: {e}") from None


def text_prompt(loaded: Loaded, prompt: str) -> list[int]:
    return list(loaded.tokenizer.encode(prompt, add_special_tokens=True))


class Completions:
    """Completions on one loaded model with a byte-bounded LRU of prompt caches. Touch on the engine thread only.

    `one_cache` (the ranks of a pipeline): one prompt cache instead, the last request's, continued where the next
    request begins with the same tokens. Every rank then holds the same tokens in it, whatever size its own layers'
    caches have (an LRU bounded in bytes would keep and drop different ones on different ranks); `can_trim` False
    when some rank's cache cannot be trimmed."""

    def __init__(self, loaded: Loaded, cache_bytes: int = PROMPT_CACHE_BYTES,
                 entries: int = PROMPT_CACHE_ENTRIES, one_cache: bool = False, can_trim: bool = True,
                 store: Any = None) -> None:
        from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

        self.loaded = loaded
        self.lru = None if one_cache else LRUPromptCache(max_size=entries, max_bytes=cache_bytes)
        self.can_trim = can_trim
        self.cache = make_prompt_cache(loaded.model) if one_cache else None  # one_cache: and the tokens it holds
        self.held: list[int] = []
        self.store = store  # tqbench.runtime.prompt_store.PromptStore: prompt checkpoints on disk (None: none)

    @property
    def cache_bytes(self) -> int:
        if self.lru is None:
            return sum(c.nbytes for c in self.cache)
        return self.lru.nbytes

    def keep(self, n: int) -> None:
        """one_cache: keep its first `n` tokens only (a rank following rank 0's turn)."""
        self.cache = keep_first(self.loaded, self.cache, self.held, n)

    def run(self, tokens: list[int], sampling: Sampling, stop: tuple[str, ...] = (),
            ended: Callable[[ReplyDone], None] = lambda done: None,
            lockstep: Any = None) -> Iterator[ReplyStarted | TokenOut | ReplyDone]:
        """ReplyStarted (the tokens processed and those reused), a TokenOut per token, ReplyDone. Once the prompt is
        processed, what the cache then holds is kept for later requests, also when the caller stops early.
        `ended(done)` is called once however it ends (finish_reason "cancelled" when closed early). `lockstep`
        (tqbench.distributed.turns.Leader, with one_cache): the request is shared with the other ranks."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        if not tokens:
            raise TqbenchError("the prompt is empty")
        if self.lru is None:
            yield from self._run_one(list(tokens), sampling, stop, ended, lockstep)
            return
        cache, rest = self.lru.fetch_nearest_cache(_KEY, list(tokens))
        if cache is not None and not rest:  # the whole prompt is cached: its last token must run again for logits
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = [tokens[-1]]
            else:
                cache = None
        if cache is None:
            cache, rest = make_prompt_cache(self.loaded.model), list(tokens)
        kept = self.store.longest(list(tokens), scratch_file(self)) if self.store is not None else None
        if kept is not None and kept[1] > len(tokens) - len(rest):  # kept on disk, longer than what memory holds
            cache, rest = kept[0], list(tokens[kept[1]:])
        held = list(tokens[:len(tokens) - len(rest)])
        yield ReplyStarted(prompt_tokens=len(rest), cached_tokens=len(held))
        held.extend(rest)
        generated: list[ReplyDone] = []

        def done(d: ReplyDone) -> None:
            generated.append(d)
            ended(d)

        try:
            yield from generate(self.loaded, rest, cache, sampling=sampling, cached=len(tokens) - len(rest), held=held,
                                ended=done, stop=stop, checkpoint=keeper(self.store, list(tokens)))
        finally:
            if generated and generated[0].generated_tokens:  # the prompt was processed: the cache matches `held`
                self.lru.insert_cache(_KEY, held, cache)

    def _run_one(self, tokens: list[int], sampling: Sampling, stop: tuple[str, ...],
                 ended: Callable[[ReplyDone], None], lockstep: Any) -> Iterator:
        from tqbench.distributed.turns import SLOT_COMPLETIONS

        self.cache, cached = reuse(self.loaded, self.cache, self.held, tokens, self.can_trim)
        rest = tokens[cached:]
        yield ReplyStarted(prompt_tokens=len(rest), cached_tokens=cached)
        self.held.extend(rest)
        try:
            yield from generate(self.loaded, rest, self.cache, sampling=sampling, cached=cached, held=self.held,
                                ended=ended, stop=stop, lockstep=lockstep, slot=SLOT_COMPLETIONS)
        finally:
            if not self.held:  # stopped while the prompt was processed: the cache holds part of it
                from mlx_lm.models.cache import make_prompt_cache

                self.cache = make_prompt_cache(self.loaded.model)


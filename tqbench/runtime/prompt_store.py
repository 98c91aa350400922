"""Prompt caches kept on disk, across processes: what mlx-lm's caches hold after a prompt's tokens (KV, and a K3's KDA
recurrent state, which cannot be trimmed), so that a later process sending the same prompt, or one that extends it,
processes only what is new.

- An entry holds the cache after exactly its tokens, saved with mlx-lm's save_prompt_cache: a checkpoint taken at the
  end of each prompt's processing (its last token aside, which the first step runs). A prompt reuses the longest
  entry whose tokens begin it (never all of it: its last token must run for logits), whether or not the cache could
  be trimmed.
- Entries are keyed by the model (its config, its weight files' names, sizes and times, the routing it runs with and
  mlx-lm's version: a changed or copied model misses) and by the tokens; they live in a diskcache store in tqbench's
  cache directory, least recently used dropped first once it holds `max_bytes`. diskcache writes an entry whole or not
  at all; an entry that cannot be read back is one warning line, dropped, and the prompt processed from scratch.
- Prompts shorter than MIN_TOKENS are not kept (their processing costs less than reading a checkpoint back).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MIN_TOKENS = 256
DEFAULT_BYTES = 8 << 30
_INDEX = "index"  # every entry: [model, tokens, bytes, last used]


def model_key(path: str | Path, routing: str = "") -> str:
    """What a checkpoint is valid for: the model directory's config and weight files (names, sizes, modification
    times), `routing` (the routing it runs with, where it is not the model's own) and mlx-lm's version."""
    from importlib.metadata import version

    root = Path(path)
    h = hashlib.sha256()
    h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"routing={routing};mlx-lm={version('mlx-lm')}".encode())
    return h.hexdigest()[:32]


class PromptStore:
    """One model's checkpoints in the store at `root` (shared by every model: entries are keyed by `model`, and the
    bound is the whole store's). diskcache writes each entry's file and an index of them (each entry's model, token
    count, bytes and last use) in transactions, so several processes may share the store; the index decides what is
    dropped, one least recently used entry at a time (diskcache's own culling drops ten at once). Engine thread only
    (loading and saving evaluate MLX arrays)."""

    def __init__(self, root: str | Path, model: str, max_bytes: int = DEFAULT_BYTES) -> None:
        import diskcache

        self.model = model
        self.max_bytes = max_bytes
        self.cache = diskcache.Cache(str(root), size_limit=1 << 62, cull_limit=0)  # the index bounds it
        self.warnings: list[str] = []

    def close(self) -> None:
        self.cache.close()

    def _key(self, tokens: list[int]) -> str:
        return f"{self.model}:{hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()}"

    def _index(self) -> dict[str, list]:
        return self.cache.get(_INDEX, default={})

    def longest(self, tokens: list[int], scratch: Path) -> tuple[list[Any], int] | None:
        """The cache after the longest kept prefix of `tokens` (shorter than `tokens`), loaded, and that prefix's
        length; None when none is kept. `scratch`: a free path where the entry's file is named .safetensors for
        mlx-lm's reader (a link, removed after)."""
        lengths = {n for model, n, _, _ in self._index().values() if model == self.model}
        for n in sorted((n for n in lengths if n < len(tokens)), reverse=True):
            key = self._key(tokens[:n])
            cache = self._load(key, n, scratch)
            if cache is not None:
                with self.cache.transact():
                    index = self._index()
                    if key in index:
                        index[key][3] = time.time()
                        self.cache.set(_INDEX, index)
                return cache, n
        return None

    def _load(self, key: str, n: int, scratch: Path) -> list[Any] | None:
        from mlx_lm.models.cache import load_prompt_cache

        handle = self.cache.get(key, read=True)
        if handle is None:  # another prefix of the same length, or dropped since
            return None
        try:
            with handle:
                scratch.parent.mkdir(parents=True, exist_ok=True)
                scratch.unlink(missing_ok=True)
                scratch.symlink_to(handle.name)
                try:
                    cache, meta = load_prompt_cache(str(scratch), return_metadata=True)
                finally:
                    scratch.unlink(missing_ok=True)
            if int(meta.get("tokens", -1)) != n or meta.get("model") != self.model:
                raise ValueError(f"it holds {meta.get('tokens')} tokens of model {meta.get('model')}")
            return cache
        except Exception as e:  # noqa: BLE001 - a broken entry must never give a wrong reply: drop it, go on
            self._warn(f"a kept prompt cache of {n} tokens could not be read back ({type(e).__name__}: {e}); "
                       "dropped, the prompt is processed again")
            self._drop(key)
            return None

    def keep(self, tokens: list[int], cache: list[Any], scratch: Path) -> None:
        """Keep `cache`, which holds exactly `tokens` (written whole to `scratch` first, then moved into the store),
        and drop least recently used entries until the store holds at most `max_bytes`."""
        from mlx_lm.models.cache import save_prompt_cache

        if len(tokens) < MIN_TOKENS:
            return
        scratch.parent.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(str(scratch), cache, {"tokens": str(len(tokens)), "model": self.model})
        key = self._key(tokens)
        try:
            nbytes = scratch.stat().st_size
            with open(scratch, "rb") as f:
                self.cache.set(key, f, read=True)
        finally:
            scratch.unlink(missing_ok=True)
        with self.cache.transact():
            index = self._index()
            index[key] = [self.model, len(tokens), nbytes, time.time()]
            while len(index) > 1 and sum(e[2] for e in index.values()) > self.max_bytes:
                oldest = min((k for k in index if k != key), key=lambda k: index[k][3])
                del index[oldest]
                self.cache.delete(oldest)
            self.cache.set(_INDEX, index)

    def _drop(self, key: str) -> None:
        with self.cache.transact():
            index = self._index()
            index.pop(key, None)
            self.cache.set(_INDEX, index)
            self.cache.delete(key)

    def _warn(self, line: str) -> None:
        self.warnings.append(line)
        print(f"tqbench: warning: {line}", file=sys.stderr)

"""Prompt checkpoints on disk (tqbench.runtime.prompt_store): a later process continues from a prompt's processing,
never from a wrong one, and the store stays within its bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import demo_tq4
from tqbench.engine import engine
from tqbench.runtime.conversation import Conversation, Sampling
from tqbench.runtime.load import load
from tqbench.runtime.prompt_store import MIN_TOKENS, PromptStore, model_key

TEXT = (Path(__file__).resolve().parent.parent / "tqbench" / "runtime" / "load.py").read_text()[:12000]
SHORT = TEXT[:1500]  # about 500 tokens: more than MIN_TOKENS, and a fast loop


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("prompt-store"))


LOADED: dict[Path, object] = {}  # each model loaded once (engine thread); every reply is a fresh conversation on it


def reply(model: Path, store: PromptStore | None, text: str, n: int = 6):
    """(tokens, ReplyStarted) of one plain-text reply in a fresh conversation."""
    def run():
        if model not in LOADED:
            LOADED[model] = load(model)
        conv = Conversation(loaded=LOADED[model], chat_template=False, store=store)
        events = list(conv.reply(text, Sampling(max_tokens=n)))
        return [e.id for e in events if type(e).__name__ == "TokenOut"], events[0], conv.cache

    return engine().call(run)


def continued(model: Path, text: str, split: int, n: int = 6) -> list[int]:
    """The tokens of `text` processed in one process without a store, its first `split` tokens first, then the rest
    with generation: the arithmetic a continuation from a checkpoint of `split` tokens does (a prompt processed whole
    cuts its chunks elsewhere, and greedy tokens may then differ in float order)."""
    from mlx_lm.models.cache import make_prompt_cache

    from tqbench.runtime.conversation import generate
    from tqbench.runtime.prefill import prefill

    def run():
        loaded = load(model)
        tokens = list(loaded.tokenizer.encode(text, add_special_tokens=True))
        cache = make_prompt_cache(loaded.model)
        for _ in prefill(loaded, tokens[:split], cache):
            pass
        events = generate(loaded, tokens[split:], cache, Sampling(max_tokens=n), split, list(tokens[:split]))
        return [e.id for e in events if type(e).__name__ == "TokenOut"]

    return engine().call(run)


def test_a_second_conversation_continues_from_the_kept_prompt(model, tmp_path):
    """The same prompt again processes its last token only (its prefix is read back), and gives the same tokens; a
    prompt that extends it continues from it too, with the tokens of the same prefix continued in memory; a prompt of
    fewer than MIN_TOKENS is not kept."""
    store = PromptStore(tmp_path / "prompts", model_key(model))
    first, started, cache = reply(model, store, SHORT)
    assert started.cached_tokens == 0 and started.prompt_tokens > MIN_TOKENS
    again, started2, cache2 = reply(model, store, SHORT)
    assert (started2.cached_tokens, started2.prompt_tokens) == (started.prompt_tokens - 1, 1)
    assert again == first
    longer, started3, _ = reply(model, store, SHORT + "\n\ndef main():\n")
    assert started3.cached_tokens == started.prompt_tokens - 1
    assert longer == continued(model, SHORT + "\n\ndef main():\n", started3.cached_tokens)
    reply(model, store, "def add(a, b):")
    assert reply(model, store, "def add(a, b):")[1].cached_tokens == 0  # a short prompt is not kept
    store.close()


def test_another_model_or_routing_never_reads_a_kept_prompt(model, tmp_path):
    key = model_key(model)
    assert model_key(model, "experts=4") != key
    other = Path(tmp_path / "other")
    other.mkdir()
    for f in model.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    assert model_key(other) != key  # a copy's files are newer: its checkpoints are its own


def test_a_corrupt_entry_is_one_warning_and_a_fresh_prefill(model, tmp_path, capsys):
    store = PromptStore(tmp_path / "prompts", model_key(model))
    first, started, _ = reply(model, store, SHORT)
    for f in (tmp_path / "prompts").rglob("*.val"):
        f.write_bytes(b"\0" * 64)  # the checkpoint's bytes broken on disk
    again, started2, _ = reply(model, store, SHORT)
    err = capsys.readouterr().err
    assert started2.cached_tokens == 0 and again == first
    assert err.count("tqbench: warning: a kept prompt cache of ") == 1 and "processed again" in err
    third, started3, _ = reply(model, store, SHORT)  # the fresh prefill was kept again
    assert started3.cached_tokens == started.prompt_tokens - 1
    store.close()


def test_the_store_stays_within_its_bytes(model, tmp_path):
    """Checkpoints of three prompts in a store that holds about two: the least recently used goes."""
    probe = PromptStore(tmp_path / "probe", model_key(model))
    reply(model, probe, SHORT)
    one = max(e[2] for e in probe._index().values())  # one checkpoint's bytes
    probe.close()
    store = PromptStore(tmp_path / "prompts", model_key(model), max_bytes=int(2.5 * one))
    texts = [SHORT, "# two\n" + SHORT, "# three\n" + SHORT]  # no prefix of one begins another
    for t in texts:
        reply(model, store, t)
    index = store._index()
    assert len(index) == 2 and sum(e[2] for e in index.values()) <= 2.5 * one
    assert len(list(store.cache.iterkeys())) == 3  # the two entries and the index: the dropped one's file is gone
    assert reply(model, store, texts[1])[1].cached_tokens > 0  # used now: the most recent
    assert reply(model, store, texts[0])[1].cached_tokens == 0  # the oldest was dropped; kept again, it drops texts[2]
    assert reply(model, store, texts[1])[1].cached_tokens > 0 and reply(model, store, texts[2])[1].cached_tokens == 0
    store.close()


@pytest.mark.slow
def test_a_second_process_prefills_only_what_is_new(model, tmp_path):
    """The issue's goal on the demo: a second `tqbench chat` with the same 4k-token prompt reads no experts for the
    prefix (streamed, 4 MB cache) and its prompt takes at most a quarter of the first process's."""
    env = {**os.environ, "TQBENCH_CACHE_DIR": str(tmp_path / "cache")}

    def chat(*extra: str) -> dict:
        stats = tmp_path / "stats.json"
        r = subprocess.run([sys.executable, "-m", "tqbench", "chat", "--model", str(model), "--no-chat-template",
                            "--prompt", TEXT, "--max-tokens", "4", "--cache-budget-gb", "4MB", "--json",
                            "--stats-json", str(stats), *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-1500:]
        done = [json.loads(x) for x in r.stdout.splitlines() if '"done"' in x][-1]
        return {**done, "stats": json.loads(stats.read_text())}

    first, second = chat(), chat()
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == first["prompt_tokens"] - 1
    assert second["prompt_tokens"] == 1 and second["stats"]["prefill"]["misses"] <= 7 * 8  # one token's experts
    assert second["prefill_s"] <= 0.25 * first["prefill_s"]
    off = chat("--no-prompt-cache")
    assert off["cached_tokens"] == 0

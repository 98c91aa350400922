"""A prompt's processing, told as it goes: tqbench runs mlx-lm's prefill loop itself (tqbench.runtime.prefill) so each
chunk yields a PrefillProgress, and the reply is the one mlx-lm's own generation gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from conftest import demo_tq4
from tqbench.chat.events import PrefillProgress, ReplyDone, TokenOut
from tqbench.engine import engine
from tqbench.runtime.conversation import Sampling, generate
from tqbench.runtime.load import load
from tqbench.runtime.prefill import PREFILL_STEP
from tqbench.stream import StreamConfig

TEXT = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parent.parent / "tqbench" / "stream").glob("*.py")))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("prefill"))


def prompt_of(loaded, n: int) -> list[int]:
    tokens = loaded.tokenizer.encode(TEXT, add_special_tokens=True)
    assert len(tokens) >= n
    return list(tokens[:n])


@pytest.mark.slow  # 4,500 tokens prefilled twice, streamed and by mlx-lm (~27 s); the chunk is generate's default
# argument (PREFILL_STEP), so no smaller prompt shows the chunks
def test_a_long_prompt_is_told_chunk_by_chunk_and_replies_as_mlx_lm_does(model):
    """4,500 tokens streamed from a small expert cache: progress after 2,048, 4,096 and 4,499 tokens (mlx-lm's
    chunks, the last token left to the first step), then at 4,500 with the first token; the experts each chunk read
    add up to the streamer's misses; the greedy reply is mlx-lm's stream_generate over the whole prompt, resident."""
    def run():
        streamed = load(model, streaming=StreamConfig(budget_bytes=4_000_000, workers=2))
        tokens = prompt_of(streamed, 4500)
        events = list(generate(streamed, tokens, make_prompt_cache(streamed.model), Sampling(max_tokens=6), 0, []))
        misses = streamed.streamer.stats.misses
        streamed.streamer.close()
        resident = load(model)
        want = [r.token for r in stream_generate(resident.model, resident.tokenizer, mx.array(tokens), max_tokens=6)]
        return events, misses, want

    events, misses, want = engine().call(run)
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert [p.done for p in progress] == [PREFILL_STEP, 2 * PREFILL_STEP, 4499, 4500]
    assert {p.total for p in progress} == {4500}
    assert all(a.seconds <= b.seconds for a, b in zip(progress, progress[1:]))
    assert 0 < progress[-1].experts_read <= misses and progress[-1].bytes_read > 0
    assert [p.experts_read for p in progress] == sorted(p.experts_read for p in progress)
    done = events[-1]
    assert isinstance(done, ReplyDone) and done.prompt_tokens == 4500
    assert abs(done.prefill_s - progress[-1].seconds) < 1e-9 and done.prefill_tps == pytest.approx(4500 / done.prefill_s)
    tokens = [e.id for e in events if isinstance(e, TokenOut)]
    assert tokens == want[:len(tokens)] and len(tokens) >= 3


def test_a_one_token_prompt_has_no_progress(model):
    def run():
        loaded = load(model)
        return list(generate(loaded, prompt_of(loaded, 1), make_prompt_cache(loaded.model), Sampling(max_tokens=2),
                             0, []))

    events = engine().call(run)
    assert not any(isinstance(e, PrefillProgress) for e in events) and isinstance(events[-1], ReplyDone)


@pytest.mark.slow
def test_chat_piped_prints_a_long_prompts_chunks_and_stats_json_splits_prefill_from_decode(model, tmp_path):
    text = TEXT[:16000]
    stats = tmp_path / "stats.json"
    r = subprocess.run([sys.executable, "-m", "tqbench", "chat", "--model", str(model), "--no-chat-template",
                        "--prompt", text, "--max-tokens", "4", "--cache-budget-gb", "4MB", "--stats-json", str(stats)],
                       capture_output=True, text=True, env={**os.environ, "TQBENCH_CACHE_DIR": str(tmp_path / "c")},
                       timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("prompt: ")]
    assert lines[0].startswith(f"prompt: {PREFILL_STEP:,} of ") and "experts read" in lines[0]
    assert lines[-1].startswith("prompt: ") and " tokens processed in " in lines[-1]
    doc = json.loads(stats.read_text())
    assert doc["prefill"]["misses"] + doc["decode"]["misses"] == doc["misses"] and doc["prefill"]["misses"] > 0
    assert doc["prefill"]["critical_bytes"] + doc["decode"]["critical_bytes"] == doc["critical_bytes"]

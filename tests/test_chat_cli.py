"""`tqbench chat` as a user runs it: --prompt, piped turns, --json lines, commands, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import demo_tq4
from cli_helpers import tqbench
from tqbench.demo import SHIPPED_SPEC, ensure_demo
from tqbench.chat.request import ChatRequest
from tqbench.chat.session import ChatSession
from tqbench.runtime.conversation import Sampling

pytestmark = pytest.mark.slow  # a demo conversion and several model loads (~15 s)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("chat"))


def _engine_replies(path: Path, turns: list[str], n: int) -> list[str]:
    """The same conversation through the engine API (what both faces share), for comparison."""
    s = ChatSession()
    try:
        with s.open(ChatRequest(model=str(path))) as job:
            job.result()
        out = []
        for t in turns:
            with s.reply(t, Sampling(max_tokens=n)) as job:
                out.append(job.result()[-1].text)
        return out
    finally:
        s.close()


def test_prompt_answers_once(model, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "def fib(n):", "--max-tokens", "16")
    assert r.code == 0
    assert r.out == _engine_replies(model, ["def fib(n):"], 16)[0] + "\n"
    codebooks = sum(k.endswith(".codebook") for k in json.loads((model / "model.safetensors.index.json").read_text())
                    ["weight_map"])
    assert f"loaded kimi_k3, {codebooks} TurboQuant modules" in r.err
    assert "[16 tokens (max tokens)" in r.err and "tok/s" in r.err and "peak memory" in r.err


def test_piped_lines_are_turns_and_json_lines(model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull) if False else __import__("io").StringIO(
        "def fib(n):\n\n/stats\nclass Node:\n"))
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--max-tokens", "8", "--json")
    assert r.code == 0
    lines = [json.loads(x) for x in r.out.splitlines()]
    done = [x for x in lines if x["event"] == "done"]
    tokens = [x for x in lines if x["event"] == "token"]
    assert len(done) == 2 and len(tokens) == 16
    loaded = lines[0]  # what runs comes first
    assert loaded["event"] == "loaded" and loaded["path"] == str(model) and loaded["model_type"] == "kimi_k3"
    assert loaded["routing_changed"] is False and loaded["stream"] is None and loaded["sampling"]["max_tokens"] == 8
    assert set(tokens[0]) == {"event", "id", "text", "thinking"}
    assert set(done[0]) == {"event", "prompt_tokens", "cached_tokens", "generated_tokens", "prefill_tps",
                            "prefill_s", "warmup", "decode_tps", "peak_memory_bytes", "finish_reason",
                            "routing_changed", "substitutions"}
    assert done[0]["routing_changed"] is False and done[0]["substitutions"] == 0
    assert done[0]["prefill_s"] > 0 and not done[1]["warmup"]  # turn 2 is no first pass, whatever ran before
    assert done[0]["cached_tokens"] == 0 and done[0]["generated_tokens"] == 8
    assert done[1]["cached_tokens"] == done[0]["prompt_tokens"] + 8  # turn 2 reuses turn 1 whole
    replies = _engine_replies(model, ["def fib(n):", "class Node:"], 8)
    assert "".join(t["text"] for t in tokens[:8]) == replies[0]
    assert "".join(t["text"] for t in tokens[8:]) == replies[1]
    assert "conversation: 1 turn, " in r.err  # /stats went to stderr, not into the JSON stream


def test_reset_forgets_the_conversation(model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("def fib(n):\n/reset\ndef fib(n):\n/quit\nnever\n"))
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--max-tokens", "6", "--json")
    done = [json.loads(x) for x in r.out.splitlines() if '"done"' in x]
    assert len(done) == 2 and done[1]["cached_tokens"] == 0 and done[1]["prompt_tokens"] == done[0]["prompt_tokens"]
    assert "conversation reset" in r.err


def test_bad_model_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "chat", "--model", tmp_path, "--prompt", "hi")
    assert r.code == 1 and r.out == ""
    assert r.err.splitlines()[-1] == f"tqbench: error: {tmp_path}: no config.json: not a model directory"
    for given, line in ((tmp_path / "nope" / "model", "no such model directory"),
                        (Path(__file__), "not a directory (give the model's directory)")):
        r = tqbench(capsys, monkeypatch, "chat", "--model", given, "--prompt", "hi")
        assert r.code == 1 and r.out == "" and r.err.splitlines()[-1] == f"tqbench: error: {given}: {line}"


def test_a_fresh_process_shows_no_library_chatter(model):
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "tqbench", "chat", "--model", str(model), "--prompt", "x",
                        "--max-tokens", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "You are using a model of type" not in p.stderr and "Warning" not in p.stderr
    assert [ln.split(" ")[0] for ln in p.stderr.splitlines()] == ["loading", "loaded", "hot-expert", "[2"]


def test_without_a_model_chat_converts_the_demo_once_then_opens_the_last_conversion(tmp_path, capsys, monkeypatch):
    first = tqbench(capsys, monkeypatch, "chat", "--prompt", "x", "--max-tokens", "2")
    assert first.code == 0, first.err
    demo = ensure_demo()
    dest = demo.parent / f"{demo.name}-tq4-g64"  # where the TUI's Convert screen puts the demo's tq4 conversion too
    assert "converting the demo first" in first.err and (dest / "config.json").is_file()
    assert f"model: {dest} (demo, converted now with tq4-g64)" in first.err
    again = tqbench(capsys, monkeypatch, "chat", "--prompt", "x", "--max-tokens", "2")
    assert "converting" not in again.err and "(last converted model)" in again.err
    assert again.out == first.out  # greedy: the same model gives the same answer
    # a conversion made with `tqbench convert` becomes the default
    dest = tmp_path / "mine"
    conv = tqbench(capsys, monkeypatch, "convert", "--hf-path", ensure_demo(), "--mlx-path", dest, "-r", "affine4")
    assert conv.code == 0, conv.err
    third = tqbench(capsys, monkeypatch, "chat", "--prompt", "x", "--max-tokens", "2")
    assert f"model: {dest.resolve()} (last converted model)" in third.err
    assert "loaded kimi_k3:" in third.err  # affine: no TurboQuant modules


def test_streaming_flags_write_stats_json(model, tmp_path, capsys, monkeypatch):
    stats = tmp_path / "stats.json"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "def fib(n):", "--max-tokens", "16",
                "--cache-budget-gb", "0.0002", "--prefetch-workers", "2", "--cache-policy", "lru", "--fanout",
                "--stats-json", stats)
    assert r.code == 0, r.err
    assert r.out == _engine_replies(model, ["def fib(n):"], 16)[0] + "\n"  # streamed text == resident text
    assert "streaming experts: cache 200.00 kB" in r.err and "2 read workers, lru, fan-out, page cache on" in r.err
    doc = json.loads(stats.read_text())
    assert {"budget_bytes", "cache_bytes_max", "hits", "misses", "critical_bytes", "speculative_bytes", "reads",
            "tokens", "layers"} <= set(doc)
    assert doc["budget_bytes"] == 200_000 and doc["cache_bytes_max"] + doc["staging_bytes"] <= 200_000
    assert doc["tokens"] >= 16 and doc["misses"] > 0 and doc["reads"] >= doc["misses"]
    # the bandwidth the page-ins got, and this disk's (measured now: nothing cached yet; cached for plan and the TUI)
    assert doc["disk_bytes_per_s_on_misses"] == doc["critical_bytes"] / doc["stall_s"]
    assert doc["disk_bytes_per_s"] > 0 and doc["disk_source"].startswith("measured")
    bad = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--cache-budget-gb", "lots")
    assert bad.code == 1 and bad.err.splitlines()[-1] == ("tqbench: error: cache budget 'lots': give fit, auto, off or "
                                                          "a size (8GB, 512MB; a bare number is GB)")
    # --stats-json is checked before any work: a missing directory, a directory, a model that runs resident
    missing = tmp_path / "no-such-dir" / "stats.json"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--stats-json", missing)
    assert r.code == 1 and r.out == "" and "loading" not in r.err
    assert r.err == f"tqbench: error: {missing.parent}: --stats-json: no such directory\n"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--stats-json", tmp_path)
    assert r.code == 1 and r.err == f"tqbench: error: {tmp_path}: --stats-json: this is a directory; give a file\n"
    resident = tmp_path / "resident.json"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--stats-json", resident)
    assert r.code == 2 and r.out == "" and not resident.exists()
    assert r.err.splitlines()[-1] == ("tqbench: error: --stats-json writes streaming statistics, and this model's "
                                      "experts run resident (fits): stream them with --cache-budget-gb, or leave "
                                      "out --stats-json")
    many = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--max-tokens", "2",
                   "--max-active-experts", "1")
    k = SHIPPED_SPEC.num_experts_per_token
    assert many.code == 0 and f"warning: routing to 1 of the model's {k} experts per token" in many.err

"""Cache-aware routing (`--cache-routing MARGIN`): in decode, a streamed MoE block's selection bias is raised by MARGIN
for the experts its layer holds in the expert cache, so the router may take a cached expert over an uncached one
within MARGIN of it. Checked on the shipped demo converted with tq4 (kimi_k3), against numpy computations of the
router, and on tiny deepseek_v3 and qwen3_moe checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cli_helpers import tqbench
from conftest import demo_tq4
from test_runtime_families import write_deepseek_v3, write_qwen3_moe
from tqbench.chat.request import StreamRequest
from tqbench.convert import convert
from tqbench.chat.stream_plan import plan_streaming
from tqbench.errors import TqbenchError
from tqbench.eval import EvalReport, EvalRequest, EvalStarted, evaluate
from tqbench.eval.report import report_dict
from tqbench.recipe import Recipe
from tqbench.runtime.load import load
from tqbench.stream.attach import CacheRoutedBlock
from tqbench.stream.budget import model_bytes
from tqbench.stream.pagein import staging_bytes
from tqbench.stream.streamer import StreamConfig

PROMPT = [4352, 100, 517, 2300, 42, 7, 1311, 260, 9, 88, 1000, 61]
STEPS = 16  # decode steps after the prompt
WORKERS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("routing"))


def budget_for(path: Path, slots: int) -> int:
    return staging_bytes(model_bytes(path).one_expert, WORKERS) + slots * model_bytes(path).one_expert


def streamed(path: Path, slots: int, margin: float):
    return load(path, streaming=StreamConfig(budget_bytes=budget_for(path, slots), workers=WORKERS, page_cache="on",
                                             cache_routing=margin))


def decode(m: nn.Module, steps: int = STEPS) -> np.ndarray:
    """The prompt's logits, then `steps` greedy decode steps' (one token per pass), as float32."""
    cache = make_prompt_cache(m)
    out = [m(mx.array([PROMPT]), cache=cache)[0]]
    for _ in range(steps):
        out.append(m(mx.argmax(out[-1][-1:], axis=-1)[None], cache=cache)[0])
    return np.concatenate([np.array(o.astype(mx.float32)) for o in out])


def wrappers(m: nn.Module) -> list[CacheRoutedBlock]:
    return [b for _, b in m.named_modules() if isinstance(b, CacheRoutedBlock)]


@pytest.fixture(scope="module")
def native(model) -> np.ndarray:
    return decode(load(model).model)


def test_margin_zero_installs_nothing_and_is_bit_identical(model, native):
    assert plan_streaming(model, StreamRequest(budget="1MB")).config.cache_routing == 0.0
    loaded = streamed(model, 150, 0.0)
    try:
        assert wrappers(loaded.model) == []
        np.testing.assert_array_equal(decode(loaded.model), native)
        st = loaded.streamer.stats
        assert st.misses > 0 and st.substitutions == 0
        assert st.to_dict()["cache_routing"] == 0.0 and st.to_dict()["substitutions"] == 0
    finally:
        loaded.streamer.close()


def test_a_margin_cuts_misses_and_counts_substitutions(model, native):
    runs = {}
    for margin in (0.0, 0.05):
        loaded = streamed(model, 150, margin)
        try:
            runs[margin] = (decode(loaded.model), loaded.streamer.stats)
            assert len(wrappers(loaded.model)) == (7 if margin else 0)  # the demo's 7 MoE layers
        finally:
            loaded.streamer.close()
    (logits0, st0), (logits, st) = runs[0.0], runs[0.05]
    np.testing.assert_array_equal(logits0, native)  # margin 0: the model's own routing, streamed or not
    assert st.misses < st0.misses and st.substitutions > 0 and st0.substitutions == 0
    assert st.to_dict()["cache_routing"] == 0.05 and st.to_dict()["substitutions"] == st.substitutions
    n = len(PROMPT)
    np.testing.assert_array_equal(logits[:n], native[:n])  # the prompt's pass routes natively
    assert np.abs(logits[n:] - native[n:]).max() > 0  # decode does not


def test_cache_routing_goes_with_lookahead(model):
    from tqbench.stream.attach import LookaheadBlock

    loaded = load(model, streaming=StreamConfig(budget_bytes=budget_for(model, 150), workers=WORKERS, page_cache="on",
                                                lookahead=True, cache_routing=0.05))
    try:
        blocks = [b for _, b in loaded.model.named_modules() if isinstance(b, LookaheadBlock)]
        assert len(blocks) == 6 and all(isinstance(b.block, CacheRoutedBlock) for b in blocks)  # the last has no next
        assert len(wrappers(loaded.model)) == 7
        decode(loaded.model)
        st = loaded.streamer.stats
        assert st.substitutions > 0 and st.lookahead_reads > 0 and st.lookahead_used > 0
    finally:
        loaded.streamer.close()


class _GateRecorder(nn.Module):
    """Stands in for a block's gate: the gate's output and the layer's resident experts at each call."""

    def __init__(self, gate: nn.Module, layer: int, streamer):
        super().__init__()
        self.gate = gate
        self.calls: list[tuple[mx.array, set[int]]] = []
        self._where = (layer, streamer)

    def __call__(self, x: mx.array) -> mx.array:
        layer, streamer = self._where
        g = self.gate(x)
        self.calls.append((g, {e for n, e in streamer.pool_of[layer].cache.slots if n == layer}))
        return g


def _top(values: np.ndarray, k: int) -> set[int]:
    return {int(e) for e in np.argsort(-values, kind="stable")[:k]}


@pytest.mark.parametrize("slots", [150, 600])  # fewer slots than a layer's 448 experts, and more
def test_substitutions_equal_a_numpy_recomputation_of_the_router(model, slots):
    margin, k = 0.05, 8
    loaded = streamed(model, slots, margin)
    try:
        m, s = loaded.model, loaded.streamer
        recorders = {}
        for w in wrappers(m):
            layer = w._hidden.layer
            recorders[layer] = w.block.gate = _GateRecorder(w.block.gate, layer, s)
        cache = make_prompt_cache(m)
        logits = m(mx.array([PROMPT]), cache=cache)
        counted, substituted = s.stats.substitutions, 0
        for _ in range(STEPS):
            for r in recorders.values():
                r.calls.clear()
            s.drain()
            logits = m(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
            mx.eval(logits)
            routed = {ev.layer: set(ev.experts) for ev in s.drain()}
            for layer, r in recorders.items():
                [(g, resident)] = r.calls  # the block's (the native picks' router holds the gate itself)
                scores = 1 / (1 + np.exp(-np.array(g.astype(mx.float32))[0, 0].astype(np.float64)))
                bias = np.array(next(w.block for w in wrappers(m) if w._hidden.layer == layer).e_score_correction_bias)
                mask = np.zeros_like(scores)
                mask[list(resident)] = 1
                want = _top(scores + bias + margin * mask, k)
                assert routed[layer] == want
                substituted += len(want - _top(scores + bias, k))
        assert s.stats.substitutions - counted == substituted > 0
    finally:
        loaded.streamer.close()


def test_substituted_experts_weigh_their_unbiased_scores_renormalised(model):
    margin = 1.0  # the cached experts win wherever there are enough of them
    loaded = streamed(model, 150, margin)
    try:
        m, s = loaded.model, loaded.streamer
        decode(m, 4)  # fill the cache
        w = wrappers(m)[2]
        b, layer = w.block, w._hidden.layer
        x = mx.array(np.random.default_rng(1).standard_normal((1, 1, b.gate.weight.shape[1])).astype(np.float32))
        resident = [e for n, e in s.pool_of[layer].cache.slots if n == layer]
        y = w(x)
        mx.eval(y)
        g = np.array(b.gate(x).astype(mx.float32))[0, 0].astype(np.float64)
        scores = 1 / (1 + np.exp(-g))
        select = scores + np.array(b.e_score_correction_bias)
        mask = np.zeros_like(scores)
        mask[resident] = 1
        k = b.args.num_experts_per_token
        inds = np.array(sorted(_top(select + margin * mask, k)))
        assert set(inds) != _top(select, k) and set(inds) <= set(resident)  # substituted
        assert b.args.moe_renormalize

        def rebuilt(weights: np.ndarray) -> mx.array:
            """The kimi_k3 block's computation with the given experts and weights."""
            h = b.routed_expert_down_proj(x) if b.latent_size is not None else x
            h = b.switch_mlp(h, mx.array(inds[None, None].astype(np.uint32)))
            h = (h * mx.array(weights.astype(np.float32))[None, None, :, None]).sum(axis=-2)
            if b.routed_expert_norm is not None:
                h = b.routed_expert_norm(h)
            if b.latent_size is not None:
                h = b.routed_expert_up_proj(h)
            return h + b.shared_experts(x)

        unbiased = scores[inds] / scores[inds].sum() * b.args.routed_scaling_factor
        np.testing.assert_allclose(np.array(y), np.array(rebuilt(unbiased)), rtol=1e-4, atol=1e-5)
        boosted = (select + margin * mask)[inds]
        assert not np.allclose(np.array(y), np.array(rebuilt(boosted / boosted.sum())), rtol=1e-3, atol=1e-4)
    finally:
        loaded.streamer.close()


def test_deepseek_v3_routes_by_cache_and_qwen3_moe_is_refused(tmp_path):
    ds = tmp_path / "deepseek_v3-tq"  # converted: MLX's CPU gather runs float32, not the source's bf16
    list(convert(write_deepseek_v3(tmp_path / "deepseek_v3"), ds, Recipe.parse("tq3a-tqTe-down4-g64"), 10**9))
    one = model_bytes(ds).one_expert
    config = StreamConfig(budget_bytes=staging_bytes(one, WORKERS) + 3 * one, workers=WORKERS, page_cache="on")
    resident = load(ds).model
    cache = make_prompt_cache(resident)
    want = [np.array(resident(mx.array([[t]]), cache=cache).astype(mx.float32)) for t in range(100, 120)]
    out = {}
    for margin in (0.0, 1.0):
        loaded = load(ds, streaming=replace(config, cache_routing=margin))
        try:
            cache = make_prompt_cache(loaded.model)
            out[margin] = ([np.array(loaded.model(mx.array([[t]]), cache=cache).astype(mx.float32))
                            for t in range(100, 120)], loaded.streamer.stats)
            assert len(wrappers(loaded.model)) == (1 if margin else 0)  # its one MoE layer
        finally:
            loaded.streamer.close()
    for got, ref in zip(out[0.0][0], want):
        np.testing.assert_array_equal(got, ref)
    assert out[1.0][1].substitutions > 0 and out[1.0][1].misses < out[0.0][1].misses

    qwen = write_qwen3_moe(tmp_path / "qwen3_moe")
    one = model_bytes(qwen).one_expert
    with pytest.raises(TqbenchError, match=r"^--cache-routing: .*has no selection bias") as e:
        load(qwen, streaming=StreamConfig(budget_bytes=staging_bytes(one, WORKERS) + 3 * one, workers=WORKERS,
                                          cache_routing=0.1))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("margin", [-0.1, 1.5, float("nan")])
def test_a_margin_outside_0_to_1_is_one_line(margin):
    with pytest.raises(TqbenchError) as e:
        StreamRequest(budget="1MB", cache_routing=margin).check()
    assert str(e.value) == f"cache routing margin {margin:g}: give 0 (off) to 1"


@pytest.mark.parametrize("command", ["chat", "serve", "eval"])
@pytest.mark.parametrize("value, why", [("1.5", "Input should be less than or equal to 1"),
                                        ("-1", "Input should be greater than or equal to 0"),
                                        ("lots", "Input should be a valid number, unable to parse string as a number")])
def test_cli_refuses_a_bad_margin(command, value, why, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    r = tqbench(capsys, monkeypatch, command, *(["model"] if command == "eval" else []), "--cache-routing", value)
    assert r.code == 2 and r.out == ""
    assert r.err.splitlines()[-1] == f"Error: Invalid value for '--cache-routing': {why}"
    assert "Traceback" not in r.err


def test_cli_refuses_cache_routing_on_a_resident_model(model, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--cache-routing", "0.05", "--prompt", "hi")
    assert r.code != 0 and r.out == ""
    assert r.err.strip().splitlines() == [
        "tqbench: error: --cache-routing favours experts in the expert cache, and this model's experts run resident "
        "(fits): stream them with a cache budget, or leave cache routing at 0"]


def test_chat_says_its_routing_changed(model, capsys, monkeypatch, tmp_path):
    stats = tmp_path / "stats.json"
    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--cache-budget-gb", "1MB", "--cache-routing", "0.05",
                "--prompt", "hi", "--max-tokens", "8", "--temp", "0", "--no-learn", "--stats-json", stats)
    assert r.code == 0, r.err
    assert "; routing changed: cache routing margin 0.05" in r.err
    doc = json.loads(stats.read_text())
    assert doc["cache_routing"] == 0.05 and doc["substitutions"] > 0


@pytest.mark.slow  # three streamed evaluations of 48 tokens, two of them token by token (~12 s)
def test_eval_scores_token_by_token_and_marks_the_routing_changed(model):
    def run(margin: float, decode: bool = False) -> tuple[EvalStarted, EvalReport]:
        events = list(evaluate(EvalRequest(model=str(model), against=str(model), window=24, tokens=48, prompts=0,
                                           decode=decode,
                                           stream=StreamRequest(budget="1MB", workers=WORKERS, cache_routing=margin))))
        return events[0], events[-1]

    started, same = run(0.0, decode=True)
    assert not started.cache_routing and started.decode and not same.routing_changed
    assert same.total.kl == 0 and same.total.top1_agree == same.total.tokens == 48
    assert same.model_misses_per_token > 0 and same.model_substitutions_per_token == 0

    started, changed = run(0.05)
    assert started.cache_routing == 0.05 and started.decode  # cache routing scores token by token
    assert changed.routing_changed and changed.decode and changed.cache_routing == 0.05
    assert changed.total.kl > 0 and changed.total.ref_nll_sum == same.total.ref_nll_sum  # SRC routed natively
    assert 0 < changed.model_misses_per_token < same.model_misses_per_token
    assert changed.model_substitutions_per_token > 0
    doc = report_dict(changed)
    assert doc["routing_changed"] is True and doc["cache_routing"] == 0.05 and doc["decode"] is True
    assert doc["per_token"] == {"misses": changed.model_misses_per_token,
                                "substitutions": changed.model_substitutions_per_token}

    _, batched = run(0.0)
    assert not batched.decode and not batched.routing_changed


@pytest.mark.slow  # a streamed `tqbench eval`, token by token, and a refused one (~6 s)
def test_eval_cli_prints_the_routing_change(model, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "eval", model, "--against", model, "--cache-routing", "0.05", "--cache-budget-gb",
                "1MB", "--tokens", "24", "--window", "24", "--prompts", "0", "--json")
    assert r.code == 0, r.err
    assert "token by token" in r.err and "routing changed: cache routing margin 0.05" in r.err
    doc = json.loads(r.out)
    assert doc["routing_changed"] is True and doc["per_token"]["substitutions"] > 0
    r = tqbench(capsys, monkeypatch, "eval", model, "--against", model, "--layers", "--decode")
    assert r.code == 2 and r.err.strip().splitlines()[-1].endswith("leave out --decode and --cache-routing")


async def test_the_tui_streaming_settings_set_the_margin():
    from textual.app import App
    from textual.widgets import Input, Static

    from tqbench.chat.request import ChatRequest
    from tui.screens.chat_settings import SettingsScreen

    chosen = []

    class Host(App):
        def on_mount(self) -> None:
            self.push_screen(SettingsScreen(ChatRequest()), chosen.append)

    app = Host()
    async with app.run_test(size=(80, 30)) as pilot:
        field = app.screen.query_one("#opt-routing", Input)
        assert field.value == "0"
        field.value = "1.5"
        field.focus()
        await pilot.press("enter")
        error = app.screen.query_one("#settings-error", Static)
        assert error.display and str(error.render()) == "cache routing margin 1.5: give 0 (off) to 1"  # in place
        field.value = "0.05"
        await pilot.press("enter")
        await pilot.pause()
    assert [c.stream.cache_routing for c in chosen] == [0.05]


def test_chat_and_serve_figures_say_the_routing_changed(model):
    from tqbench.chat import report
    from tqbench.chat.request import ChatRequest
    from tqbench.chat.session import ChatSession
    from tqbench.runtime.conversation import Sampling
    from tqbench.serve import metrics, wire
    from tqbench.serve import report as serve_report
    from tqbench.serve.service import ServeStatus

    chat = ChatSession()
    try:
        with chat.open(ChatRequest(model=str(model),
                                   stream=StreamRequest(budget="1MB", workers=WORKERS, cache_routing=0.05))) as job:
            loaded = job.result()[-1]
        with chat.reply("hello", Sampling(max_tokens=8, temp=0.0)) as job:
            job.result()
        stats = chat.stats()
        status = chat.status()
    finally:
        chat.close()
    assert loaded.stream.cache_routing == 0.05 and loaded.stream.to_dict()["cache_routing"] == 0.05
    assert report.streaming_text(loaded).endswith(", routing changed: cache routing margin 0.05")
    s = stats.stats
    assert s.cache_routing == 0.05 and s.substitutions > 0 and stats.to_dict()["substitutions"] == s.substitutions
    assert (f"routing changed: cache routing margin 0.05: {s.substitutions} experts routed in place of the model's own "
            f"picks ({s.substitutions / s.tokens:.2f} per forward pass)") in report.stats_lines(loaded, status, stats)

    served = ServeStatus(model="demo", url="http://127.0.0.1:1", uptime_s=1.0, requests=1, ok=1, cancelled=0, failed=0,
                         rejected=0, refused=0, running=0, queued=0, prompt_tokens=1, cached_tokens=0,
                         completion_tokens=8, decode_tps=10.0, ttft_s=0.1, stream=stats)
    assert (f"routing changed: cache routing margin 0.05: {s.substitutions:,} experts routed in place of the model's "
            "own picks") in serve_report.status_lines(served)
    assert f"tqbench_expert_substitutions_total {s.substitutions}\n" in metrics.prometheus(served)
    back = wire.decode_status(wire.status_dict(served))  # a face attached to the server sees it too
    assert (back.stream.stats.cache_routing, back.stream.stats.substitutions) == (0.05, s.substitutions)

"""One journey through the app, as a user walks it with the keys alone, on real files: the built-in demo opened on the
Source screen, a recipe typed on the Recipe screen, that recipe converted on the Convert screen into a directory of
this test, the conversion opened by the Chat screen, streaming switched on in its settings dialog, one reply with
the live expert view, the learned profile exported and then shown on the Profile screen. Every figure is checked
against the engine (the checkpoint, the plan, the output's files, a second run of the same reply, the session's
StreamStats, the exported file). Plus full-screen snapshots of the Chat screen after a reply and of the help screen.

The cache directory is the test's own (tests/conftest.py sets TQBENCH_CACHE_DIR): the demo's copy, the state file
(the last converted model) and the profile store all live there, never in the user's cache.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from textual.widgets import Input

from conftest import converted_copy
from test_tui import write_tiny
from test_tui_chat import BUDGET, STREAM, engine_page_ins, screen_text, status
from tqbench import units
from tqbench.demo import ensure_demo
from tqbench.layout.names import INDEX_FILE
from tqbench.paths import cache_dir
from tqbench.profile import identify, read_file
from tqbench.profile.report import number
from tqbench.recipe import Recipe, group_sources, make_plan
from tqbench.source import open_checkpoint
from tqbench.state import last_model, remember_model
from tqbench.stream import ExpertStore
from tui.app import TqbenchApp
from tqbench.chat.live import KINDS, ReplyRates
from tui.screens.chat import ChatScreen
from tui.screens.chat_settings import SettingsScreen
from tui.screens.convert import ConvertScreen
from tui.screens.help import HelpScreen
from tui.screens.profile import ProfileScreen
from tui.screens.recipe import RecipeScreen
from tui.screens.source import SourceScreen
from tui.widgets.heat_map import HeatMap
from tui_helpers import settle, wait_for

pytestmark = pytest.mark.slow

SIZE = (100, 30)
RECIPE = "tq4"  # cheap to convert; its full name is tq4-g64
OUTPUT = "demo-tq4"  # typed on the Convert screen: relative to the working directory (the test's tmp_path)
PROMPT = "def parse_args(argv):"


async def go(pilot, key: str, screen_type: type):
    await pilot.press(key)
    await settle(pilot)
    assert isinstance(pilot.app.screen, screen_type), (key, pilot.app.screen)
    return pilot.app.screen


async def test_source_recipe_convert_chat_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = ensure_demo()  # the copy in this test's cache dir, which the app opens with no path given
    ckpt = open_checkpoint(demo)
    plan = make_plan(group_sources(ckpt), Recipe.parse(RECIPE))
    dest = tmp_path / OUTPUT
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        # ---- Source: the built-in demo ---------------------------------------------------------------------------
        await settle(pilot)
        await wait_for(pilot, lambda: app.checkpoint is not None, "the demo checkpoint")
        await settle(pilot)
        assert isinstance(app.screen, SourceScreen) and app.checkpoint.path.resolve() == demo.resolve()
        shown = screen_text(pilot)
        assert f"{len(ckpt.tensors):,} in {len(ckpt.shards)} shards" in shown
        assert f"{units.gb(ckpt.present_bytes)}" in shown and "kimi_k3" in shown

        # ---- Recipe: type a recipe name into the editor's name field -------------------------------------------------
        screen = await go(pilot, "p", RecipeScreen)
        await pilot.press("shift+tab", "ctrl+u", *RECIPE, "enter")  # from the base row back to the name field
        await settle(pilot)
        assert app.recipe == Recipe.parse(RECIPE) and screen.recipe == Recipe.parse(RECIPE)
        await wait_for(pilot, lambda: Recipe.parse(RECIPE) in screen.shown and not screen.editor._busy, "the plan")
        await settle(pilot)
        shown = screen_text(pilot)
        assert "tq4-g64" in shown and units.gb(plan.total_bytes) in shown and units.gb(plan.streamed_bytes) in shown
        await pilot.press("escape")  # leave the name field: the app's keys work again

        # ---- Convert: the Recipe screen's recipe, into a directory typed here ------------------------------------
        screen = await go(pilot, "c", ConvertScreen)
        assert screen.recipe == Recipe.parse(RECIPE)
        await wait_for(pilot, lambda: screen.status is not None and not screen.checking, "the destination check")
        await pilot.press("shift+tab", "shift+tab")  # from the table back to the output field
        assert app.focused is screen.query_one("#dest", Input)
        await pilot.press("ctrl+u", *OUTPUT, "enter")
        await wait_for(pilot, lambda: screen.dest == Path(OUTPUT) and screen.check_action("start", ()) is True,
                       "the new destination's check")
        assert screen.status.state == "new" and "new output: 1 shard" in screen_text(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.finished_event is not None, "the conversion", seconds=180)
        await settle(pilot)
        done = screen.finished_event
        assert Path(done.dest).resolve() == dest.resolve() and (dest / INDEX_FILE).is_file()
        assert json.loads((dest / "config.json").read_text())["quantization"]["recipe"]["name"] == "tq4-g64"
        assert done.bytes_out == sum(p.stat().st_size for p in dest.glob("*.safetensors"))
        assert last_model() == dest.resolve()  # remembered: the Chat screen opens it
        shown = screen_text(pilot)
        assert f"written to {OUTPUT}" in shown and "complete: already converted with this recipe" in shown

        # ---- Chat: the conversion, streaming with a small cache ------------------------------------------------------
        screen = await go(pilot, "t", ChatScreen)
        await wait_for(pilot, lambda: screen.loaded is not None or screen.error is not None, "the model")
        assert screen.error is None and Path(screen.loaded.path).resolve() == dest.resolve()
        assert f"{OUTPUT}  (last converted model)" in screen.query_one("#chat-model").text
        assert screen.loaded.stream is None and "experts resident: o streams them" in screen_text(pilot)

        await pilot.press("escape", "o")  # leave the message field; the streaming settings
        assert isinstance(app.screen, SettingsScreen)
        assert app.focused is app.screen.query_one("#opt-budget", Input)
        await pilot.press("ctrl+u", *BUDGET, "tab", "tab", "tab")  # the budget, then past the host tier and the
        # experts per token, on to the prefetch workers
        assert app.focused is app.screen.query_one("#opt-workers", Input)
        await pilot.press("ctrl+u", *str(STREAM.workers), "enter")  # enter applies
        assert app.screen is screen
        await wait_for(pilot, lambda: screen.loaded is not None and screen.loaded.stream is not None, "re-opening")
        await settle(pilot)
        assert screen.request.stream == STREAM and screen.query_one("#expert-panel").display
        assert "streaming experts: cache 1.00 MB, 1 worker, lrfu-next" in screen_text(pilot)
        assert "no expert routed yet; cache 1.00 MB" in screen_text(pilot)

        assert app.focused is screen.chat_input  # the new conversation's message field has the keys
        await pilot.press(*PROMPT, "enter")
        await wait_for(pilot, lambda: screen.last_done is not None and not screen.replying, "the reply")
        await settle(pilot)
        reply = screen.last_done
        assert reply.text and screen.transcript.turns[-1].text == reply.text
        assert f"reply   {reply.generated_tokens} tokens" in status(screen)
        m = screen.experts.experts
        stats = screen.chat.stats().to_dict()  # the engine's own figures for this session
        assert stats["misses"] > 0 and stats["hits"] > 0
        routed = {(n, e) for n, st in m.layers.items() for e in range(st.experts) if m.cell(n, e)[0] is not None}
        assert routed and {n for n, _ in routed} == set(m.layers)  # every MoE layer has routed cells
        assert m.seen["miss"] == stats["misses"] and m.hits() == stats["hits"]
        assert m.hit_rate() == stats["hits"] / (stats["hits"] + stats["misses"])
        assert round(m.hit_rate(), 4) == stats["hit_rate"] == screen.experts.report.to_dict()["hit_rate"]  # the engine rounds it
        shown = screen_text(pilot)
        assert f"hits {stats['hit_rate']:.1%}" in shown and "of 1.00 MB" in shown
        assert all(f"L{n} " in shown for n in m.layers)

        # ---- export the learned profile (e) ----------------------------------------------------------------------
        await pilot.press("escape", "e")
        out = cache_dir() / "profile-exports" / f"{OUTPUT}.json"
        await wait_for(pilot, lambda: out.is_file() and "profile exported" in status(screen), "the export")
        exported = read_file(out, *identify(dest))  # refused if it were not this model's profile
        counts = exported.counts()
        assert exported.routings > 0 and sum(c.sum() for c in counts.values()) > 0
        assert sorted(counts) == sorted(m.layers)
        decode = sum(c.sum() for c in exported.decode.values())
        prefill = sum(c.sum() for c in exported.prefill.values())
        assert decode + prefill == exported.routings
        assert f"{exported.routings:,.0f} routings" in status(screen)

        # ---- Profile: the learned profile of the same model ------------------------------------------------------
        profile = await go(pilot, "h", ProfileScreen)
        await wait_for(pilot, lambda: profile.overview is not None, "the profile")
        await settle(pilot)
        learned = profile.overview
        assert profile.shown_model.resolve() == dest.resolve() and learned.source == "learned"
        assert learned.summary.routings == exported.routings > 0 and learned.summary.sessions == 1
        heat = profile.query_one(HeatMap)
        layers = sorted(counts)
        assert heat.layer_ids == layers and np.array_equal(heat.counts, np.stack([counts[n] for n in layers]))
        shown = screen_text(pilot)
        assert f"learned: {number(learned.summary.routings)} routings, 1 session" in shown
        assert f"{len(layers)} MoE layers x 448 experts, top-8" in shown

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "q")
        await wait_for(pilot, lambda: not app.is_running, "the app to quit")

    # The same reply run directly on the engine with the same streaming settings: the same page-ins and stats.
    events, direct = engine_page_ins(dest, PROMPT)
    last = {}
    for ev in events:
        last.update({(ev.layer, e): how for e, how in zip(ev.experts, ev.served)})
    assert {(n, e): m.cell(n, e)[0] for n, e in routed} == last
    assert m.seen == {k: sum(how == k for ev in events for how in ev.served) for k in KINDS}
    assert {k: direct[k] for k in ("hits", "misses", "hit_rate")} == {k: stats[k] for k in ("hits", "misses",
                                                                                             "hit_rate")}
    store = ExpertStore.open(dest)
    store.close()
    assert {n: st.experts for n, st in m.layers.items()} == {n: lay.experts for n, lay in store.layers.items()}


# ---- snapshots -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The demo converted with tq4 by the engine: a copy of the test session's conversion, named OUTPUT."""
    return converted_copy(tmp_path_factory.mktemp("journey"), RECIPE, name=OUTPUT)


def freeze_clocks(monkeypatch) -> None:
    """What the clock measures is fixed (load time, rates, stall times, peak memory, the disk's bandwidth); the rest
    is the engine's."""
    def ready(original):
        def handler(self, message):
            stream = message.loaded.stream  # and the disk's measured bandwidth
            disk = stream and stream.disk and dataclasses.replace(stream.disk, bytes_per_s=1.5e9)
            message.loaded = dataclasses.replace(message.loaded, seconds=1.0,
                                                 stream=stream and dataclasses.replace(stream, disk=disk))
            original(self, message)
        return handler

    def experts(original):
        def handler(self, message):
            message.events = tuple(dataclasses.replace(ev, stall_s=0.001 * ev.layer) for ev in message.events)
            message.rates = ReplyRates(tok_s=20.0, bytes_per_token=message.rates.bytes_per_token, read_bps=4e6)
            original(self, message)
        return handler

    def ended(original):
        def handler(self, message):
            if message.done is not None:
                # warmup: not the process's first reply, whichever test ran first
                message.done = dataclasses.replace(message.done, decode_tps=20.0, prefill_tps=60.0,
                                                   peak_memory_bytes=12_000_000, warmup=False)
            original(self, message)
        return handler

    for name, wrap in (("on_chat_model_ready", ready), ("on_chat_experts", experts),
                       ("on_chat_reply_ended", ended)):
        monkeypatch.setattr(ChatScreen, name, wrap(getattr(ChatScreen, name)))


# The reply the snapshot shows: the tq4 demo's greedy reply to PROMPT where the snapshot was taken. Greedy decoding of
# this small model meets exact ties between bf16 logits (the second token's two best are equal), so CPUs whose
# arithmetic differs in the last bit decode other replies; the snapshot test chooses these tokens (the model still
# computes every step, routes and pages in its experts for them) so that the picture does not depend on the CPU.
SNAPSHOT_REPLY = ("`class email._header_args_wraps(lang)`\n\nAbstract base class for defining command classes that are "
                  "defined in a single module.")


def force_reply(monkeypatch, text: str) -> None:
    """Replies choose `text`'s tokens, then the end of the turn, whatever the logits say (mlx-lm's sampler is the
    one seam: the engine builds it with make_sampler for every reply)."""
    import mlx.core as mx
    import mlx_lm.sample_utils as sample_utils

    from tqbench.demo import ensure_demo
    from tqbench.runtime.load import load

    tok = load(ensure_demo(), lazy=True).tokenizer  # the tokenizer only: the weights are never evaluated
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]

    def make_sampler(*args, **kwargs):
        chosen = iter(ids)
        return lambda logprobs: mx.array([next(chosen, tok.eos_token_id)], dtype=mx.uint32)

    monkeypatch.setattr(sample_utils, "make_sampler", make_sampler)


def force_routing(monkeypatch) -> None:
    """Each streamed MoE layer pages in experts chosen by position, not by the router's scores: those differ in the
    last bit between CPUs too and pick other experts at near ties. A layer's k experts for its n-th routed position are
    k distinct members of a per-layer pool of 48 spread over the layer, so the cache both hits and misses as in a real
    reply; the streamer, its cache and the live view do the rest as usual."""
    import mlx.core as mx
    import numpy as np

    from tqbench.stream.streamer import Streamer

    original, positions = Streamer.run, {}

    def run(self, layer, inner, x, indices):
        *lead, k = indices.shape
        n = int(np.prod(lead))
        start = positions.get(layer, 0)
        positions[layer] = start + n
        t = np.arange(start, start + n)[:, None]
        member = (5 * t + 6 * np.arange(k)[None, :]) % 48  # k <= 8 distinct members per position
        experts = (37 * layer + 9 * member) % self.store.layers[layer].experts
        return original(self, layer, inner, x, mx.array(experts.reshape(*lead, k), dtype=indices.dtype))

    monkeypatch.setattr(Streamer, "run", run)


def test_snapshot_chat_screen_after_a_reply(converted, monkeypatch, snap_compare):
    """The Chat screen at 80x24 streaming the tq4 demo from a 1 MB cache (one read worker: the same hits every run),
    after one reply: the transcript, the expert map beside it, the summary and the reply's figures. The clock's
    figures are frozen (freeze_clocks), the reply's tokens and the experts paged in chosen (force_reply,
    force_routing: the real engine's figures on the real model are the journey test's); paths are relative to the
    working directory."""
    remember_model(converted)
    monkeypatch.chdir(converted.parent)
    freeze_clocks(monkeypatch)
    force_reply(monkeypatch, SNAPSHOT_REPLY)
    force_routing(monkeypatch)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("t")
        screen = pilot.app.screen
        await wait_for(pilot, lambda: screen.loaded is not None, "the model")
        screen.request = dataclasses.replace(screen.request, stream=STREAM)
        screen.load()  # what the settings dialog does (the journey test presses its keys)
        await wait_for(pilot, lambda: screen.loaded is not None and screen.loaded.stream is not None, "re-opening")
        screen.chat_input.cursor_blink = False  # a blinking cursor would make the picture depend on the clock
        screen.chat_input.value = PROMPT
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.last_done is not None and not screen.replying, "the reply")
        await settle(pilot)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(TqbenchApp(), terminal_size=(80, 24), run_before=run_before)


def test_snapshot_help_screen(tmp_path, monkeypatch, snap_compare):
    """The help screen (?) at 80x24 over the Source screen: its first page."""
    write_tiny(tmp_path / "tiny-k3")
    monkeypatch.chdir(tmp_path)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(TqbenchApp(Path("tiny-k3")), terminal_size=(80, 24), run_before=run_before)

"""The Chat screen, driven with Pilot on a real model: the shipped trained demo converted with tq4. Replies are checked
against the engine's own chat API (tqbench.chat.session.ChatSession) run directly with the same greedy sampling: the
text, the tokens reused from the cache, a reply stopped with esc and the turn after it, reset; plus the default model
(the demo converted on the spot), a model that fails to load, the Convert screen's output loaded next, and quitting
mid-reply. The live expert view: its cells against the PageIn events of the same reply run directly with the same
streaming settings, its summary against the engine's StreamReport; its plain state (tqbench.chat.live) and an SVG
snapshot of the map.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from conftest import demo_tq4
from tqbench.demo import ensure_demo
from tqbench.chat.request import ChatRequest, ProfileOptions, StreamRequest
from tqbench.chat.session import ChatSession
from tqbench.engine import engine
from tqbench.errors import TqbenchError
from tqbench.layout.names import INDEX_FILE
from tqbench.events import ReplyDone, TokenOut
from tqbench.chat.choose import demo_converted_path
from tqbench.state import last_model, remember_model
from tqbench.stream import ExpertStore
from tqbench.events import PageIn
from textual.app import App
from textual.widgets import Input
from tui.app import TqbenchApp
from tqbench.chat.live import FADE, KINDS, PageInMap, bins, fold, heat, sparkline
from tui.screens.chat import ChatScreen
from tui.screens.chat_settings import SettingsScreen
from tui.state import display_path
from tui.widgets.expert_map import ExpertMapView
from tui.widgets.transcript import CURSOR, reply_content
from tui_helpers import screen_lines, settle, wait_for

pytestmark = pytest.mark.slow

SIZE = (100, 30)
PROMPTS = ("def parse_args(argv):", "import os")
STOP_AFTER = 5  # a gated reply waits after this many tokens; esc then stops it after the next one
REAL_REPLY = ChatSession._reply  # what a ChatSession's reply job runs on the engine thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The trained demo converted with tq4 (a copy of the test session's conversion)."""
    return demo_tq4(tmp_path_factory.mktemp("model"), name="demo-tq4")


def gated(gate: threading.Event, reached: threading.Event):
    """ChatSession's reply, held on the engine thread after its STOP_AFTER-th token until `gate` is set, so
    a test stops a reply at an exact point (the engine then closes it after one more token)."""
    def reply(chat, text, sampling):
        gen = REAL_REPLY(chat, text, sampling)
        tokens = 0
        try:
            for ev in gen:
                yield ev
                if isinstance(ev, TokenOut):
                    tokens += 1
                    if tokens == STOP_AFTER:
                        reached.set()
                        assert gate.wait(20), "the test never opened the gate"
        finally:
            gen.close()
    return reply


@pytest.fixture(scope="module")
def engine_run(model_dir):
    """The engine's chat API run directly: (ModelLoaded, [ReplyDone of PROMPTS], ReplyDone of PROMPTS[0] stopped
    after STOP_AFTER + 1 tokens, ReplyDone of PROMPTS[1] after it)."""
    chat = ChatSession()
    try:
        def done(prompt: str) -> ReplyDone:
            with chat.reply(prompt) as job:
                return job.result()[-1]

        with chat.open(ChatRequest(model=str(model_dir))) as job:
            loaded = job.result()[-1]
        replies = [done(p) for p in PROMPTS]
        chat.reset()
        gate, reached = threading.Event(), threading.Event()
        with engine().submit(lambda: gated(gate, reached)(chat, PROMPTS[0], loaded.sampling)) as job:
            assert reached.wait(20)
            job.stop()
            gate.set()
            job.result()
        stopped = chat.last_reply()
        after = done(PROMPTS[1])
    finally:
        chat.close()
    assert stopped.finish_reason == "cancelled" and stopped.generated_tokens == STOP_AFTER + 1
    return loaded, replies, stopped, after


def counts(done: ReplyDone) -> tuple:
    """What a reply must repeat exactly (rates and peak memory vary from run to run)."""
    return done.text, done.prompt_tokens, done.cached_tokens, done.generated_tokens, done.finish_reason


async def open_chat(pilot) -> ChatScreen:
    await settle(pilot)
    await pilot.press("t")
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen)
    # the demo may be converted first (about 30 s on 2 cores)
    await wait_for(pilot, lambda: screen.loaded is not None or screen.error is not None, "the model", 120)
    await pilot.pause()
    return screen


async def send(pilot, screen: ChatScreen, text: str, wait: bool = True) -> None:
    screen.chat_input.value = text
    screen.chat_input.focus()
    await pilot.press("enter")
    if wait:
        await wait_for(pilot, lambda: not screen.replying, "the reply")
        await pilot.pause()


def status(screen: ChatScreen) -> str:
    return str(screen.query_one("#chat-status").render())


def screen_text(pilot) -> str:
    return "\n".join(screen_lines(pilot.app))


async def test_replies_match_the_engine_reuse_the_cache_and_reset(model_dir, engine_run):
    loaded, (first, second), _, _ = engine_run
    remember_model(model_dir)
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        assert screen.error is None
        band = screen.query_one("#chat-model").text
        assert display_path(model_dir) in band and "(last converted model)" in band
        assert f"kimi_k3 · {loaded.turboquant_modules} TurboQuant modules" in band
        assert "of weights · loaded in" in band

        await send(pilot, screen, PROMPTS[0])
        assert screen.transcript.turns[-1].text == first.text != ""
        assert screen.transcript.text.startswith(f"you: {PROMPTS[0]}\nkimi_k3: {first.text}")
        assert f"prompt  {first.prompt_tokens} processed" in status(screen) and "· 0 reused" in status(screen)
        assert f"reply   {first.generated_tokens} tokens" in status(screen)

        await send(pilot, screen, PROMPTS[1])
        assert screen.transcript.turns[-1].text == second.text
        assert second.cached_tokens == first.prompt_tokens + first.generated_tokens
        assert f"· {first.prompt_tokens + first.generated_tokens} reused from the cache" in status(screen)
        assert counts(screen.last_done) == counts(second)
        shown = screen_text(pilot)
        assert f"{second.cached_tokens} reused from the cache" in shown and "peak memory" in shown
        assert second.text.strip().splitlines()[-1].strip()[:40] in shown  # the end of the reply is in view

        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not screen.turns.resetting, "the reset")
        await pilot.pause()
        assert screen.transcript.turns == [] and "conversation reset" in status(screen)
        assert "A new conversation. Type a message below" in screen_text(pilot)
        await send(pilot, screen, PROMPTS[0])  # a new conversation: the same reply as the first, nothing reused
        assert screen.transcript.turns[-1].text == first.text
        assert screen.last_done.cached_tokens == 0 and "· 0 reused" in status(screen)

        assert screen.focused is screen.chat_input  # typing: the app's letter keys are hidden, they type
        footer = screen_lines(app)[-1]
        assert "Send" in footer and "Reset" in footer and "^q Quit" in footer and "Source" not in footer
        await pilot.press("q", "s")
        assert screen.chat_input.value == "qs" and app.screen is screen
        screen.chat_input.value = ""
        await pilot.press("escape")  # leaves the field: the app's keys work again
        await pilot.pause()
        footer = screen_lines(app)[-1]
        assert "q Quit" in footer and "s Source" in footer and "Type" in footer
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running, "the app to quit")


async def test_escape_stops_a_reply_and_the_conversation_goes_on(model_dir, engine_run, monkeypatch):
    _, (first, _), stopped, after = engine_run
    remember_model(model_dir)
    gate, reached = threading.Event(), threading.Event()
    monkeypatch.setattr(ChatSession, "_reply", gated(gate, reached))
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        await send(pilot, screen, PROMPTS[0], wait=False)
        await wait_for(pilot, lambda: reached.is_set(), "the reply's tokens")
        await send(pilot, screen, "another", wait=False)  # refused while a reply runs: nothing queued
        assert screen.chat_input.value == "another" and len(screen.transcript.turns) == 2
        await pilot.press("escape")
        assert screen.turns.stopping and "stopping" in status(screen)
        gate.set()
        await wait_for(pilot, lambda: not screen.replying, "the stopped reply")
        await pilot.pause()
        turn = screen.transcript.turns[-1]
        assert turn.ending == "cancelled" and turn.text == stopped.text
        assert first.text.startswith(turn.text) and turn.text
        assert screen.transcript.text.endswith("[stopped]")
        assert counts(screen.last_done) == counts(stopped)
        assert f"{STOP_AFTER + 1} tokens (stopped)" in status(screen)

        monkeypatch.setattr(ChatSession, "_reply", REAL_REPLY)  # the next reply runs to its end
        screen.chat_input.value = ""
        await send(pilot, screen, PROMPTS[1])
        assert screen.transcript.turns[-1].text == after.text  # as the engine continues after the stopped reply
        assert counts(screen.last_done) == counts(after)
        assert f"· {after.cached_tokens} reused from the cache" in status(screen)
        assert [t.text for t in screen.transcript.turns] == [PROMPTS[0], stopped.text, PROMPTS[1], after.text]


async def test_the_status_says_mlx_warms_up_before_the_first_token(model_dir, engine_run, monkeypatch):
    """The process's first reply on CUDA (the detection says so here; the model runs on the CPU): the status line
    says MLX is compiling its kernels until the first token, then the reply streams as the engine's."""
    from tqbench.chat import report
    from tqbench.runtime import kernels, warmup
    from tqbench.events import MlxWarmup

    _, (first, _), _, _ = engine_run
    remember_model(model_dir)
    gate, reached = threading.Event(), threading.Event()

    def held(chat, text, sampling):  # the reply waits at MlxWarmup until the test has looked
        gen = REAL_REPLY(chat, text, sampling)
        try:
            for ev in gen:
                yield ev
                if isinstance(ev, MlxWarmup):
                    reached.set()
                    assert gate.wait(20), "the test never opened the gate"
        finally:
            gen.close()

    monkeypatch.setattr(ChatSession, "_reply", held)
    monkeypatch.setattr(kernels, "default_backend", lambda: "cuda")
    monkeypatch.setattr(warmup, "_warmed", False)
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        await send(pilot, screen, PROMPTS[0], wait=False)
        await wait_for(pilot, lambda: reached.is_set() and "warming up" in status(screen), "the warm-up line")
        assert status(screen) == report.mlx_warmup_line(MlxWarmup(first_run=warmup._mlx_cached() == 0, cached=0))
        gate.set()
        await wait_for(pilot, lambda: not screen.replying, "the reply")
        await pilot.pause()
        assert screen.transcript.turns[-1].text == first.text and counts(screen.last_done) == counts(first)
        assert "warming up" not in status(screen)


async def test_quitting_mid_reply_stops_the_engine_first(model_dir, monkeypatch):
    remember_model(model_dir)
    gate, reached = threading.Event(), threading.Event()
    monkeypatch.setattr(ChatSession, "_reply", gated(gate, reached))
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        await send(pilot, screen, PROMPTS[0], wait=False)
        await wait_for(pilot, lambda: reached.is_set(), "the reply's tokens")
        await pilot.press("ctrl+q")  # from the message field (q types there)
        assert app.is_running and engine().busy  # the app's quit stops the engine's job first
        gate.set()
        await wait_for(pilot, lambda: not app.is_running, "the app to exit")


async def test_a_failing_reply_is_one_line_and_the_next_turn_works(model_dir, engine_run, monkeypatch):
    _, (first, _), _, _ = engine_run
    remember_model(model_dir)

    def failing(chat, text, sampling):
        gen = REAL_REPLY(chat, text, sampling)
        try:
            yield next(gen)  # ReplyStarted: the conversation is not touched yet
        finally:
            gen.close()
        raise TqbenchError("the model's files changed\nunder it")

    monkeypatch.setattr(ChatSession, "_reply", failing)
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        await send(pilot, screen, PROMPTS[0])
        assert screen.error == "the reply failed: the model's files changed under it"
        assert screen.query_one("#chat-error").display and screen.transcript.text.endswith("[failed]")
        monkeypatch.setattr(ChatSession, "_reply", REAL_REPLY)
        await send(pilot, screen, PROMPTS[0])
        assert screen.error is None and not screen.query_one("#chat-error").display
        assert screen.transcript.turns[-1].text == first.text and screen.last_done.cached_tokens == 0


async def test_default_model_is_the_demo_converted_first(monkeypatch):
    assert last_model() is None  # this test's cache is empty
    seen = []
    original = ChatScreen.on_chat_convert_progress

    def record(self, message):
        seen.append(message.unit)
        original(self, message)

    monkeypatch.setattr(ChatScreen, "on_chat_convert_progress", record)
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        assert screen.error is None
        dest = demo_converted_path()
        assert dest == ensure_demo().parent / f"{ensure_demo().name}-tq4-g64"  # as `tqbench chat` converts it
        assert (dest / INDEX_FILE).is_file() and last_model() == dest.resolve()
        assert Path(screen.loaded.path).resolve() == dest.resolve()
        assert "demo, converted now with tq4-g64" in screen.query_one("#chat-model").text
        assert seen and seen[-1].done_in == seen[-1].total_in  # the conversion's progress was shown to its end
        assert not screen.query_one("#chat-bar-row").display
        assert "greedy, up to 64 tokens per reply" in screen_text(pilot)


def test_the_demo_conversion_goes_where_the_convert_screen_offers_it(tmp_path):
    """One recipe, one directory: `tqbench chat`'s demo conversion and the Convert screen's default output for the
    same recipe are both `<source>-<canonical recipe name>`, however the recipe is spelled."""
    from tqbench.demo import demo_path
    from tqbench.destination import default_dest

    src = tmp_path / "src"
    assert default_dest(src, "tq4") == default_dest(src, "tq4-g64") == tmp_path / "src-tq4-g64"
    assert demo_converted_path() == default_dest(demo_path(), "tq4-g64")
    assert demo_converted_path().name == f"{demo_path().name}-tq4-g64"


async def test_a_model_that_fails_to_load_is_one_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    (bad / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    remember_model(bad)
    app = TqbenchApp()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        assert screen.loaded is None
        error = screen.query_one("#chat-error")
        assert error.display and "no_such_architecture" in screen.error and "\n" not in screen.error
        assert screen.error.startswith("could not load the model: ")
        lines = [line for line in screen_lines(app) if "no_such_architecture" in line]
        assert len(lines) == 1 and "Traceback" not in screen_text(pilot)
        await send(pilot, screen, "hello", wait=False)
        assert screen.transcript.turns == [] and screen.chat_input.value == "hello"  # refused with a notice


async def test_the_convert_screens_output_is_loaded_next(model_dir, tmp_path):
    from tqbench.demo import DemoSpec, write_source

    remember_model(model_dir)
    src = write_source(tmp_path / "src", DemoSpec(), seed=0)  # a small checkpoint: the conversion takes seconds
    app = TqbenchApp(src)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        assert Path(screen.loaded.path).resolve() == model_dir.resolve()
        await pilot.press("escape", "c")  # leave the message field, then the Convert screen
        await settle(pilot)
        convert_screen = app.screen
        await wait_for(pilot, lambda: convert_screen.check_action("start", ()) is True, "the destination check")
        await pilot.press("r")
        await wait_for(pilot, lambda: convert_screen.finished_event is not None, "the conversion")
        dest = Path(convert_screen.finished_event.dest)
        assert last_model() == dest.resolve()
        await pilot.press("t")
        assert app.screen is screen
        await wait_for(pilot, lambda: screen.loaded is not None, "the new model")
        assert Path(screen.loaded.path).resolve() == dest.resolve()
        assert display_path(dest) in screen.query_one("#chat-model").text


def test_thinking_is_dim_and_italic_and_endings_are_marked():
    parts = (("<think>the user wants", True), (" code</think>", True), ("\nimport os", False))
    content = reply_content(parts, "cancelled")
    assert content.plain == "<think>the user wants code</think>\nimport os [stopped]"
    styled = {content.plain[s.start:s.end]: str(s.style) for s in content.spans}
    assert styled["<think>the user wants"] == styled[" code</think>"] == "dim italic"
    assert "\nimport os" not in styled and styled["[stopped]"] == "bold $text-warning"
    assert reply_content(parts[:1], streaming=True).plain == "<think>the user wants" + CURSOR
    assert reply_content((), "stop").plain == "(empty reply)"
    assert reply_content((("x\n", False),), "length").plain == "x\n[max tokens]"


# ---- the live expert view ---------------------------------------------------------------------------------------------

BUDGET = "1MB"  # about a third of the demo's experts (6.5 kB each): a reply pages experts in and evicts some
# One read worker: with several, reads finish in any order and so enter the cache in any order, which can change an
# eviction (the policy breaks ties by insertion order) and so turn one later hit into a miss between two runs.
STREAM = StreamRequest(budget=BUDGET, workers=1)


def engine_page_ins(model_dir: Path, prompt: str) -> tuple[list[PageIn], dict]:
    """The reply run directly with the streaming settings the Chat screen is given (STREAM): its PageIn events, then
    the session's StreamReport (as its --stats-json document)."""
    chat = ChatSession()
    try:
        with chat.open(ChatRequest(model=str(model_dir), stream=STREAM, profile=ProfileOptions(learn=False))) as job:
            job.result()
        with chat.reply(prompt) as job:
            events = [ev for ev in job.result() if isinstance(ev, PageIn)]
        stats = chat.stats().to_dict()
    finally:
        chat.close()
    return events, stats


async def test_the_expert_view_shows_what_the_engine_paged_in(model_dir, monkeypatch, tmp_path):
    events, stats = engine_page_ins(model_dir, PROMPTS[0])
    assert stats["misses"] and stats["hits_cache"]
    remember_model(model_dir)
    batches = []
    original = ChatScreen.on_chat_experts

    def record(self, message):
        batches.append(len(message.events))
        original(self, message)

    monkeypatch.setattr(ChatScreen, "on_chat_experts", record)
    app = TqbenchApp()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_chat(pilot)
        assert screen.loaded.stream is None and not screen.query_one("#expert-panel").display  # the demo fits
        assert "experts resident: o streams them" in screen_text(pilot)

        await pilot.press("escape", "o")  # the streaming settings, between turns: a cache budget re-opens the model
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#opt-workers", Input).value = "1"
        field = app.screen.query_one("#opt-budget", Input)
        field.value = BUDGET
        field.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.loaded is not None and screen.loaded.stream is not None, "re-opening")
        await pilot.pause()
        assert screen.request.stream == STREAM and screen.query_one("#expert-panel").display
        assert "streaming experts: cache 1.00 MB, 1 worker, lrfu-next" in screen_text(pilot)
        assert app.focused is screen.chat_input  # the new conversation's first message types straight away

        await send(pilot, screen, PROMPTS[0])
        m = screen.experts.experts
        store = ExpertStore.open(model_dir)
        store.close()
        layout = {n: lay.experts for n, lay in store.layers.items()}  # the demo's 7 MoE layers
        assert {n: st.experts for n, st in m.layers.items()} == layout and len(layout) == 7
        assert sum(batches) == len(events) and len(batches) * 4 < len(events)  # coalesced, none lost
        last = {}
        for ev in events:
            last.update({(ev.layer, e): how for e, how in zip(ev.experts, ev.served)})
        assert {(n, e): m.cell(n, e)[0] for n, st in m.layers.items() for e in range(st.experts)
                if m.cell(n, e)[0] is not None} == last
        served = Counter(how for ev in events for how in ev.served)
        assert m.seen == {k: served[k] for k in KINDS}
        assert m.seen["miss"] == stats["misses"] and m.hits() == stats["hits"]
        assert m.hit_rate() == stats["hits"] / (stats["hits"] + stats["misses"])
        assert m.token == events[-1].token and m.cache_bytes == stats["cache_bytes"]
        assert screen.experts.report.to_dict()["hit_rate"] == stats["hit_rate"]
        shown = screen_text(pilot)
        assert f"hits {stats['hit_rate']:.1%}" in shown and "read per token" in shown and "of 1.00 MB" in shown, shown
        disk = screen.loaded.stream.disk_bytes_per_s  # this disk's measured bandwidth, next to the reply's rate
        assert disk > 0 and f" MB/s of {disk / 1e9:.2f} GB/s" in shown
        assert screen.experts.report.to_dict()["disk_bytes_per_s"] == disk
        _, cols, per, _ = screen.query_one(ExpertMapView).geometry()
        assert all(f"L{n} " in shown for n in layout) and f"{m.widest} experts, {per}/cell" in shown
        assert per == fold(m.widest, cols) and cols >= 8  # folded to fit 80 columns
        assert all(len(line) <= 80 for line in screen_lines(app))

        view = screen.query_one(ExpertMapView)
        await pilot.press("escape", "v")
        assert view.paused and "PAUSED" in screen_text(pilot)
        await pilot.press("v")
        assert not view.paused
        view.focus()
        await pilot.press("down", "enter")  # opens L2: every expert, wrapped
        assert view.opened == {2}
        lines = screen_lines(app)
        row = next(i for i, line in enumerate(lines) if "L2" in line and "▾" in line)
        assert lines[row + 1].split("▏")[1].strip().startswith("0 ")
        while view.per != 1:
            await pilot.press("plus")
        cols = view.geometry()[1]  # the opened layer's rows brought a scroll bar
        assert f"{m.widest} experts, 1/cell · shown 0-{cols - 1} ◀▶" in screen_text(pilot)
        await pilot.press("right")
        assert view.first > 0

        monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
        await pilot.press("e")
        out = tmp_path / "profile-exports" / f"{model_dir.name}.json"
        await wait_for(pilot, lambda: out.is_file() and "profile exported" in status(screen), "the export")
        doc = json.loads(out.read_text())
        assert doc["schema"] == "tqbench.profile/1" and doc["routings"] > 0


def test_experts_fold_into_bins_and_fade():
    per = fold(896, 80)
    groups = bins(896, per)
    assert per == 12 and len(groups) == 75 <= 80
    assert sorted(e for g in groups for e in g) == list(range(896))  # every expert in exactly one bin
    assert fold(64, 80) == 1 and fold(64, 63) == 2 and len(bins(448, fold(448, 30))) <= 30

    m = PageInMap({1: 896, 3: 896})
    m.apply([PageIn(token=1, layer=1, experts=(0, 5, 13), served=("pinned", "miss", "cache"), bytes_read=200,
                    stall_s=0.01, cache_bytes=500),
             PageIn(token=1, layer=3, experts=(7,), served=("prefetched",), bytes_read=0, stall_s=0.0,
                    cache_bytes=600)])
    assert m.cell(1, 5) == ("miss", 0) and m.cell(1, 1) == (None, -1) and m.cell(3, 7) == ("prefetched", 0)
    assert m.bin(1, groups[0]) == ("miss", 0)  # 0 and 5 routed at the same token: the worst served shows
    assert m.bin(1, groups[1]) == ("cache", 0) and m.bin(1, groups[2]) == (None, -1)
    m.apply([PageIn(token=2, layer=1, experts=(0,), served=("pinned",), bytes_read=0, stall_s=0.0, cache_bytes=600)])
    assert m.bin(1, groups[0]) == ("pinned", 0)  # the most recent routing shows
    assert m.cell(1, 5) == ("miss", 1)  # one token older
    m.apply([PageIn(token=FADE + 2, layer=1, experts=(1,), served=("cache",), bytes_read=0, stall_s=0.0,
                    cache_bytes=600)])
    assert m.cell(1, 5) == ("miss", FADE + 1) and heat(FADE + 1) == 0.0  # fully faded
    assert heat(0) == 1.0 and heat(FADE // 2) == 0.5 and heat(-1) == 0.0
    assert m.seen == {"pinned": 2, "cache": 2, "prefetched": 1, "host": 0, "miss": 1} and m.hit_rate() == 5 / 6
    m.apply([PageIn(token=FADE + 2, layer=3, experts=(20, 21), served=("host", "cache"), bytes_read=0, stall_s=0.0,
                    cache_bytes=600)])  # a copy from the host tier: a hit
    assert m.bin(3, groups[1]) == ("host", 0) and m.cell(3, 21) == ("cache", 0)  # worse served than a cache hit
    assert m.seen["host"] == 1 and m.hit_rate() == 7 / 8
    assert m.bytes_read == 200 and m.cache_bytes == 600 and list(m.layers[1].misses) == [1, 0, 0]
    assert sparkline([0, 1, 4], 4, 4) == " ▁▃█"


def map_events(tokens: int, layers: int = 7, experts: int = 448, k: int = 8) -> list[PageIn]:
    """A fixed routing pattern: each token k experts per layer, served in turn by every kind."""
    kinds = ("miss", "cache", "pinned", "prefetched", "cache", "cache")
    return [PageIn(token=t, layer=n, experts=tuple(sorted({(t * 37 + n * 101 + i * 53) % experts for i in range(k)})),
                   served=tuple(kinds[(t + n + i) % len(kinds)] for i in range(k)), bytes_read=1000, stall_s=0.001 * n,
                   cache_bytes=2_000_000)
            for t in range(1, tokens + 1) for n in range(1, layers + 1)]


class MapApp(App[None]):
    """The map alone, with the fixed pattern of 40 tokens on 7 layers of 448 experts."""

    def compose(self):
        yield ExpertMapView()

    def on_mount(self) -> None:
        model = PageInMap({n: 448 for n in range(1, 8)})
        model.apply(map_events(40))
        view = self.query_one(ExpertMapView)
        view.set_model(model)
        view.focus()


def test_snapshot_expert_map(snap_compare):
    """80 columns: 448 experts folded into bins; L3 opened below its row (every expert, wrapped)."""
    async def run_before(pilot) -> None:
        await pilot.pause()
        await pilot.press("down", "down", "enter")
        await pilot.pause()

    assert snap_compare(MapApp(), terminal_size=(80, 20), run_before=run_before)

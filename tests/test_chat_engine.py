"""The chat as the engine owns it (tqbench.chat): the one budget syntax, the request's checks, the streaming plan,
a ChatSession run end to end on a small real conversion, and the report lines both faces show. Figures are checked
against the model's own files or the events of the same reply, never against the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import converted
from tqbench.chat import report
from tqbench.chat.live import PageInMap
from tqbench.chat.request import ChatRequest, ProfileOptions, SamplingRequest, StreamRequest, parse_budget
from tqbench.errors import ExitCode, TqbenchError
from tqbench.runtime.conversation import Sampling
from tqbench.events import ReplyDone


def test_one_budget_syntax():
    assert [parse_budget(w) for w in ("fit", "AUTO", " off ")] == ["fit", "auto", "off"]
    assert parse_budget("8") == 8 * 10**9  # a bare number is GB (--cache-budget-gb 8)
    assert parse_budget("0.5") == 500 * 10**6
    assert parse_budget("3MB") == 3 * 10**6  # what the TUI's field used to want
    assert parse_budget("1GiB") == 2**30 and parse_budget("4096B") == 4096
    for bad in ("lots", "", "-1", "3 apples"):
        with pytest.raises(TqbenchError) as e:
            parse_budget(bad)
        assert str(e.value) == (f"cache budget {bad!r}: give fit, auto, off or a size (8GB, 512MB; a bare number "
                                "is GB)")


@pytest.mark.parametrize("request_, line", [
    (ChatRequest(sampling=SamplingRequest(max_tokens=0)), "max tokens 0: give 1 or more"),
    (ChatRequest(sampling=SamplingRequest(temp=-1.0)), "temperature -1: give 0 (greedy) or more"),
    (ChatRequest(sampling=SamplingRequest(top_p=1.5)), "top-p 1.5: give 0 (off) to 1"),
    (ChatRequest(sampling=SamplingRequest(top_k=-2)), "top-k -2: give 0 (off) or more"),
    (ChatRequest(stream=StreamRequest(workers=0)), "prefetch workers 0: give 1 to 256"),
    (ChatRequest(stream=StreamRequest(policy="arc")), "cache policy 'arc': choose lrfu-next, lrfu, lru"),
    (ChatRequest(stream=StreamRequest(page_cache="maybe")), "page cache 'maybe': choose auto, on or off"),
    (ChatRequest(stream=StreamRequest(reads_in_flight=300)), "reads in flight 300: give 0 (one per worker) to 256"),
    (ChatRequest(max_active_experts=-1), "max active experts -1: give 0 (the model's own) or more"),
    (ChatRequest(profile=ProfileOptions(pin_share=0.95)), "pin share 0.95: give 0 to 0.9"),
])
def test_a_request_the_engine_refuses_is_one_line(request_, line):
    with pytest.raises(TqbenchError) as e:
        request_.check()
    assert str(e.value) == line and e.value.exit_code == ExitCode.BAD_INPUT


def test_contradicting_profile_options_are_a_usage_error():
    with pytest.raises(TqbenchError) as e:
        ChatRequest(profile=ProfileOptions(file="hot.json", cold=True)).check()
    assert e.value.exit_code == ExitCode.USAGE and "leave out --profile" in str(e.value)
    assert ChatRequest().check() == ChatRequest()  # the defaults pass


def test_report_lines_are_the_faces_words():
    done = ReplyDone(text="x", prompt_tokens=12, cached_tokens=5, generated_tokens=7, prefill_tps=100.0,
                     decode_tps=20.25, peak_memory_bytes=3_000_000, finish_reason="length")
    assert report.reply_line(done) == ("[7 tokens (max tokens), 20.2 tok/s; prompt 12 tokens at 100.0 tok/s, 5 reused "
                                       "from the cache; peak memory 3.00 MB (2.86 MiB)]")
    assert report.plain(report.reply_lines(done)) == ("reply   7 tokens (max tokens) at 20.2 tok/s · peak memory 3.00 MB\n"
                                                      "prompt  12 processed at 100.0 tok/s · 5 reused from the cache")
    sampling = Sampling(max_tokens=64, temp=0.7, top_p=0.9, top_k=40)
    assert report.sampling_line(sampling) == "temp 0.7, top-p 0.9, top-k 40, up to 64 tokens per reply"
    assert report.sampling_text(Sampling(temp=0.0, top_p=0.9)) == "greedy"
    empty = report.plain(report.expert_summary(PageInMap({1: 4}), 2_000_000, None, None))
    assert empty == "no expert routed yet; cache 2.00 MB\n" + report.TIERS_LEGEND


# ---- on a real conversion ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> Path:
    """A small demo (4 layers, 3 of them MoE with 16 experts) converted with tq4 for streaming (shared, read-only)."""
    from tqbench.demo import DemoSpec

    return converted("tq4", DemoSpec())


def test_the_engine_plans_what_runs(model, tmp_path):
    from tqbench.chat.stream_plan import plan_streaming
    from tqbench.demo import DemoSpec, write_source

    assert plan_streaming(model, StreamRequest(budget="off")).reason == "off"
    fits = plan_streaming(model, StreamRequest())  # fit: a few MB fit any machine
    assert fits.config is None and fits.reason == "fits" and fits.note is None
    asked = plan_streaming(model, StreamRequest(budget="5MB", workers=2, policy="lru", fanout=True, lookahead=True,
                                                page_cache="on", reads_in_flight=1))
    c = asked.config
    assert asked.reason == "asked" and (c.budget_bytes, c.workers, c.policy, c.fanout, c.lookahead, c.page_cache,
                                        c.reads_in_flight) == (5_000_000, 2, "lru", True, True, "on", 1)
    # a source checkpoint streams its per-expert tensors as stored
    src = write_source(tmp_path / "plain", DemoSpec(), seed=0)
    assert plan_streaming(src, StreamRequest()).reason == "fits"
    assert plan_streaming(src, StreamRequest(budget="1MB")).config.budget_bytes == 1_000_000
    # a model without routed experts: resident when it fits, refused if streaming is asked
    dense = write_source(tmp_path / "dense", DemoSpec(first_k_dense_replace=DemoSpec().num_hidden_layers))
    assert plan_streaming(dense, StreamRequest()).reason == "no routed experts"
    with pytest.raises(TqbenchError, match="no routed experts to stream") as e:
        plan_streaming(dense, StreamRequest(budget="auto"))
    assert e.value.path == str(dense)


@pytest.mark.slow  # a model load and a streamed reply (~3 s)
def test_a_chat_session_end_to_end(model, tmp_path):
    from tqbench.chat.events import ModelLoaded
    from tqbench.chat.session import ChatSession
    from tqbench.chat.events import StreamPlan
    from tqbench.events import ModelChosen
    from tqbench.events import PageIn

    chat = ChatSession()
    try:
        request = ChatRequest(model=str(model), sampling=SamplingRequest(max_tokens=6), chat_template=False,
                              stream=StreamRequest(budget="200kB", workers=1),
                              profile=ProfileOptions(store=str(tmp_path / "store")))
        with chat.open(request) as job:
            events = job.result()
        assert [type(e) for e in events] == [ModelChosen, StreamPlan, ModelLoaded]
        loaded = events[-1]
        assert chat.loaded == loaded and loaded.sampling.max_tokens == 6
        assert loaded.stream.budget_bytes == 200_000 and loaded.stream.why == "asked"
        doc = json.loads((model / "expert_map.json").read_text())  # the layers the files hold
        assert dict(loaded.stream.layers) == {int(n): len(v["experts"]) for n, v in doc["layers"].items()}
        assert loaded.profile.learning and loaded.profile.source in ("none", "shipped")

        with chat.reply("def f(x):") as job:
            reply = job.result()
        done = reply[-1]
        served = [how for ev in reply if isinstance(ev, PageIn) for how in ev.served]
        assert isinstance(done, ReplyDone) and done.generated_tokens == 6
        stats = chat.stats()
        assert stats.stats.misses == served.count("miss") and stats.stats.hits == len(served) - served.count("miss")
        d = stats.to_dict()
        assert d["hit_rate"] == round(stats.hit_rate, 4) and d["profile"] == loaded.profile.to_dict()
        assert chat.status().turns == 1 and chat.status().tokens == done.prompt_tokens + 6
        assert "conversation: 1 turn, " in report.stats_lines(loaded, chat.status(), stats)[0]
        # What the reply taught is in the store once the reply is done, while the session stays open.
        from tqbench.profile import ProfileStore
        from tqbench.profile.overview import profile_view

        store = ProfileStore(tmp_path / "store")
        try:
            overview, _ = profile_view(model, None, store=store)
        finally:
            store.close()
        assert overview.summary.routings == stats.learned_routings > 0 and overview.summary.sessions == 1

        out = tmp_path / "exports" / "hot.json"
        exported = chat.export_profile(out)
        assert json.loads(out.read_text())["routings"] == exported.routings > 0
        chat.reset()
        assert chat.status() == report.ConversationStatus(turns=0, tokens=0, last=chat.last_reply())
    finally:
        chat.close()
    assert chat.loaded is None and chat.stats() is None

"""`tqbench eval`: the arithmetic against numpy, the exactness promises (a model against itself, the mxfp4
passthrough against its source), streaming, routing, the layer-by-layer mode, the texts, and the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cli_helpers import tqbench
from conftest import converted, demo_source
from tqbench.demo import DemoSpec
from tqbench.eval import EvalReport, EvalRequest, evaluate
from tqbench.eval.metrics import window_sums
from tqbench.texts import Text, cut, default_texts, plan_windows, token_stream

TOKENS = 128  # small runs: the random model's figures do not depend on the count
WINDOW = 32


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """A random K3-layout source, its mxfp4 passthrough (everything else as stored) and its tq4 conversion."""
    return {"src": demo_source(DemoSpec()), "mxfp4e": converted("srca-mxfp4e", DemoSpec()),
            "tq4": converted("tq4", DemoSpec())}  # shared with other modules (read-only)


def report_of(request: EvalRequest) -> EvalReport:
    events = list(evaluate(request))
    assert isinstance(events[-1], EvalReport)
    return events[-1]


def request(model, against=None, **kw) -> EvalRequest:
    kw.setdefault("tokens", TOKENS)
    kw.setdefault("window", WINDOW)
    kw.setdefault("prompts", 2)
    kw.setdefault("generate", 8)
    return EvalRequest(model=str(model), against=str(against) if against is not None else None, **kw)


# ---- the arithmetic ------------------------------------------------------------------------------------------------


def numpy_sums(logits: np.ndarray, ref: np.ndarray, y: np.ndarray) -> dict:
    """The same sums written independently in float64 numpy."""
    def logsoftmax(a):
        a = a.astype(np.float64)
        m = a.max(-1, keepdims=True)
        return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))

    lm, ls = logsoftmax(logits), logsoftmax(ref)
    pick = lambda lp: -np.take_along_axis(lp, y[..., None], -1).sum()  # noqa: E731
    top5 = lambda lp: np.argsort(-lp, -1)[..., :5]  # noqa: E731
    a, b = top5(lm), top5(ls)
    overlap = sum(len(set(u) & set(v)) for u, v in zip(a.reshape(-1, 5), b.reshape(-1, 5))) / 5
    return dict(nll=pick(lm), ref_nll=pick(ls), kl=(np.exp(ls) * (ls - lm)).sum(),
                top1=int((lm.argmax(-1) == ls.argmax(-1)).sum()), top5=overlap)


def test_window_sums_match_numpy():
    rng = np.random.default_rng(30)
    shape = (3, 17, 50)
    logits = rng.normal(0, 2, shape).astype(np.float32)
    ref = (logits + rng.normal(0, 0.7, shape)).astype(np.float32)  # close: the top-1 and top-5 sets partly agree
    y = rng.integers(0, shape[-1], shape[:2]).astype(np.int32)
    got = window_sums(mx.array(logits), mx.array(y), mx.array(ref))
    want = numpy_sums(logits, ref, y)
    assert got.tokens == 51
    assert got.nll == pytest.approx(want["nll"], rel=1e-5)
    assert got.ref_nll == pytest.approx(want["ref_nll"], rel=1e-5)
    assert got.kl == pytest.approx(want["kl"], rel=1e-4)
    assert got.top1 == want["top1"] and 0 < got.top1 < 51
    assert got.top5 == pytest.approx(want["top5"]) and 0 < got.top5 < 51
    lm, ls = (np.log(np.exp(a.astype(np.float64)) / np.exp(a.astype(np.float64)).sum(-1, keepdims=True))
              for a in (logits, ref))
    per_window = (np.exp(ls) * (ls - lm)).sum(-1).sum(-1)
    np.testing.assert_allclose(got.kl_windows, per_window, rtol=1e-4)


def test_identical_logits_are_exact():
    logits = mx.array(np.random.default_rng(1).normal(0, 3, (2, 9, 40)).astype(np.float32)).astype(mx.bfloat16)
    y = mx.array(np.zeros((2, 9), np.int32))
    s = window_sums(logits, y, logits)
    assert (s.kl, s.top1, s.top5) == (0.0, 18, 18.0)
    assert s.nll == s.ref_nll


def test_report_figures_are_the_sums_over_tokens(models):
    r = report_of(request(models["tq4"], models["src"]))
    t = r.total
    assert t.tokens == sum(s.tokens for s in r.texts) and t.nll_sum == pytest.approx(sum(s.nll_sum for s in r.texts))
    assert t.perplexity == pytest.approx(math.exp(t.nll_sum / t.tokens))
    assert t.kl == pytest.approx(t.kl_sum / t.tokens) and t.kl > 0
    assert t.top1_agreement == t.top1_agree / t.tokens < 1
    assert len(t.kl_windows) == t.windows and sum(t.kl_windows) == pytest.approx(t.kl_sum)


def test_perplexity_against_an_independent_forward_pass(models):
    """The model's perplexity recomputed from its logits with numpy, on the windows the evaluation scores."""
    from tqbench.runtime.load import load

    r = report_of(request(models["tq4"], prompts=0))
    loaded = load(models["tq4"])
    streams = {t.name: token_stream(t, loaded.tokenizer) for t in default_texts()}
    nll, count = 0.0, 0
    for w in plan_windows(streams, WINDOW, TOKENS):
        logits = np.array(loaded.model(mx.array(w.x)).astype(mx.float32), dtype=np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nll -= np.take_along_axis(lp, w.y[..., None], -1).sum()
        count += w.y.size
    assert r.total.tokens == count
    assert r.total.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert r.total.kl is None and r.greedy is None


# ---- exactness -----------------------------------------------------------------------------------------------------


def test_a_model_against_itself_is_exact(models):
    r = report_of(request(models["tq4"], models["tq4"]))
    for s in (*r.texts, r.total):
        assert (s.kl_sum, s.top1_agreement, s.top5_overlap) == (0.0, 1.0, 1.0)
        assert s.nll_sum == s.ref_nll_sum
    assert r.greedy.share == 1.0 and r.greedy.alike == (8, 8)


def test_mxfp4_passthrough_against_its_source_is_exact(models):
    r = report_of(request(models["mxfp4e"], models["src"]))
    assert (r.total.kl_sum, r.total.top1_agreement, r.greedy.share) == (0.0, 1.0, 1.0)
    assert r.total.perplexity == r.total.ref_perplexity


def test_a_quantized_model_loses_something(models):
    r = report_of(request(models["tq4"], models["src"]))
    assert r.total.kl > 1e-4 and r.total.perplexity != r.total.ref_perplexity
    assert r.recipe == "tq4-g64"


def test_streamed_experts_score_as_resident(models):
    from tqbench.chat.request import StreamRequest

    resident = report_of(request(models["tq4"], models["src"], prompts=0))
    streamed = report_of(request(models["tq4"], models["src"], prompts=0, stream=StreamRequest(budget="0.001")))
    assert streamed.total == resident.total
    assert resident.model_read_bytes is None and resident.against_read_bytes is None
    assert streamed.model_read_bytes > 0 and streamed.against_read_bytes > 0


def test_fewer_active_experts_against_native_routing(models):
    r = report_of(request(models["src"], models["src"], max_active_experts=2))
    assert (r.max_active_experts, r.native_experts) == (2, 4)
    assert r.total.kl > 0 and r.total.top1_agreement < 1


# ---- layer by layer ------------------------------------------------------------------------------------------------


def test_layers_against_itself_are_zero(models):
    r = report_of(request(models["tq4"], models["tq4"], layers=True))
    assert [x.rel_error for x in r.layers] == [0.0] * DemoSpec().num_hidden_layers
    assert r.texts == () and r.total is None


def test_layers_are_teacher_forced(models, tmp_path):
    """A copy of the source with one layer's attention output scaled: only that layer differs, since every later
    layer runs on the reference's own input."""
    import shutil

    changed = tmp_path / "one-layer"
    shutil.copytree(models["src"], changed)
    index = json.loads((changed / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.endswith("model.layers.2.self_attn.o_proj.weight"))
    shard = changed / index[name]
    tensors, meta = mx.load(str(shard), return_metadata=True)
    tensors[name] = (tensors[name].astype(mx.float32) * 1.5).astype(tensors[name].dtype)
    mx.save_safetensors(str(shard), tensors, metadata=meta)
    r = report_of(request(changed, models["src"], layers=True))
    errors = [x.rel_error for x in r.layers]
    assert errors[2] > 0.01
    assert errors[:2] == [0.0, 0.0] and errors[3:] == [0.0] * (len(errors) - 3)
    assert r.layers[2].attention == "KimiK3DeltaAttention"


# ---- texts ---------------------------------------------------------------------------------------------------------


def test_default_texts_are_code_and_chat(models):
    from tqbench.runtime.load import load

    texts = default_texts()
    assert [t.name for t in texts] == ["code", "chat"]
    tok = load(models["src"], lazy=True).tokenizer
    chat = token_stream(texts[1], tok)
    opens = tok.encode("<|open|>", add_special_tokens=False)
    assert len(opens) == 1 and int((chat == opens[0]).sum()) >= len(texts[1].documents)


def test_windows_are_spread_and_never_overlap():
    stream = np.arange(1000, dtype=np.int32)
    w = cut("t", stream, 100, 3)
    assert w.x[:, 0].tolist() == [0, 400, 800] and (w.y == w.x + 1).all()
    assert cut("t", stream, 100, 50).x.shape == (9, 100)  # (1000 - 1) // 100 windows at most
    short = cut("t", np.arange(10, dtype=np.int32), 100, 3)
    assert short.x.tolist() == [list(range(9))]


def test_documents_are_joined_by_the_end_token(models):
    from tqbench.runtime.load import load

    tok = load(models["src"], lazy=True).tokenizer
    ids = token_stream(Text(name="t", documents=("a b", "c d")), tok)
    eos = min(tok.eos_token_ids)
    assert ids.tolist() == tok.encode("a b", add_special_tokens=False) + [eos] + tok.encode("c d",
                                                                                              add_special_tokens=False)


# ---- the command line ----------------------------------------------------------------------------------------------


def test_cli_json_is_the_engine_report(models, capsys, monkeypatch, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    args = (models["tq4"], "--against", models["src"], "--text", text, "--window", WINDOW, "--tokens", 64,
            "--prompts", 1, "--generate", 4)
    res = tqbench(capsys, monkeypatch, "eval", *args, "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    r = report_of(request(models["tq4"], models["src"], texts=(str(text),), tokens=64, prompts=1, generate=4))
    assert doc["schema"] == "tqbench.eval/1" and doc["recipe"] == "tq4-g64"
    assert [t["text"] for t in doc["texts"]] == ["t.txt"]
    assert doc["total"]["perplexity"] == r.total.perplexity and doc["total"]["kl"] == r.total.kl
    assert doc["greedy"]["alike"] == list(r.greedy.alike) and doc["text_sha256"] == r.text_digest
    assert f"evaluating {models['tq4']} against {models['src']}: 64 tokens in 2 windows of {WINDOW} (t.txt)" in res.err
    plain = tqbench(capsys, monkeypatch, "eval", *args)
    row = next(line for line in plain.out.splitlines() if line.startswith("t.txt"))
    assert row.split() == ["t.txt", "64", f"{r.total.perplexity:.3f}", f"{r.total.ref_perplexity:.3f}",
                           f"{r.total.kl:.4f}", f"{r.total.top1_agreement:.4f}", f"{r.total.top5_overlap:.4f}"]


@pytest.mark.parametrize("case", ["missing", "binary", "empty", "directory"])
def test_cli_bad_text_is_one_line(models, capsys, monkeypatch, tmp_path, case):
    path = tmp_path / "t.txt"
    if case == "binary":
        path.write_bytes(b"ok\xff\xfe")
    elif case == "empty":
        path.write_text("  \n")
    elif case == "directory":
        path.mkdir()
    res = tqbench(capsys, monkeypatch, "eval", models["tq4"], "--text", path)
    why = {"missing": "no such file", "binary": "not UTF-8 text (byte 2)", "empty": "empty: nothing to score",
           "directory": "a directory, not a text file"}[case]
    assert (res.code, res.err) == (1, f"tqbench: error: {path}: {why}\n")


def test_cli_layers_need_a_reference(models, capsys, monkeypatch):
    res = tqbench(capsys, monkeypatch, "eval", models["tq4"], "--layers")
    assert (res.code, res.err) == (2, "tqbench: error: --layers compares two models layer by layer: give --against "
                                      "SRC\n")


def test_cli_bad_model_is_one_line(models, capsys, monkeypatch, tmp_path):
    res = tqbench(capsys, monkeypatch, "eval", tmp_path / "nothing")
    assert res.code == 1
    assert res.err == f"tqbench: error: {tmp_path / 'nothing'}: no such model directory\n"
    res = tqbench(capsys, monkeypatch, "eval", models["tq4"], "--against", tmp_path)
    assert (res.code, res.err) == (1, f"tqbench: error: {tmp_path}: no config.json: not a model directory\n")


def test_an_evaluation_is_remembered_for_its_source_and_an_unwritable_store_only_warns(models, tmp_path, capsys):
    from tqbench.convert.pipeline import source_fingerprint
    from tqbench.eval.store import remembered
    from tqbench.source.opening import open_checkpoint

    store = tmp_path / "evals"
    r = report_of(request(models["tq4"], models["src"], prompts=0, store=str(store)))
    q = remembered(open_checkpoint(models["src"]), store)["tq4-g64"]
    assert (q.perplexity, q.kl, q.tokens) == (r.total.perplexity, r.total.kl, r.total.tokens)
    assert q.source_fingerprint == source_fingerprint(open_checkpoint(models["src"]))
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    again = report_of(request(models["tq4"], models["src"], prompts=0, store=str(blocked)))
    assert again.total == r.total and blocked.read_text() == "not a directory"
    assert "tqbench: warning:" in capsys.readouterr().err

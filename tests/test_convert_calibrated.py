"""A calibrated conversion (recipe part `cal`, `--calibrate`) of a real small K3-layout source: the same planned bytes
and tensors as without it, other codes that lower each layer's output error on the calibration inputs, statistics
kept in the output so a killed conversion resumes to the same bytes, and the calibration text in the fingerprint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cli_helpers import tqbench
from conftest import demo_source
from model_helpers import file_bytes, output_tensors
from model_helpers import read_tensor as read
from tqbench.convert import convert
from mlx.utils import tree_unflatten

from tqbench.convert.calibration import STATS, Statistics, calibrated_modules
from tqbench.convert.calibration_request import WINDOW, CalibrationRequest
from tqbench.demo import DemoSpec
from tqbench.events import CalibrationProgress, Calibrated, ConvertFinished, ConvertStarted, UnitConverted
from tqbench.quant import turboquant as tq
from tqbench.recipe import Recipe, group_sources, make_plan
from tqbench.source import open_checkpoint
from tqbench.runtime.load import load
from tqbench.source.reader import ShardReader
from tqbench.texts import default_texts, plan_windows, token_stream

SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)  # experts wide enough for group 64
SHARD = 150_000
TOKENS = 512
K3 = "tq3a-tqTe-down4-g64"


@pytest.fixture(scope="module")
def demo_src() -> Path:
    return demo_source(SPEC)


def run(src: Path, dst: Path, name: str, **kw) -> list:
    """Converted in this process, the calibration statistics kept for the tests to read (a finished conversion
    deletes them otherwise)."""
    kw.setdefault("calibration", CalibrationRequest(tokens=TOKENS))
    kw.setdefault("keep_statistics", True)
    return list(convert(src, dst, Recipe.parse(name), SHARD, **kw))


@pytest.fixture(scope="module")
def calibrated_run(demo_src, tmp_path_factory) -> tuple[Path, list]:
    """The K3 recipe calibrated: its output and events."""
    dst = tmp_path_factory.mktemp("cal") / "cal"
    return dst, run(demo_src, dst, K3 + "-cal")


@pytest.fixture(scope="module")
def pair(demo_src, calibrated_run, tmp_path_factory) -> tuple[Path, Path]:
    """The K3 recipe converted plainly and calibrated."""
    plain = tmp_path_factory.mktemp("plain") / "plain"
    run(demo_src, plain, K3)
    return plain, calibrated_run[0]


def test_calibration_runs_as_the_units_need_it_weighed_by_each_inputs_modules(demo_src, calibrated_run):
    """The pass runs among the units: one CalibrationProgress per module input, in the pass's order, none ahead of
    the layer being written (so about one layer's codes are held), Calibrated after the last. The fraction weighs each
    input by its calibrated modules' weights (recomputed from the plan and the order kept with the statistics)."""
    dst, events = calibrated_run
    assert isinstance(events[0], ConvertStarted)
    steps = [e for e in events if isinstance(e, CalibrationProgress)]
    done = next(i for i, e in enumerate(events) if isinstance(e, Calibrated))
    assert events.index(steps[-1]) < done and isinstance(events[-1], ConvertFinished)
    first_unit = next(i for i, e in enumerate(events) if isinstance(e, UnitConverted))
    assert first_unit < events.index(steps[-1])  # units were written before the pass ended
    seen: list[int] = []
    for e in events:
        if isinstance(e, CalibrationProgress) and ".layers." in e.at:
            seen.append(int(e.at.split(".layers.")[1].split(".")[0]))
        elif isinstance(e, UnitConverted) and e.layer is not None:
            assert max(seen, default=0) <= e.layer, (e.name, max(seen))
    cal = events[done]
    stats = Statistics.load(dst / STATS)
    order = stats.meta["order"]
    assert [e.done for e in steps] == list(range(1, len(order) + 1)) and [e.at for e in steps] == order
    assert all(e.total == cal.inputs == len(order) and e.step == "inputs" and e.tokens == cal.tokens for e in steps)
    plan = make_plan(group_sources(open_checkpoint(demo_src)), Recipe.parse(K3 + "-cal"))
    weight = {t: 0 for t in order}
    for m in calibrated_modules(plan):
        if m.name in stats.taps:
            weight[stats.taps[m.name]] += int(np.prod(m.source.shape)) * max(m.source.experts, 1)
    total, running = sum(weight.values()), 0
    for e in steps:
        running += weight[e.at]
        assert e.fraction == pytest.approx(running / total, rel=1e-12)
    assert steps[-1].fraction == 1.0
    assert [e.elapsed for e in steps] == sorted(e.elapsed for e in steps) and cal.file == str(dst / STATS)


@pytest.fixture(scope="module")
def one_pass(demo_src, tmp_path_factory) -> Path:
    """The K3 recipe calibrated on the source model's inputs alone (--calibrate-one-pass)."""
    dst = tmp_path_factory.mktemp("cal1") / "cal"
    run(demo_src, dst, K3 + "-cal", calibration=CalibrationRequest(tokens=TOKENS, sequential=False))
    return dst


def test_same_plan_same_tensors_same_bytes(demo_src, pair):
    plain, cal = pair
    ckpt = open_checkpoint(demo_src)
    a, b = (make_plan(group_sources(ckpt), Recipe.parse(n)) for n in (K3, K3 + "-cal"))
    assert (a.total_bytes, a.resident_bytes, a.streamed_bytes) == (b.total_bytes, b.resident_bytes, b.streamed_bytes)
    assert [(t.name, t.dtype, t.shape) for m in a.modules for t in m.outputs] == \
        [(t.name, t.dtype, t.shape) for m in b.modules for t in m.outputs]
    # every tensor's dtype, shape, bytes and shard (the headers name the recipe)
    assert output_tensors(plain) == output_tensors(cal)


def test_recorded_per_module_and_in_the_recipe(pair):
    plain, cal = pair
    q = json.loads((cal / "config.json").read_text())["quantization"]
    assert q["recipe"]["name"] == K3 + "-cal" and q["recipe"]["calibrate"] is True
    tq_modules = {k: v for k, v in q["modules"].items() if v["format"] == "turboquant"}
    assert tq_modules and all(v.get("calibrated") is True for v in tq_modules.values())
    assert not any("calibrated" in v for v in json.loads((plain / "config.json").read_text())
                   ["quantization"]["modules"].values())


def test_codes_change_codebooks_and_signs_do_not(pair):
    plain, cal = pair
    names = [n for n in output_tensors(plain) if n.endswith((".codebook", ".signs"))]
    assert names and all(np.array_equal(read(plain, n), read(cal, n)) for n in names)
    weights = [n for n in output_tensors(plain) if n.endswith(".weight") and read(plain, n).dtype == np.uint32]
    changed = sum(not np.array_equal(read(plain, n), read(cal, n)) for n in weights)
    assert changed > 0.9 * len(weights)


def _output_error(dst: Path, module: str, h: np.ndarray, source: Path, expert: int | None = None) -> float:
    """tr((W - W_hat) H (W - W_hat)^T) / tr(W H W^T): the layer's relative output error on the calibration inputs."""
    ckpt = open_checkpoint(source)
    entry = next(t.entry for t in ckpt.tensors if t.entry.name == f"{module}.weight")
    with ShardReader(source) as r:
        w = np.array(r.read_mlx(entry).astype(mx.float32))
    n = w.shape[-1]
    hat = np.array(tq.dequantize(mx.array(read(dst, f"{module}.weight")), mx.array(read(dst, f"{module}.scales")),
                                 mx.array(read(dst, f"{module}.codebook")), mx.array(read(dst, f"{module}.signs")), n))
    d = w - hat
    return float(np.trace(d @ h @ d.T) / np.trace(w @ h @ w.T))


def test_output_error_on_the_calibration_inputs_is_lower(demo_src, pair, one_pass):
    """One pass: for every calibrated dense module, its stored codes give a lower output error on the inputs it was
    calibrated for than nearest rounding's, by at least 20% (measured: 0.5-0.8x)."""
    plain, cal = pair[0], one_pass
    stats = Statistics.load(cal / STATS)
    assert not any(k.endswith("|a") for k in stats.arrays)
    dense = [m for m in stats.taps if ".experts" not in m and "switch_mlp" not in m]
    assert len(dense) > 10
    ratios = []
    for m in dense:
        h = stats.hessian(m, None)
        ratios.append(_output_error(cal, m, h, demo_src) / _output_error(plain, m, h, demo_src))
    assert max(ratios) < 0.95 and float(np.median(ratios)) < 0.8


def test_sequential_statistics_correct_for_the_calibrated_modules_before(pair, one_pass):
    """In order, each dense input gets A = I + (X - X~)^T X~ (H~ + damp)^-1: exactly I at the first tap, whose inputs
    no calibrated module has changed yet, and not I in any later layer; the codes differ from one pass's."""
    stats = Statistics.load(pair[1] / STATS)
    order = stats.meta["order"]
    dense = {t for m, t in stats.taps.items() if "switch_mlp" not in m}
    assert dense and all(f"{t}|a" in stats.arrays for t in dense) and set(order) == set(stats.taps.values())
    first = stats.arrays[f"{order[0]}|a"]
    np.testing.assert_allclose(first, np.eye(len(first)), atol=1e-5)
    later = [t for t in dense if ".layers.0." not in t]
    assert later and all(np.abs(stats.arrays[f"{t}|a"] - np.eye(len(stats.arrays[f"{t}|a"]))).max() > 1e-3
                         for t in later)
    weights = [n for n in output_tensors(one_pass) if n.endswith(".weight") and read(one_pass, n).dtype == np.uint32
               and ".experts." not in n and ".layers.0." not in n]  # routed experts: the source's inputs in both
    assert weights and all(not np.array_equal(read(pair[1], n), read(one_pass, n)) for n in weights)


class _Seen(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.seen = inner, []

    def __call__(self, x, *args, **kwargs):
        self.seen.append(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        return self.inner(x, *args, **kwargs)


def _inputs_h(model: nn.Module, taps: list[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """X^T X of the inputs `taps` get when `model` runs the calibration windows (one forward pass)."""
    seen = {tap: _Seen(dict(model.named_modules())[tap]) for tap in taps}
    model.update_modules(tree_unflatten(list(seen.items())))
    mx.eval(model(mx.array(rows)))
    xs = {tap: np.array(mx.concatenate(s.seen), dtype=np.float64) for tap, s in seen.items()}
    return {tap: x.T @ x for tap, x in xs.items()}


def test_each_module_is_calibrated_on_what_the_converted_model_feeds_it(demo_src, pair):
    """H~ of each dense input is what the converted model itself gives that input on the calibration windows, run
    independently: in layer 0 to within bf16 arithmetic (kimi_k3's MLP calls up_proj before gate_proj, so the two
    wait at their shared tap together: measured 0.3-0.6%, against 10% when up_proj ran uncalibrated), and at the
    last input (the routings of the two runs part where scores nearly tie) far closer than the source model's."""
    stats = Statistics.load(pair[1] / STATS)
    dense = [t for t in stats.meta["order"] if f"{t}|h" in stats.arrays]  # routed taps keep no H
    source = load(demo_src)  # loaded as chat loads it, as is the converted model
    windows = plan_windows({t.name: token_stream(t, source.tokenizer) for t in default_texts()}, WINDOW, TOKENS)
    rows = np.concatenate([w.x for w in windows])
    assert rows.size == stats.meta["tokens"]

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    first = [t for t in dense if ".layers.0." in t]
    assert len(first) >= 3
    taps = first + dense[-1:]
    converted = _inputs_h(load(pair[1], tokenizer=False).model, taps, rows)
    original = _inputs_h(source.model, taps, rows)
    for tap in taps:
        measured = stats.arrays[f"{tap}|h"]
        if tap in first:
            assert rel(measured, converted[tap]) < 0.01, tap
        else:
            assert rel(measured, converted[tap]) < 0.4 * rel(original[tap], converted[tap]), (
                rel(measured, converted[tap]), rel(original[tap], converted[tap]))


def test_the_pass_codes_are_written_and_are_what_each_h_gives(demo_src, pair):
    """The in-order pass keeps every calibrated module's codes (it chose them to put the module into the copy) and
    the conversion writes those: each dense module's stored weight is its kept codes, and they are
    quantize_calibrated's for the module's source weight (as the converter decodes it) corrected by its A, with its
    H, recomputed here. (Routed experts keep no H: their codes are checked against an independent H below.)"""
    from tqbench.convert.produce import Producer
    from tqbench.quant.calibrate import quantize_calibrated

    cal = pair[1]
    stats = Statistics.load(cal / STATS)
    recipe = Recipe.parse(K3 + "-cal")
    ckpt = open_checkpoint(demo_src)
    plan = make_plan(group_sources(ckpt), recipe)
    assert {k.rpartition("|")[0] for k in stats.arrays if k.endswith("|codes")} == \
        {m.name for m in calibrated_modules(plan)} and any(m.experts for m in calibrated_modules(plan))
    dense = [m for m in calibrated_modules(plan) if not m.experts and stats.hessian(m.name, None) is not None]
    assert len(dense) > 10
    with ShardReader(ckpt.path) as reader:
        producer = Producer(ckpt, recipe, reader)
        for m in dense:
            kept = np.array(stats.quantized(m.name, None).weight)
            assert np.array_equal(read(cal, f"{m.name}.weight"), kept), m.name
            w = producer.decode(producer.source_parts(m, None), m.source.format)
            signs = producer.signs(m, w.shape[-1])
            kind = "T" if m.choice.ternary else str(m.choice.bits)
            q = quantize_calibrated(stats.weights(m.name, w), kind, m.choice.group_size,
                                    mx.array(signs) if signs.min() < 0 else None, stats.hessian(m.name, None),
                                    rule=recipe.scales)
            assert np.array_equal(np.array(q.weight), kept), m.name


def test_routed_experts_codes_fit_the_inputs_routed_to_each(demo_src, pair):
    """In order, a routed tap keeps no H per expert, only its routing counts: each expert's H is made from the rows
    routed to it while its modules are calibrated (memory: the tap's rows, not experts x width^2). Recomputed
    independently (the source model's routed inputs on the calibration windows, in float64), the counts are the
    routings and the stored codes are quantize_calibrated's for that H, for every expert of the layer."""
    from mlx_lm.models.switch_layers import SwitchLinear

    from tqbench.convert.calibration import EXPERT_PRIOR
    from tqbench.convert.produce import rotated
    from tqbench.quant.calibrate import expert_hessian, quantize_calibrated

    stats = Statistics.load(pair[1] / STATS)
    recipe = Recipe.parse(K3 + "-cal")
    routed = sorted({t for m, t in stats.taps.items() if "switch_mlp" in m})
    assert routed and all(f"{t}|h" not in stats.arrays and f"{t}|n" in stats.arrays for t in routed)
    tap = next(t for t in routed if t.endswith("gate_proj"))
    module = next(m for m, t in stats.taps.items() if t == tap and m.endswith("gate_proj"))
    source = load(demo_src)
    windows = plan_windows({t.name: token_stream(t, source.tokenizer) for t in default_texts()}, WINDOW, TOKENS)
    switch = dict(source.model.named_modules())[tap]
    assert isinstance(switch, SwitchLinear) or "scales" in switch
    seen = []

    class Routed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, idx, *args, **kwargs):
            seen.append((np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]), np.array(idx)))
            return self.inner(x, idx, *args, **kwargs)

    source.model.update_modules(tree_unflatten([(tap, Routed(switch))]))
    mx.eval(source.model(mx.array(np.concatenate([w.x for w in windows]))))
    x = np.concatenate([a for a, _ in seen]).astype(np.float64)
    ids = np.concatenate([b.reshape(len(a), -1) for a, b in seen])
    experts, k = switch.weight.shape[0], ids.shape[1]
    assert np.array_equal(np.bincount(ids.ravel(), minlength=experts), stats.arrays[f"{tap}|n"])
    w = (mx.dequantize(switch.weight, switch.scales, switch.get("biases"), group_size=switch.group_size,
                       bits=switch.bits, mode=switch.mode) if "scales" in switch else switch.weight)
    n = w.shape[-1]
    signs = mx.array(tq.rotation_signs(module, n, recipe.seed)) if rotated(recipe, n) else None
    pooled, agree = k * (x.T @ x), []
    for e in range(experts):
        mine = x[(ids == e).any(axis=1)]
        h = expert_hessian(mine.T @ mine, len(mine), pooled, len(x) * k, EXPERT_PRIOR * n)
        q = quantize_calibrated(w[e].astype(mx.float32), "T", 64, signs, h, rule=recipe.scales)
        agree.append(float(np.mean(np.array(q.weight) == np.array(stats.quantized(module, e).weight))))
    nearest = tq.quantize(w[0].astype(mx.float32), "T", 64, signs, rule=recipe.scales)
    assert agree == [1.0] * experts, agree  # every code, float32 sums in the pass against float64 here
    assert np.mean(np.array(nearest.weight) == np.array(stats.quantized(module, 0).weight)) < 0.9


def _cli(src: Path, dst: Path, env: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tqbench", "convert", "--hf-path", str(src), "--mlx-path", str(dst), "--recipe",
           K3, "--calibrate", "--calibrate-tokens", str(TOKENS), "--shard-size", str(SHARD), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["unit:1", "unit:130"])
def test_kill_and_resume_is_byte_identical(demo_src, pair, tmp_path, kill):
    dst = tmp_path / "out"
    killed = _cli(demo_src, dst, {"TQBENCH_TEST_KILL": kill})
    assert killed.returncode == -9 and not (dst / STATS).exists()  # nothing stored: the pass runs again
    resumed = _cli(demo_src, dst)
    assert resumed.returncode == 0, resumed.stderr
    assert "calibration: " in resumed.stderr
    theirs = file_bytes(pair[1])
    assert theirs.pop(STATS) and file_bytes(dst) == theirs  # complete: the statistics went, nothing else differs
    again = _cli(demo_src, dst)  # a finished conversion rerun: every shard is done, nothing is calibrated
    assert again.returncode == 0 and "calibration: " not in again.stderr and file_bytes(dst) == theirs


def test_other_calibration_text_is_another_conversion(demo_src, pair, tmp_path, capsys, monkeypatch):
    text = tmp_path / "mine.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    dst = tmp_path / "out"

    shutil.copytree(pair[1], dst)
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", dst, "--recipe", K3 + "-cal",
                "--calibrate-text", text, "--calibrate-tokens", TOKENS, "--shard-size", SHARD)
    assert r.code != 0 and "--force" in r.err
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", dst, "--recipe", K3 + "-cal",
                "--calibrate-text", text, "--calibrate-tokens", TOKENS, "--shard-size", SHARD, "--force")
    assert r.code == 0, r.err
    assert file_bytes(dst) != file_bytes(pair[1])
    assert output_tensors(dst) == output_tensors(pair[1])
    # piped stderr: a line at every tenth of the calibration, the last at 100% with every input counted
    lines = [ln for ln in r.err.splitlines() if ln.startswith("calibrate ")]
    inputs = int(r.err.split("calibration: ", 1)[1].split(" through ")[1].split()[0])  # the Calibrated line's
    assert not (dst / STATS).exists()
    assert len(lines) >= 5 and lines[-1].startswith(f"calibrate 100%: {inputs} of {inputs} inputs, ")
    assert [int(ln.split()[1].rstrip("%:")) for ln in lines] == sorted(int(ln.split()[1].rstrip("%:")) for ln in lines)


@pytest.mark.parametrize("bad,why", [("missing.txt", "no such file"), ("dir", "a directory"),
                                      ("latin1.txt", "not UTF-8")])
def test_a_bad_calibration_text_is_one_line_naming_it(demo_src, tmp_path, capsys, monkeypatch, bad, why):
    (tmp_path / "dir").mkdir()
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    dst = tmp_path / "out"
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", dst, "--calibrate",
                "--calibrate-text", tmp_path / bad)
    lines = [ln for ln in r.err.splitlines() if ln.startswith("tqbench: error")]
    assert r.code != 0 and len(lines) == 1 and why in lines[0] and bad in lines[0]
    assert "Traceback" not in r.err and not dst.exists()


def test_calibrate_text_without_cal_is_refused(demo_src, tmp_path, capsys, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", tmp_path / "out", "--recipe", K3,
                "--calibrate-text", text)
    assert r.code != 0 and "not calibrated" in r.err and not (tmp_path / "out").exists()


def test_plan_with_calibrate_shows_the_same_bytes(demo_src, capsys, monkeypatch):
    a = tqbench(capsys, monkeypatch, "plan", demo_src, "--recipe", K3, "--json")
    b = tqbench(capsys, monkeypatch, "plan", demo_src, "--recipe", K3, "--calibrate", "--json")
    assert a.code == b.code == 0, (a.err, b.err)
    (pa,), (pb,) = json.loads(a.out)["plans"], json.loads(b.out)["plans"]
    assert pb["recipe"]["name"] == K3 + "-cal" and pb["recipe"]["calibrate"] is True
    assert {k: v for k, v in pa.items() if k != "recipe"} == {k: v for k, v in pb.items() if k != "recipe"}

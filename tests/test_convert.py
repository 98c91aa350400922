"""The streaming conversion on the demo model: planned bytes == written bytes, values, layout, resume, determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cli_helpers import tqbench
from conftest import demo_source
from model_helpers import file_bytes, output_tensors
from model_helpers import read_tensor as read
from tqbench.convert import convert
from tqbench.layout.names import EXPERT_MAP, REPORT
from tqbench.demo import DemoSpec
from tqbench.events import ConvertFinished, ConvertStarted, ShardWritten, UnitConverted
from tqbench.quant import turboquant as tq
from tqbench.recipe import Recipe, group_sources, make_plan
from tqbench.recipe.recipe import Format
from tqbench.layout.names import shard_file
from tqbench.layout.shard_units import assign_shards, file_units
from tqbench.source import open_checkpoint
from tqbench.source.reader import ShardReader, decode_mxfp4
from tqbench.shards.header import read_header

SHARD = 150_000  # several shards for the ~0.7 MB demo
RECIPES = ["tq3a-tqTe-down4-g64", "tq4-g32", "tq3a-tq2e-g64", "affine4-g64", "tq3a-mxfp4e-g64", "tq2-norot-g32"]
# The demo architecture with experts wide enough for group 64 (the default demo's latent 32 stays at source).
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def demo_src() -> Path:
    return demo_source(SPEC)  # shared with other modules (read-only)


def run(src: Path, dst: Path, name: str, **kw) -> list:
    return list(convert(src, dst, Recipe.parse(name), kw.pop("shard_size", SHARD), **kw))


@pytest.mark.parametrize("name", RECIPES)
def test_plan_equals_written_bytes_tensor_by_tensor(demo_src, tmp_path, name):
    events = run(demo_src, tmp_path / "out", name)
    plan = make_plan(group_sources(open_checkpoint(demo_src)), Recipe.parse(name), SHARD)
    shards = assign_shards(file_units(plan.modules), SHARD)
    planned = {p.out.name: (p.out.dtype, p.out.shape, p.out.nbytes, shard_file(i, len(shards)))
               for i, s in enumerate(shards) for u in s for p in u.pieces}
    written = output_tensors(tmp_path / "out")
    assert written == planned
    assert sum(v[2] for v in written.values()) == plan.total_bytes
    assert isinstance(events[0], ConvertStarted) and isinstance(events[-1], ConvertFinished)
    assert events[0].tensor_bytes == plan.total_bytes  # bytes_out adds the headers (test_bytes_out_is_what_the_files_hold)
    assert sum(isinstance(e, ShardWritten) for e in events) == plan.shards == len(shards) > 1
    units = [e for e in events if isinstance(e, UnitConverted)]
    assert units[-1].done_in == units[-1].total_in == events[0].bytes_in
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: v[3] for k, v in planned.items()}
    assert index["metadata"]["total_size"] == plan.total_bytes


def _source_float(ckpt, name_prefix: str) -> np.ndarray:
    t = {x.entry.name: x.entry for x in ckpt.tensors}
    with ShardReader(ckpt.path) as r:
        if f"{name_prefix}.weight_packed" in t:
            return np.array(decode_mxfp4(r.read_mlx(t[f"{name_prefix}.weight_packed"]),
                                         r.read_mlx(t[f"{name_prefix}.weight_scale"])))
        return np.array(r.read_mlx(t[f"{name_prefix}.weight"]).astype(mx.float32))


def test_turboquant_values_decode_to_the_source(demo_src, tmp_path):
    dst = tmp_path / "out"
    run(demo_src, dst, "tq3a-tqTe-down4-g64")
    ckpt = open_checkpoint(demo_src)
    report = {r["module"]: r for r in json.loads((dst / REPORT).read_text())["modules"]}
    cases = [  # (source module, output weight/scales prefix, codebook/signs prefix, levels)
        ("language_model.model.layers.1.self_attn.q_proj", None, None, 8),
        ("language_model.model.layers.2.block_sparse_moe.experts.5.w1",
         "language_model.model.layers.2.block_sparse_moe.experts.5.w1",
         "language_model.model.layers.2.block_sparse_moe.switch_mlp.gate_proj", 3),
        ("language_model.model.layers.2.block_sparse_moe.experts.5.w2",
         "language_model.model.layers.2.block_sparse_moe.experts.5.w2",
         "language_model.model.layers.2.block_sparse_moe.switch_mlp.down_proj", 16),
    ]
    for src, out, shared, levels in cases:
        out = out or src
        shared = shared or src
        w = _source_float(ckpt, src)
        book = read(dst, f"{shared}.codebook")
        signs = read(dst, f"{shared}.signs")
        assert len(book) == levels and set(np.unique(signs)) == {-1, 1}
        np.testing.assert_array_equal(signs, tq.rotation_signs(shared, w.shape[1]))
        w_hat = np.array(tq.dequantize(mx.array(read(dst, f"{out}.weight")), mx.array(read(dst, f"{out}.scales")),
                                       mx.array(book), mx.array(signs), w.shape[1]))
        rel = np.linalg.norm(w_hat - w) / np.linalg.norm(w)
        expected = {3: 0.436, 8: 0.186, 16: 0.098}[levels]  # sqrt of each codebook's Gaussian MSE
        assert abs(rel - expected) < 0.04, (src, rel)
        row = report[shared]
        if row["experts"]:
            assert row["rel_error_mean"] == pytest.approx(rel, abs=0.05) and row["rel_error_max"] >= rel - 1e-5
        else:
            assert row["rel_error_mean"] == pytest.approx(rel, rel=1e-3)


def test_affine_values_match_mlx(demo_src, tmp_path):
    dst = tmp_path / "out"
    run(demo_src, dst, "affine4-g64")
    w = _source_float(open_checkpoint(demo_src), "language_model.model.layers.3.self_attn.o_proj")
    p = "language_model.model.layers.3.self_attn.o_proj"
    got = mx.dequantize(mx.array(read(dst, f"{p}.weight")), mx.array(read(dst, f"{p}.scales")).view(mx.float16),
                        mx.array(read(dst, f"{p}.biases")).view(mx.float16), group_size=64, bits=4)
    wq, s, b = mx.quantize(mx.array(w).astype(mx.float16), group_size=64, bits=4)
    np.testing.assert_array_equal(np.array(got), np.array(mx.dequantize(wq, s, b, group_size=64, bits=4)))


def test_mxfp4_passthrough_and_kept_tensors_copy_source_bytes(demo_src, tmp_path):
    dst = tmp_path / "out"
    run(demo_src, dst, "tq3a-mxfp4e-g64")
    src = {t.entry.name: t for t in open_checkpoint(demo_src).tensors}
    with ShardReader(demo_src) as r:
        def raw(n):
            return r.read_bytes(src[n].entry)
        e = "language_model.model.layers.1.block_sparse_moe.experts.7.w3"
        assert read(dst, f"{e}.weight").tobytes() == raw(f"{e}.weight_packed")
        assert read(dst, f"{e}.scales").tobytes() == raw(f"{e}.weight_scale")
        for kept in ("language_model.model.embed_tokens.weight", "language_model.model.layers.2.self_attn.A_log",
                     "language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias"):
            assert read(dst, kept).tobytes() == raw(kept)


def test_expert_map_points_at_each_experts_bytes(demo_src, tmp_path):
    dst = tmp_path / "out"
    run(demo_src, dst, "tq3a-tqTe-down4-g64")
    emap = json.loads((dst / EXPERT_MAP).read_text())
    spec = SPEC
    assert sorted(map(int, emap["layers"])) == list(range(spec.first_k_dense_replace, spec.num_hidden_layers))
    headers = {f: {t.name: t for t in read_header(dst / f).tensors} for f in emap["files"]}
    for layer, info in emap["layers"].items():
        assert len(info["experts"]) == spec.num_experts
        assert list(info["tensors"]) == ["w1.weight", "w1.scales", "w3.weight", "w3.scales", "w2.weight", "w2.scales"]
        for e, (fi, offset) in enumerate(info["experts"]):
            file = emap["files"][fi]
            blob = (dst / file).read_bytes()[offset:offset + info["length"]]
            for key, sub in info["tensors"].items():
                t = headers[file][f"{info['prefix']}.{e}.{key}"]
                assert t.offset == offset + sub["offset"] and t.nbytes == sub["bytes"]
                assert blob[sub["offset"]:sub["offset"] + sub["bytes"]] == (dst / file).read_bytes()[t.offset:t.offset + t.nbytes]


def test_config_records_the_recipe_and_tokenizer_travels(demo_src, tmp_path):
    dst = tmp_path / "out"
    run(demo_src, dst, "tq3a-tqTe-down4-g64")
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg["quantization"]
    assert "quantization_config" not in cfg and q["recipe"]["name"] == "tq3a-tqTe-down4-g64"
    assert q["modules"]["language_model.model.layers.1.block_sparse_moe.switch_mlp.gate_proj"] == {
        "format": "turboquant", "bits": None, "ternary": True, "group_size": 64,
        "rotation": {"kind": "hadamard", "block": 64}, "scales": "search"}
    assert q["modules"]["language_model.model.layers.1.block_sparse_moe.switch_mlp.down_proj"]["bits"] == 4
    for f in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (demo_src / f).read_bytes()


def test_deterministic(demo_src, tmp_path):
    run(demo_src, tmp_path / "a", "tq3a-tqTe-down4-g64")
    run(demo_src, tmp_path / "b", "tq3a-tqTe-down4-g64")
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")


def _cli(src: Path, dst: Path, env: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tqbench", "convert", "--hf-path", str(src), "--mlx-path", str(dst),
           "--bits", "3", "-g", "64", "--ternary-experts", "--expert-down-bits", "4", "--streaming",
           "--shard-size", str(SHARD), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["unit:1", "unit:40", "unit:130", "unit:264", "final:1", "final:2", "final:3"])
def test_kill_and_resume_is_byte_identical(demo_src, tmp_path, kill):
    reference = tmp_path / "ref"
    run(demo_src, reference, "tq3a-tqTe-down4-g64")
    dst = tmp_path / "out"
    killed = _cli(demo_src, dst, {"TQBENCH_TEST_KILL": kill})
    assert killed.returncode == -9  # SIGKILL: nothing was cleaned up
    assert not (dst / "model.safetensors.index.json").exists()  # not marked complete
    resumed = _cli(demo_src, dst)
    assert resumed.returncode == 0, resumed.stderr
    if kill.startswith("final"):
        assert "resuming: 5 of 5 shards done" in " ".join(resumed.stderr.split())
    assert not list(dst.glob("*.partial"))
    assert file_bytes(dst) == file_bytes(reference)


@pytest.mark.slow
def test_write_failure_is_clear_and_resumable(demo_src, tmp_path):
    """A file-size limit makes writes fail like a full disk: one clear line, then the same command resumes."""
    dst = tmp_path / "out"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
            "sys.argv = sys.argv[1:]; from tqbench.cli.main import run; run()")
    args = ["tqbench", "convert", "--hf-path", str(demo_src), "--mlx-path", str(dst), "--recipe",
            "tq3a-tqTe-down4-g64", "--shard-size", str(SHARD)]
    full = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert full.returncode == 1
    lines = full.stderr.strip().splitlines()
    assert lines[-1].startswith("tqbench: error: ") and "rerun the same command to resume" in lines[-1]
    assert not list(dst.glob("*.partial"))
    ok = _cli(demo_src, dst)
    assert ok.returncode == 0, ok.stderr
    ref = tmp_path / "ref"
    run(demo_src, ref, "tq3a-tqTe-down4-g64")
    assert file_bytes(dst) == file_bytes(ref)


def test_bad_sources_are_refused_before_anything_is_written(demo_src, tmp_path, capsys, monkeypatch):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(demo_src, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-5])
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", broken, "--mlx-path", tmp_path / "out", "--bits", "3")
    assert r.code == 1 and "truncated" in r.err and shard.name in r.err
    assert not (tmp_path / "out").exists()
    shard.unlink()
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", broken, "--mlx-path", tmp_path / "out", "--bits", "3")
    assert r.code == 1 and "incomplete checkpoint" in r.err and not (tmp_path / "out").exists()
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", tmp_path / "out",
                "--recipe", "tq3a-tqTe-affine4e")
    assert r.code == 1 and r.err.startswith("tqbench: error: ") and not (tmp_path / "out").exists()


def test_other_recipe_is_refused_unless_forced(demo_src, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "out"
    run(demo_src, dst, "tq3a-tqTe-down4-g64")
    before = file_bytes(dst)
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", dst, "--recipe", "tq4-g64",
                "--shard-size", SHARD)
    assert r.code == 1 and "another recipe or source (tq3a-tqTe-down4-g64)" in r.err and "--force" in r.err
    assert file_bytes(dst) == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", tmp_path / "notes", "--bits", "3")
    assert r.code == 1 and "not empty" in r.err and (tmp_path / "notes" / "a.txt").read_text() == "mine"
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", tmp_path / "notes", "--bits", "3",
                "--force")
    assert r.code == 1 and "never deletes files it did not write" in r.err
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["a.txt"]
    (dst / "my-notes.md").write_text("kept")  # a user's file inside a conversion survives --force
    (dst / "config.json.0123abcd.partial").write_text("{")  # a killed write's temporary file does not
    old_shards = sorted(p.name for p in dst.glob("*.safetensors"))
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", dst, "--recipe", "tq4-g64",
                "--shard-size", SHARD, "--force")
    assert r.code == 0, r.err
    assert json.loads((dst / "config.json").read_text())["quantization"]["recipe"]["name"] == "tq4-g64"
    assert (dst / "my-notes.md").read_text() == "kept"
    ref = tmp_path / "ref"
    run(demo_src, ref, "tq4-g64")
    assert {k: v for k, v in file_bytes(dst).items() if k != "my-notes.md"} == file_bytes(ref)
    assert old_shards  # the old recipe's shards were replaced, not left behind (file_bytes compared every file)


def test_cli_json_lines(demo_src, tmp_path, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "convert", "--hf-path", demo_src, "--mlx-path", tmp_path / "o", "--recipe",
                "tq3a-tqTe-down4-g64", "--shard-size", SHARD, "--json")
    assert r.code == 0, r.err
    events = [json.loads(line) for line in r.out.splitlines()]
    assert events[0]["event"] == "ConvertStarted" and events[-1]["event"] == "ConvertFinished"
    assert [e["index"] for e in events if e["event"] == "ShardWritten"] == list(range(1, events[0]["shards"] + 1))


def test_destination_status(demo_src, tmp_path):
    from tqbench.convert import destination_status, layout

    lay = layout(demo_src, Recipe.parse("tq3a-tqTe-down4-g64"), SHARD)
    dst = tmp_path / "out"
    assert destination_status(lay, dst).state == "new"
    events = convert(lay.ckpt, dst, Recipe.parse("tq3a-tqTe-down4-g64"), SHARD)
    for ev in events:
        if isinstance(ev, ShardWritten) and ev.index == 2:
            break
    events.close()  # what a cancel does: the shard in progress is dropped
    assert not list(dst.glob("*.partial"))
    st = destination_status(lay, dst)
    assert (st.state, st.done_shards, st.total_shards) == ("resumable", 2, len(lay.files))
    run(demo_src, dst, "tq3a-tqTe-down4-g64")
    assert destination_status(lay, dst).state == "complete"
    other = layout(demo_src, Recipe.parse("tq4-g64"), SHARD)
    st = destination_status(other, dst)
    assert st.state == "conflict" and "tq3a-tqTe-down4-g64" in st.detail


def test_bytes_in_is_the_source_once(demo_src, tmp_path):
    """Progress counts every source tensor byte exactly once (rate and ETA depend on it)."""
    events = run(demo_src, tmp_path / "out", "tq3a-tqTe-down4-g64")
    index = json.loads((demo_src / "model.safetensors.index.json").read_text())
    assert events[0].bytes_in == index["metadata"]["total_size"]
    assert sum(e.bytes_in for e in events if isinstance(e, UnitConverted)) == events[0].bytes_in


@pytest.mark.slow
def test_ctrl_c_exits_130_and_leaves_a_resumable_output(demo_src, tmp_path):
    import signal

    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "tqbench", "convert", "--hf-path", str(demo_src), "--mlx-path", str(dst),
           "--recipe", "tq3a-tqTe-down4-g64", "--shard-size", str(SHARD), "--json"]
    # the child takes SIGINT as a terminal's Ctrl-C would, even when this test runs in a background job (which
    # starts with SIGINT ignored, and ignored signals are inherited)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if json.loads(line)["event"] == "ShardWritten":
            proc.send_signal(signal.SIGINT)
            break
    proc.stdout.read()
    assert proc.wait(timeout=60) == 130
    assert proc.stderr.read().strip().endswith("tqbench: interrupted")
    assert not list(dst.glob("*.partial")) and not (dst / "model.safetensors.index.json").exists()
    assert _cli(demo_src, dst).returncode == 0
    ref = tmp_path / "ref"
    run(demo_src, ref, "tq3a-tqTe-down4-g64")
    assert file_bytes(dst) == file_bytes(ref)


@pytest.mark.parametrize("name", ["tq3a-tqTe-down4-g64", "affine4-g64", "tq3a-tq2e-g32-mlpg128", "tq3a-mxfp4e-g64"])
def test_inspect_reads_a_converted_output(demo_src, tmp_path, name):
    """Inspecting the output finds the same parameters as the source, and names the formats."""
    from tqbench.source import summarize

    run(demo_src, tmp_path / "out", name)
    src, out = summarize(open_checkpoint(demo_src)), summarize(open_checkpoint(tmp_path / "out"))
    assert out.params == src.params and out.active_params == src.active_params
    assert out.experts.experts_per_layer == SPEC.num_experts and out.experts.moe_layers == src.experts.moe_layers
    routed = {g.key: g.formats for g in out.by_role}["routed_expert"]
    # mlpg128 keeps the 64-wide gate/up experts as they are (in % 128 != 0): mxfp4 in MLX's layout.
    expected = {"tq3a-tqTe-down4-g64": {"turboquant"}, "affine4-g64": {"affine"},
                "tq3a-tq2e-g32-mlpg128": {"mlx-mxfp4", "turboquant"}, "tq3a-mxfp4e-g64": {"mxfp4"}}[name]
    assert set(routed) == expected


def test_stacked_bf16_experts_convert_one_expert_at_a_time(tmp_path):
    """An MLX-style source (stacked `switch_mlp` bf16 experts): each output expert is its own slice, quantized."""
    from tqbench.shards.writer import save_shard, to_bf16, from_bf16

    E, hidden, inter = 4, 64, 128
    rng = np.random.default_rng(5)
    experts = {p: to_bf16(rng.standard_normal(shape).astype(np.float32) / 8)
               for p, shape in (("gate_proj", (E, inter, hidden)), ("up_proj", (E, inter, hidden)),
                                ("down_proj", (E, hidden, inter)))}
    src = tmp_path / "src"
    src.mkdir()
    save_shard(src / "model.safetensors", {
        **{f"model.layers.0.mlp.switch_mlp.{p}.weight": ("BF16", w) for p, w in experts.items()},
        "model.layers.0.mlp.gate.weight": ("BF16", to_bf16(rng.standard_normal((E, hidden)).astype(np.float32))),
    })
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2,
                                                 "num_hidden_layers": 1, "hidden_size": hidden}))
    dst = tmp_path / "out"
    run(src, dst, "tq4-g32", shard_size=10**9)
    emap = json.loads((dst / EXPERT_MAP).read_text())["layers"]["0"]
    assert list(emap["tensors"]) == ["gate_proj.weight", "gate_proj.scales", "up_proj.weight", "up_proj.scales",
                                     "down_proj.weight", "down_proj.scales"]
    for e in range(E):
        for p, w in experts.items():
            prefix = f"model.layers.0.mlp.experts.{e}.{p}"
            shared = f"model.layers.0.mlp.switch_mlp.{p}"
            w_hat = tq.dequantize(mx.array(read(dst, f"{prefix}.weight")), mx.array(read(dst, f"{prefix}.scales")),
                                  mx.array(read(dst, f"{shared}.codebook")), mx.array(read(dst, f"{shared}.signs")),
                                  w.shape[-1])
            source = from_bf16(w[e])
            rel = np.linalg.norm(np.array(w_hat) - source) / np.linalg.norm(source)
            assert 0.07 < rel < 0.12, (e, p, rel)  # 4-bit: sqrt(0.0095) ~ 0.097


def test_resume_reports_the_earlier_runs_layer_errors(demo_src, tmp_path):
    """ConvertStarted of a resumed run carries, per layer, the unit errors of the shards finished before: the same
    aggregates an uninterrupted run's UnitConverted events give for those shards."""
    name, dst = "tq3a-tqTe-down4-g64", tmp_path / "out"
    full = run(demo_src, tmp_path / "ref", name)
    gen = convert(demo_src, dst, Recipe.parse(name), SHARD)
    shards_seen = 0
    for ev in gen:
        shards_seen += isinstance(ev, ShardWritten)
        if shards_seen == 2:
            gen.close()
            break
    started = run(demo_src, dst, name)[0]
    assert isinstance(started, ConvertStarted) and started.resumed_shards == 2
    expected: dict = {}
    shard = 0
    for ev in full:
        if isinstance(ev, ShardWritten):
            shard += 1
        elif isinstance(ev, UnitConverted) and shard < 2 and ev.rel_error is not None:
            n, total, worst = expected.get(ev.layer, (0, 0.0, 0.0))
            expected[ev.layer] = (n + 1, total + ev.rel_error, max(worst, ev.rel_error))
    got = {e.layer: (e.count, e.total, e.worst) for e in started.resumed_errors}
    assert got.keys() == expected.keys() and expected
    for layer, (n, total, worst) in expected.items():
        assert got[layer][0] == n and got[layer][1] == pytest.approx(total, rel=1e-12) and got[layer][2] == worst


def test_bytes_out_is_what_the_files_hold(demo_src, tmp_path):
    """One number for one thing: ConvertStarted/ConvertFinished.bytes_out are the shard files' sizes (headers
    included), the ShardWritten sizes add up to them, and tensor_bytes is tqbench plan's total."""
    events = run(demo_src, tmp_path / "out", "tq3a-tqTe-down4-g64")
    started, finished = events[0], events[-1]
    written = [e.bytes for e in events if isinstance(e, ShardWritten)]
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert started.bytes_out == finished.bytes_out == sum(written) == sum(f.stat().st_size for f in files)
    plan = make_plan(group_sources(open_checkpoint(demo_src)), Recipe.parse("tq3a-tqTe-down4-g64"), SHARD)
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert started.tensor_bytes == plan.total_bytes == started.bytes_out - headers


@pytest.mark.parametrize("name", ["tq3a-tqTe-down4-g64", "affine4-g64", "tq3a-mxfp4e-g64"])
def test_read_ahead_into_mlx_memory_writes_the_same_bytes(demo_src, tmp_path, name):
    """Reading ahead into the MLX-owned arena (the default on a GPU), into an arena too small for the window (reads
    fall back to bytes and regions wrap), and one unit ahead as bytes (read_ahead=0, the default on a CPU) write
    identical outputs."""
    from tqbench.convert.pipeline import READ_AHEAD, default_read_ahead
    from tqbench.convert.produce import Producer

    readers = []

    class Observed(Producer):  # the real producer; it only keeps its reader to read the counters afterwards
        def __init__(self, ckpt, recipe, reader):
            super().__init__(ckpt, recipe, reader)
            readers.append(reader)

    assert default_read_ahead() == (READ_AHEAD if mx.default_device().type == mx.gpu else 0)
    run(demo_src, tmp_path / "bytes", name, read_ahead=0, producer_class=Observed)
    run(demo_src, tmp_path / "staged", name, read_ahead=READ_AHEAD, producer_class=Observed)
    run(demo_src, tmp_path / "small", name, read_ahead=24 * 2**10, producer_class=Observed)
    assert file_bytes(tmp_path / "bytes") == file_bytes(tmp_path / "staged") == file_bytes(tmp_path / "small")
    plain, staged, small = readers
    recipe = Recipe.parse(name)
    plan = make_plan(group_sources(open_checkpoint(demo_src)), recipe, SHARD, "streaming")
    decoded = sum(1 for m in plan.modules if m.choice.format in (Format.TURBOQUANT, Format.AFFINE)
                  for t in m.source.tensors if t.name.param != "bias")
    assert decoded > 30
    assert plain.staged_reads == 0 and plain._arena is None
    assert (staged.staged_reads, staged.arena_full) == (decoded, 0)  # every decoded source tensor, through the arena
    assert small.staged_reads + small.arena_full == decoded and small.arena_full > 0
    for r in readers:
        assert not r._staged and not r._pending  # every read started was collected or discarded
        assert r._arena is None or r._arena.used == 0


def test_a_bad_quantizer_kernel_is_refused_before_the_output_exists(demo_src, tmp_path, monkeypatch):
    from tqbench.errors import TqbenchError

    monkeypatch.setenv("TQBENCH_QUANTIZER", "fast")
    with pytest.raises(TqbenchError, match="TQBENCH_QUANTIZER='fast': choose one of compiled, passes, compare"):
        run(demo_src, tmp_path / "out", "tq3a-tqTe-down4-g64")
    assert not (tmp_path / "out").exists()
    run(demo_src, tmp_path / "affine", "affine4-g64")  # no TurboQuant module: the variable is not consulted
    assert (tmp_path / "affine" / "model.safetensors.index.json").is_file()

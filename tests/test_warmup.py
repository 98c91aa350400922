"""What the first token waits for (tqbench.runtime.warmup): the fused kernels a model's decode launches, known from
its shapes and counted here from its files; built before the first token with a KernelsCompiling per kernel (on this
machine through the tests' g++ emulation of the CUDA kernels: a real compile of each kernel's program); nothing
built or said on a CPU; and the faces' lines."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from rich.console import Console

import test_kernels
from conftest import converted
from tqbench.chat import report
from tqbench.runtime import codebook as ref
from tqbench.runtime import kernels as K
from tqbench.runtime.kernel_source import GROUPS
from tqbench.runtime.warmup import build_kernels, decode_kernels, kernels_to_build
from tqbench.events import KernelsCompiling, MlxWarmedUp, MlxWarmup


@pytest.fixture(scope="module")
def model() -> Path:
    """A small demo (4 layers, 3 of them MoE with 16 experts, top-4) converted with tq4 (shared, read-only)."""
    from tqbench.demo import DemoSpec

    return converted("tq4", DemoSpec())


def _load(path: Path, budget: int | None = None):
    from tqbench.runtime.load import load
    from tqbench.stream.streamer import StreamConfig

    return load(path, streaming=StreamConfig(budget_bytes=budget, workers=1) if budget else None)


def _headers(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            out.update(json.loads(fh.read(n)))
    out.pop("__metadata__", None)
    return out


def _expected(path: Path) -> tuple[set, int]:
    """From the files alone: the (levels, group, n, out, experts, x divisor) of each distinct decode product the
    fused kernels serve, and the number of self-check kernels (2 a plain configuration, 1 a gathered one)."""
    h = _headers(path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    experts, k = text["num_experts"], text["num_experts_per_token"]
    products, configs = set(), set()
    for key in (k for k in h if k.endswith(".codebook")):
        p = key[: -len(".codebook")]
        levels, n = h[key]["shape"][0], h[f"{p}.signs"]["shape"][0]
        if ".switch_mlp." in p:  # streaming layout: per-expert tensors under <moe>.experts.E.<w1|w2|w3>
            moe, proj = p.split(".switch_mlp.")
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
            out, groups = h[f"{moe}.experts.0.{w}.scales"]["shape"]
            xdiv = 1 if proj == "down_proj" else k  # down: x per (token, expert) pair; gate/up: x shared by k
            gathered = True
        else:
            out, groups = h[f"{p}.scales"]["shape"]
            gathered = False
        group = n // groups
        if n % 32 or out % 4 or group not in GROUPS or (gathered and not k < experts):
            continue
        products.add((levels, group, n, out, experts if gathered else 1, xdiv if gathered else 0))
        configs.add((gathered, levels, group))
    return products, sum(1 if g else 2 for g, _, _ in configs)


def _recording_dispatcher(seen: list) -> K.Dispatcher:
    """A dispatcher that serves products as CUDA would (the same shapes and self-checks) and records each launch's
    kernel, computing the products with the reference on the CPU."""

    def matmul(x, w, s, cb, backend):
        n = x.shape[-1]
        seen.extend(K.matmul_specs(x.size // n, cb.shape[0], n // s.shape[-1], n, w.shape[-2],
                                   K.dtype_name(s.dtype), K.dtype_name(cb.dtype)))
        return ref.matmul(x, w, s, cb)

    def gather(x, w, s, cb, idx, backend):
        n = x.shape[-1]
        seen.extend(K.gather_specs(x.shape[-2], tuple(x.shape[:-2]), tuple(idx.shape), cb.shape[0],
                                   n // s.shape[-1], n, w.shape[-2], w.shape[0], K.dtype_name(s.dtype),
                                   K.dtype_name(cb.dtype)))
        return ref.gather_matmul(x, w, s, cb, idx)

    return K.Dispatcher(backend="cuda", matmul_kernel=matmul, gather_kernel=gather)


def test_decode_kernels_are_counted_from_the_model_files(model):
    loaded = _load(model)
    d = K.Dispatcher(backend="cuda")
    specs = decode_kernels(loaded.model, d)
    want, checks = _expected(model)
    assert {(s.levels, s.group, s.n, s.out, s.experts, s.xdiv) for s in specs} == want
    assert len(specs) == len(want) == 7 and all(s.batch == 1 for s in specs)
    assert sum(s.gather for s in specs) == 1  # the routed experts' down projection (gate/up are mxfp4 in tq4)
    assert len(kernels_to_build(loaded.model, d)) == len(want) + checks == 10
    # a Mac compiles as many, in Metal's layouts (the same shapes: one row of x, the self-checks' 1 and 3 rows)
    metal = kernels_to_build(loaded.model, d, "metal")
    assert len(metal) == 10 and {(s.levels, s.n, s.out, s.batch) for s in metal} == \
        {(s.levels, s.n, s.out, s.batch) for s in kernels_to_build(loaded.model, d)}


@pytest.mark.parametrize("budget", [None, 40_000], ids=["resident", "streamed"])
def test_the_kernels_built_are_those_the_first_decode_step_launches(model, monkeypatch, budget):
    """A real decode step after a prompt, with a dispatcher that records every kernel it launches: exactly the
    kernels `kernels_to_build` names (the self-checks' come at the first fused product). Streamed: the same
    projections over the slot pools (fewer experts than the model has)."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = _load(model, budget)
    try:
        seen: list = []
        d = _recording_dispatcher(seen)
        monkeypatch.setattr(K, "dispatcher", d)
        planned = kernels_to_build(loaded.model, d)
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array([list(range(1, 13))]), cache=cache))  # prefill: 12 rows, the reference path
        assert seen == []
        mx.eval(loaded.model(mx.array([[5]]), cache=cache))
        assert set(seen) == set(planned) and len(planned) == len(set(planned))
        gathered = [s for s in planned if s.gather and s.out != K.SELF_CHECK_SHAPE[1]]
        if budget:
            assert [s.experts for s in gathered] == [loaded.streamer.pool_of[1].slots]
            assert gathered[0].experts == 10  # fewer slots than the 16 experts
        else:
            assert [s.experts for s in gathered] == [16]
    finally:
        if loaded.streamer is not None:
            loaded.streamer.close()


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory) -> Path:
    """A demo with 80 routed experts, top-8, all its experts' projections TurboQuant (tq4e), gate/up and down of
    different shapes: a prompt's 64 routings are sorted by expert and still served by the fused kernels."""
    from tqbench.convert import convert
    from tqbench.demo import DemoSpec, write_source
    from tqbench.recipe import Recipe

    root = tmp_path_factory.mktemp("warmup-experts")
    spec = DemoSpec(num_experts=80, num_experts_per_token=8, routed_expert_hidden_size=64, moe_intermediate_size=128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TQBENCH_CACHE_DIR", str(root / "cache"))
        list(convert(write_source(root / "src", spec, seed=0), root / "tq4e", Recipe.parse("tq4a-tq4e")))
    return root / "tq4e"


def test_a_prompt_whose_routings_are_sorted_has_its_kernels_built(many_experts, monkeypatch):
    """8 tokens at once route 64 times: mlx-lm sorts them by expert, and gate/up then take x per routing, a kernel
    decode never launches; it is built with the rest. The decode step launches exactly the rest."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = _load(many_experts)
    seen: list = []
    d = _recording_dispatcher(seen)
    monkeypatch.setattr(K, "dispatcher", d)
    planned = kernels_to_build(loaded.model, d)
    gathered = {(s.n, s.out, s.xdiv) for s in planned if s.gather and s.out != K.SELF_CHECK_SHAPE[1]}
    assert gathered == {(64, 128, 8), (128, 64, 1), (64, 128, 1)}  # gate/up as decode, down, gate/up sorted
    cache = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array([list(range(1, 9))]), cache=cache))
    prompt = set(seen)
    assert {s for s in prompt if s.gather} <= set(planned) and any(s.gather and s.xdiv == 1 and s.n == 64
                                                                   for s in prompt)
    seen.clear()
    mx.eval(loaded.model(mx.array([[5]]), cache=cache))
    assert set(seen) | {s for s in prompt if s.gather} | {s for s in planned if s.out == K.SELF_CHECK_SHAPE[1]} == \
        set(planned)


def test_nothing_is_built_on_a_cpu(model):
    from tqbench.cubin import STATS

    loaded = _load(model)
    assert K.default_backend() is None and K.dispatcher.resolved_backend() is None
    before = (STATS.compiled, STATS.loaded, K._compiled.cache_info().currsize)
    assert list(build_kernels(loaded.model)) == []
    assert (STATS.compiled, STATS.loaded, K._compiled.cache_info().currsize) == before
    assert K.dispatcher.checked == {}
    from tqbench.runtime.warmup import mlx_warmup

    assert mlx_warmup() is None  # and MLX compiles nothing to warn about


@pytest.mark.slow  # g++ compiles the 10 kernels (~2 s each on 2 cores) and runs the self-checks' emulation
@test_kernels.needs_gxx
def test_build_events_with_real_compiles(model, monkeypatch, tmp_path):
    """The kernels built through the tests' emulation, its executables kept in a fresh directory: the first build
    compiles every kernel, in order, with the totals adding up; a second finds every one cached. The self-checks
    then ran on the built kernels and passed."""
    monkeypatch.setattr(test_kernels, "_EMU_DIR", tmp_path / "emu")
    monkeypatch.setattr(K, "compiled", test_kernels._emulated("cuda"))

    def build(spec) -> bool:  # True when the kernel's executable was already there
        exe = tmp_path / "emu"
        before = set(exe.glob("*")) if exe.exists() else set()
        test_kernels._emulator(spec, "cuda")
        return set(exe.glob("*")) == before

    loaded = _load(model)
    d = K.Dispatcher(backend="cuda")
    planned = kernels_to_build(loaded.model, d)
    first = list(build_kernels(loaded.model, d, build))
    assert [type(e) for e in first] == [KernelsCompiling] * len(planned) == [KernelsCompiling] * 10
    assert [e.done for e in first] == list(range(1, 11)) and {e.total for e in first} == {10}
    assert [e.compiled for e in first] == list(range(1, 11)) and not any(e.cached for e in first)
    assert [e.name for e in first] == [K.kernel_name(s, "cuda") for s in planned]
    times = [e.elapsed_s for e in first]
    assert times == sorted(times) and times[0] > 0
    assert sorted(d.checked) == [("gather", "cuda", 16, 64, "mlx.core.float16", "mlx.core.float16"),
                                 ("matmul", "cuda", 16, 64, "mlx.core.float16", "mlx.core.float16")]
    assert all(d.checked.values()) and d.warnings == []
    again = list(build_kernels(loaded.model, K.Dispatcher(backend="cuda"), build))
    assert [(e.done, e.cached, e.compiled) for e in again] == [(i, True, 0) for i in range(1, 11)]

    # the CLI's piped lines: the first kernel, every tenth, the last, then the summary; nothing when all were cached
    from tqbench.cli.warmup import KernelProgress

    err = Console(file=io.StringIO(), force_terminal=False)
    with KernelProgress(err) as progress:
        for ev in first:
            progress.show(ev)
    lines = err.file.getvalue().splitlines()
    assert lines[0].startswith("building tqbench's CUDA kernels for this GPU: 1 of 10 (1 compiled, 0 from the cache)")
    assert len(lines) == 11 and lines[-1] == report.kernels_done_line(first[-1])
    err = Console(file=io.StringIO(), force_terminal=False)
    with KernelProgress(err) as progress:
        for ev in again:
            progress.show(ev)
    assert err.file.getvalue() == ""


def test_the_faces_lines():
    ev = KernelsCompiling(done=12, total=40, name="tq_matvec_l16_g64_n7168_o4096_b1_abc", cached=False, compiled=9,
                          elapsed_s=14.4)
    assert report.kernels_line(ev) == ("building tqbench's CUDA kernels for this GPU: 12 of 40 (9 compiled, 3 from the "
                                       "cache), 14 s")
    last = KernelsCompiling(done=40, total=40, name="x", cached=True, compiled=31, elapsed_s=53.04)
    assert report.kernels_done_line(last) == ("tqbench's CUDA kernels: 40 ready in 53.0 s (31 compiled by NVRTC and "
                                              "kept for the next start, 9 from the cache)")
    assert report.mlx_warmup_line(MlxWarmup(first_run=True, cached=0)) == (
        "warming up MLX's kernels (first run on this machine: a minute or more, no progress to show)")
    assert report.mlx_warmed_line(MlxWarmedUp(seconds=66.25, compiled=143)) == (
        "MLX compiled 143 of its kernels; first token after 66.2 s (the kernels are kept for the next start)")
    # piped: the warning on a first run only, the count only when MLX compiled any
    from tqbench.cli.warmup import MlxWarmupStatus

    for start, end, want in [(MlxWarmup(first_run=True, cached=0), MlxWarmedUp(seconds=66.25, compiled=143), 2),
                             (MlxWarmup(first_run=False, cached=143), MlxWarmedUp(seconds=0.4, compiled=0), 0)]:
        err = Console(file=io.StringIO(), force_terminal=False)
        with MlxWarmupStatus(err) as status:
            status.started(start)
            status.ended(end)
        assert len(err.file.getvalue().splitlines()) == want


def test_a_failed_self_check_is_asked_once(model):
    """build_kernels leaves the dispatcher's self-checks done: the first forward asks nothing again (a stand-in kernel
    that is wrong fails its check once, with one warning a configuration)."""
    from tqbench.runtime.layers import TurboQuantLinear

    loaded = _load(model)
    calls = []

    def wrong(*args, **kwargs):
        calls.append(1)
        return mx.zeros((1,))

    d = K.Dispatcher(backend="cuda", matmul_kernel=wrong, gather_kernel=wrong, stream=io.StringIO())
    assert len(list(build_kernels(loaded.model, d, build=lambda spec: True))) == 10
    assert len(d.checked) == 2 and set(d.checked.values()) == {False} and len(d.warnings) == 2
    asked = len(calls)
    lin = next(m for _, m in loaded.model.named_modules() if isinstance(m, TurboQuantLinear))
    y = d.matmul(mx.ones((1, lin.input_dims)), lin.weight, lin.scales, lin.codebook)
    assert y.shape == (1, lin.output_dims) and len(calls) == asked and len(d.warnings) == 2  # the reference served


@pytest.mark.slow  # a model load and three short replies (~3 s)
def test_mlx_warmup_events_frame_the_first_forward_pass(model, monkeypatch, tmp_path):
    """The session's first reply in a process whose default device is a CUDA GPU (here the detection says so; the
    forward runs on the CPU): MlxWarmup after ReplyStarted, MlxWarmedUp before the first token, counting the kernels
    MLX's cache directory gained; none in the next reply; the reply's own tokens are those of a run without them."""
    from tqbench.chat.request import ChatRequest, SamplingRequest
    from tqbench.chat.session import ChatSession
    from tqbench.runtime import warmup
    from tqbench.events import PrefillProgress, ReplyDone, ReplyStarted, TokenOut

    ptx = tmp_path / "ptx"
    ptx.mkdir()
    for name in ("a", "b"):
        (ptx / f"{name}.ptx").write_text("")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(ptx))
    chat = ChatSession()
    try:
        with chat.open(ChatRequest(model=str(model), sampling=SamplingRequest(max_tokens=4),
                                   chat_template=False)) as job:
            job.result()
        with chat.reply("def fib(n):") as job:
            plain = job.result()
        chat.reset()
        monkeypatch.setattr(K, "default_backend", lambda: "cuda")
        monkeypatch.setattr(warmup, "_warmed", False)
        with chat.reply("def fib(n):") as job:
            first = job.result()
        kinds = [type(e) for e in first if not isinstance(e, PrefillProgress)]  # the prompt's progress between
        assert kinds[:4] == [ReplyStarted, MlxWarmup, MlxWarmedUp, TokenOut] and kinds[-1] is ReplyDone
        assert first[1] == MlxWarmup(first_run=False, cached=2)
        warmed = next(e for e in first if isinstance(e, MlxWarmedUp))
        assert warmed.compiled == 0 and 0 < warmed.seconds
        same = [e for e in first if isinstance(e, (ReplyStarted, TokenOut))]
        assert same == [e for e in plain if isinstance(e, (ReplyStarted, TokenOut))] and len(same) == 5
        assert (first[-1].text, first[-1].generated_tokens) == (plain[-1].text, plain[-1].generated_tokens)
        with chat.reply("class Node:") as job:
            assert not any(isinstance(e, (MlxWarmup, MlxWarmedUp)) for e in job.result())
    finally:
        chat.close()


def test_serve_tells_each_warmup_step_once():
    """`tqbench serve` polls its Service's latest warm-up event: each is told once, the count only when MLX compiled
    any (the Service here is a stand-in holding that one attribute)."""
    from types import SimpleNamespace

    from tqbench.cli.serve import _warmup_lines

    service, shown = SimpleNamespace(warmup=None), []
    assert _warmup_lines(service, shown) == []
    service.warmup = MlxWarmup(first_run=True, cached=0)
    assert _warmup_lines(service, shown) == [report.mlx_warmup_line(service.warmup)]
    assert _warmup_lines(service, shown) == []
    service.warmup = MlxWarmedUp(seconds=70.5, compiled=143)
    assert _warmup_lines(service, shown) == [report.mlx_warmed_line(service.warmup)]
    assert _warmup_lines(SimpleNamespace(warmup=MlxWarmedUp(seconds=0.3, compiled=0)), []) == []

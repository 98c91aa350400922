"""Tensor parallel on loopback (MLX's ring backend, two ranks started by `mlx.launch`): every rank holds half of every
layer, TurboQuant modules included, and the model computes what one process does up to the order of its float sums;
a module whose slices would cut a rotation block is one line on every rank, and streamed experts are refused.

The model: a demo of tqbench.demo's default shape (random weights), converted with `tq4-norot-g32` so that every
sliced projection splits in two (the shipped demo cannot: see docs/distributed.md), and its bf16 tensors widened to
float32, so that the order of the sums is the only difference between one process and two (in bf16 each rank's
partial sums are rounded before they are added, and a reply can turn where the model's top two are close)."""

from __future__ import annotations

import json
import shutil
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import converted, demo_tq4
from model_helpers import free_port
from test_distributed import BIN, chat_args, launch, token_ids

pytestmark = pytest.mark.slow  # each launch starts two processes that load a model (~5-10 s on 2 cores)

RANK_SCRIPT = Path(__file__).parent / "tensor_rank.py"
TOKENS = [300, 341, 556, 157, 556, 39, 724, 297, 560, 31]
# Float32 rounding (2^-24) of sums of up to 128 terms (the widest sliced input), over the model's 4 layers: the most
# that summing the ranks' halves in another order can move a logit, relative to the largest one.
SUM_ORDER = 2 ** -24 * 128 * 4


@pytest.fixture(scope="module")
def sliceable(tmp_path_factory) -> Path:
    from tqbench.demo.spec import DemoSpec

    return widened(converted("tq4-norot-g32", DemoSpec()), tmp_path_factory.mktemp("tensor") / "tq4-f32")


def widened(src: Path, dst: Path) -> Path:
    """A copy of a converted model with its bf16 tensors stored as float32 (TurboQuant's tensors as they are). Its
    expert map (byte offsets into the shards) is left out: the experts run resident."""
    shutil.copytree(src, dst)
    (dst / "expert_map.json").unlink()
    for f in dst.glob("model*.safetensors"):
        arrays, meta = mx.load(str(f), return_metadata=True)
        mx.save_safetensors(str(f), {k: v.astype(mx.float32) if v.dtype == mx.bfloat16 else v
                                     for k, v in arrays.items()}, metadata=meta)
    return dst


def test_two_ranks_give_one_process_greedy_tokens(sliceable):
    one = subprocess.run([str(BIN / "tqbench"), *chat_args(sliceable, "--max-tokens", "16")], capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    p = launch(2, chat_args(sliceable, "--max-tokens", "16", "--parallel", "tensor"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert len(token_ids(one.stdout)) == 16 and token_ids(out) == token_ids(one.stdout)
    assert sum(json.loads(line)["event"] == "done" for line in out.splitlines()) == 1  # one face


def test_each_rank_holds_half_and_computes_the_same_logits(sliceable, tmp_path):
    """Each rank loads the model whole and sharded, and compares their logits for the same tokens; then loads the
    shipped demo (whose projections are rotated in blocks as wide as their inputs) and the model streamed."""
    shipped = demo_tq4(tmp_path)
    p = subprocess.run([str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port", str(free_port(2)),
                        str(BIN / "python"), str(RANK_SCRIPT), str(sliceable), json.dumps(TOKENS), str(shipped)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    ranks = {int(line.split(":")[0].split()[1]): json.loads(line.split(":", 1)[1]) for line in p.stdout.splitlines()
             if line.startswith("rank ")}
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["dtype"] == "mlx.core.float32"
        # the shard happened: input columns halved (sharded-to-all), output rows halved (all-to-sharded), each
        # routed expert's too
        assert r["whole"] == {"dense down_proj": [64, 16], "dense up_proj": [128, 8], "experts down_proj": [16, 32, 8]}
        assert r["sharded"] == {"dense down_proj": [64, 8], "dense up_proj": [64, 8], "experts down_proj": [16, 32, 4]}
        assert r["layers"] == [0, 4]  # every layer, a slice of each
        assert r["max_diff"] <= SUM_ORDER * r["max_logit"]  # 1.1e-4 here; measured 7.9e-6
        assert r["argmax_equal"]
        assert r["cannot_slice"] == ("language_model.model.layers.0.self_attn.o_proj: input width 128 in 2 slices of "
                                     "64 cuts a rotation block of 128")
        assert r["streamed"].startswith("--parallel tensor keeps the routed experts resident")


def test_a_module_that_cannot_be_sliced_stops_every_rank_with_one_line_on_rank_0(tmp_path):
    """Two ranks started by hand from one hosts file (under mlx.launch, the first rank to stop has the launcher stop
    the other, which may then not say why): both stop with exit code 1, rank 0 with the one line, rank 1 (headless)
    with nothing printed."""
    model = demo_tq4(tmp_path)
    port = free_port(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = [subprocess.Popen([str(BIN / "tqbench"), *chat_args(model, "--max-tokens", "4", "--parallel", "tensor")],
                              env=dict(_env(), MLX_HOSTFILE=str(hosts), MLX_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert out0 == out1 == err1 == ""
    assert err0.splitlines() == ["tqbench: error: language_model.model.layers.0.self_attn.o_proj: input width 128 in 2 "
                                 "slices of 64 cuts a rotation block of 128"]


def test_tensor_parallel_without_a_launcher_is_refused(tmp_path):
    p = subprocess.run([str(BIN / "tqbench"), "chat", "--model", str(tmp_path), "--prompt", "hi", "--parallel",
                        "tensor"], capture_output=True, text=True, timeout=60, env=_env())
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == ("tqbench: error: --parallel tensor splits every layer across the ranks mlx.launch "
                                "starts: run it under mlx.launch")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")}

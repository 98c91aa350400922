"""`tqbench plan --machines N`: the layer split is mlx-lm's own (checked against its pipeline code), every byte of the
plan lands on exactly one rank (the modules outside the layers on every rank), and the CLI says it in lines and JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cli_helpers import tqbench
from tqbench.demo import ensure_demo
from tqbench.errors import TqbenchError
from tqbench.distributed.split import layer_split, split_plan
from tqbench.recipe import Recipe
from tqbench.machine import GB, machine
from tqbench.recipe.plan import group_sources, make_plan
from tqbench.source import open_checkpoint


class Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("layers", [8, 9, 61, 93])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_the_split_is_mlx_lms(layers, ranks):
    from mlx_lm.models.kimi_k3 import KimiK3TextModel
    from mlx_lm.models.pipeline import PipelineMixin

    if ranks > layers:
        return
    for model_type, pipeline in (("kimi_k3", KimiK3TextModel.pipeline), ("qwen3_next", PipelineMixin.pipeline)):
        want = []
        for r in range(ranks):
            m = SimpleNamespace(layers=[object()] * layers, use_attn_res=False, _set_cache_indices=lambda: None)
            pipeline(m, Group(r, ranks))
            want.append((m.start_idx, m.end_idx))
        assert layer_split(layers, ranks, model_type) == want


def test_every_byte_lands_on_one_rank():
    ckpt = open_checkpoint(ensure_demo())
    plan = make_plan(group_sources(ckpt), Recipe.parse("tq4"), 5 * 2**30)
    shared = sum(m.bytes for m in plan.modules if m.layer is None)
    for n in (1, 2, 3, 8):
        # a GPU limit that leaves each rank room for its resident part and half of its experts: they stream
        fps = [r.footprint for r in split_plan(plan, machine(64 * GB, 64 * GB, "linux"), n).ranks]
        room = max(f.resident_bytes + f.streamed_bytes // 2 for f in fps)
        m = machine(64 * GB, 3 * GB + room, "linux", 1e9)
        s = split_plan(plan, m, n)
        assert [r.rank for r in s.ranks] == list(range(n))
        assert sum(r.footprint.total_bytes for r in s.ranks) - (n - 1) * shared == plan.total_bytes
        assert sum(r.footprint.streamed_bytes for r in s.ranks) == plan.streamed_bytes
        assert sum(r.footprint.moe_layers for r in s.ranks) == plan.experts.moe_layers
        streaming = [r for r in s.ranks if r.fit.verdict.value == "streaming"]
        assert streaming and s.fits
        # a token's read time is the sum of the ranks' (a pipeline), so the ceiling is 1 / that sum
        assert s.tok_s_ceiling == pytest.approx(1 / sum(1 / r.fit.tok_s_ceiling for r in streaming))
        assert s.bytes_per_token == round(sum(r.fit.bytes_per_token * (1 - r.fit.hit_rate) for r in streaming))
    with pytest.raises(TqbenchError, match="--machines 9: give 1 to 8"):
        split_plan(plan, m, 9)


def test_plan_machines_in_the_cli(capsys, monkeypatch):
    args = ["plan", ensure_demo(), "-r", "tq4", "--memory", "64GB", "--gpu-limit", "3.001GB", "--disk-gbps", "1"]
    r = tqbench(capsys, monkeypatch, *args, "--machines", "2", "--json")
    assert r.code == 0, r.err
    split = json.loads(r.out)["plans"][0]["split"]
    assert split["machines"] == 2 and [x["layers"] for x in split["ranks"]] == [[4, 8], [0, 4]]
    text = tqbench(capsys, monkeypatch, *args, "--machines", "2")
    assert "tq4-g64 on 2 machines of this size (pipeline: rank 0 runs the last layers):" in text.out
    assert "  rank 0: layers 4-7, " in text.out and "  rank 1: layers 0-3, " in text.out
    bad = tqbench(capsys, monkeypatch, *args, "--machines", "99")
    assert bad.code == 1 and bad.err == "tqbench: error: --machines 99: give 1 to 8 (one layer per machine at least)\n"

"""The plan report's rows (tqbench.recipe.report), which `tqbench plan` and the TUI's Recipe screen both show, checked
against values computed here from the plan's modules, the source's headers, a real conversion and the fit rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tqbench import units
from tqbench.convert import convert
from tqbench.demo import DemoSpec, write_source
from tqbench.recipe import Recipe, assess, group_sources, machine, make_plan
from tqbench.recipe.fit import RESERVE
from tqbench.recipe.report import NOT_DISK_BOUND, plan_report, rate_cell
from tqbench.source import open_checkpoint, summarize

SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)  # experts wide enough for g64
NAMES = ["tq3a-tqTe-down4-g64", "tq4-g32"]
SHARD = 150_000


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("report") / "demo", SPEC, seed=0)


@pytest.fixture(scope="module")
def plans(src):
    sources = group_sources(open_checkpoint(src))
    return [make_plan(sources, Recipe.parse(n), SHARD) for n in NAMES]


def sizes(n: int) -> str:
    return f"{units.gb(n)}\n{units.gib(n)}"


def streaming_machine(plan, disk: float):
    """Memory for the resident part, the reserve, one token's pages and a third of the experts as cache."""
    e = plan.experts
    return machine(plan.resident_bytes + RESERVE + e.top_k * e.bytes_per_expert + plan.streamed_bytes // 3,
                   platform="linux", disk_bytes_per_s=disk)


def test_sizes_are_the_modules_outputs(src, plans):
    m = machine(512 * 10**9, platform="linux", disk_bytes_per_s=2e9)
    report = plan_report(plans, [assess(p.footprint, m) for p in plans])
    assert report.recipes == tuple(Recipe.parse(n).name for n in NAMES)
    source = summarize(open_checkpoint(src))
    for i, p in enumerate(plans):
        cells = report.cells(i)
        outputs = [o for mod in p.modules for o in mod.outputs]
        streamed = sum(o.nbytes for o in outputs if o.streamed)
        total = sum(o.nbytes for o in outputs)
        assert cells["total"] == sizes(total)
        assert cells["routed experts"] == sizes(streamed)
        assert cells["resident"] == sizes(total - streamed)
        assert cells["bits/weight"] == f"{total * 8 / source.params:.3f}"
        role_params = {g.key: g.params for g in source.by_role}
        attention = sum(o.nbytes for mod in p.modules if mod.role.value == "attention" for o in mod.outputs)
        assert cells["bpw attention"] == f"{attention * 8 / role_params['attention']:.3f}"
        # One expert's page: the first MoE layer's streamed outputs (a leading expert axis) over its experts.
        layer = min(mod.layer for mod in p.modules if any(o.streamed for o in mod.outputs))
        by_proj = {}
        for mod in p.modules:
            for o in mod.outputs:
                if o.streamed and mod.layer == layer:
                    proj = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[o.name.split(".")[-2]]
                    by_proj[proj] = by_proj.get(proj, 0) + o.nbytes // SPEC.num_experts
        page = sum(by_proj.values())
        assert cells["expert page"].split("\n") == [units.gb(page), *(f"{k} {units.gb(v)}" for k, v in
                                                                      by_proj.items())]
        assert cells["verdict"] == "resident"
        assert cells["max tok/s top-k"] == cells["max tok/s reduced"] == NOT_DISK_BOUND
        assert cells["hit rate"] == "100.0%"


def test_shards_are_the_files_a_conversion_writes(src, plans, tmp_path):
    p = plans[0]
    report = plan_report([p], [assess(p.footprint, machine(512 * 10**9, platform="linux"))])
    for _ in convert(src, tmp_path / "out", p.recipe, SHARD):
        pass
    files = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert report.row("shards").cells == (str(len(files)),) and len(files) > 1
    assert report.row("shards").label == f"shards <= {units.gib(SHARD)}" == "shards <= 146.48 KiB"
    assert sum(f.stat().st_size for f in files) > p.total_bytes  # the headers come on top of the tensors


def test_streaming_ceiling(plans):
    p = plans[0]
    e = p.experts
    per_token = e.moe_layers * e.top_k * e.bytes_per_expert
    budget = e.top_k * e.bytes_per_expert + p.streamed_bytes // 3
    hit = budget / p.streamed_bytes
    disk = 123.4 * per_token * (1 - hit)  # a disk that allows 123.4 tokens per second at native top-k
    f = assess(p.footprint, streaming_machine(p, disk))
    cells = plan_report([p], [f]).cells(0)
    assert cells["verdict"] == "streaming"
    assert cells["hit rate"] == f"{hit:.1%}"
    assert cells["cache budget"] == sizes(budget)
    assert cells["experts/token top-k"] == units.gb(per_token)
    assert cells["max tok/s top-k"] == "123"
    assert cells["max tok/s reduced"] == "247"  # half the experts per token: twice the tokens
    fast = assess(p.footprint, streaming_machine(p, 2e9))
    assert 2e9 / (per_token * (1 - hit)) > 10_000
    assert plan_report([p], [fast]).cells(0)["max tok/s top-k"] == ">10k"
    unknown = assess(p.footprint, streaming_machine(p, None))
    assert plan_report([p], [unknown]).cells(0)["max tok/s top-k"] == "-"


@pytest.mark.parametrize("x,text", [(60185.37, ">10k"), (10_000.0, ">10k"), (8049.6, "8,050"), (123.45, "123"),
                                    (12.345, "12.3"), (1.2345, "1.23"), (0.012345, "0.012")])
def test_rate_precision(plans, x, text):
    f = assess(plans[0].footprint, streaming_machine(plans[0], 1e9))
    assert rate_cell(x, f) == text


def test_rows_sections_and_order(plans):
    m = machine(512 * 10**9, platform="linux", disk_bytes_per_s=2e9)
    report = plan_report(plans, [assess(p.footprint, m) for p in plans])
    keys = [r.key for r in report.rows]
    assert keys == ["resident", "routed experts", "total", "bits/weight", "bpw attention", "bpw routed_expert",
                    "bpw shared_expert", "expert page", "kept at source", "shards", "verdict", "cache budget",
                    "experts/token top-k", "experts/token reduced", "hit rate", "max tok/s top-k",
                    "max tok/s reduced"]
    assert [r.key for r in report.rows if r.section_end] == ["total", "shards"]
    assert [r.key for r in report.primary_first][:11] == [
        "resident", "routed experts", "total", "bits/weight", "expert page", "shards", "verdict", "cache budget",
        "max tok/s top-k", "max tok/s reduced", "bpw attention"]
    assert {r.parent for r in report.rows if r.key.startswith("bpw ")} == {"bits/weight"}
    assert report.row("max tok/s top-k").label == "max tok/s top-4" and report.row("bpw attention").label == "  attention"
    assert all(len(r.cells) == 2 for r in report.rows)

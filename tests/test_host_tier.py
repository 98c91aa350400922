"""The host-RAM expert tier: experts evicted from the GPU slots go there and come back by a copy, never a read; the
model computes bit for bit what the resident one does; every routed expert is counted in exactly one tier; the
tier is exclusive with the slots and never holds more than its budget."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import converted
from model_helpers import expert_bytes, logits_and_tokens
from tqbench.demo import SHIPPED_SPEC
from tqbench.runtime.load import load
from tqbench.stream import StoreError, StreamConfig
from tqbench.stream.host import HostTier
from tqbench.stream.store import part_array
from tqbench.stream.pagein import staging_bytes

PROMPT = [4352, 100, 517, 2300, 42, 7, 1311, 260, 9, 88, 1000, 61]
RECIPE = "tq3a-tqTe-down4-g32"
E, K = SHIPPED_SPEC.num_experts, SHIPPED_SPEC.num_experts_per_token
L = sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers))


@pytest.fixture(scope="module")
def model() -> Path:
    """The shipped demo's RECIPE conversion, shared with other modules (read-only)."""
    return converted(RECIPE)


@pytest.fixture(scope="module")
def expert(model) -> int:
    return expert_bytes(model)


def _run(m, n: int = 10) -> tuple[np.ndarray, list[int]]:
    return logits_and_tokens(m, PROMPT, n)


@pytest.fixture(scope="module")
def resident(model):
    return _run(load(model).model)


def _streamed(model, expert, slots: int, host_slots: int, workers: int = 2, **kw):
    budget = staging_bytes(expert, workers) + slots * expert
    return load(model, streaming=StreamConfig(budget_bytes=budget, workers=workers, page_cache="on",
                                              host_budget_bytes=host_slots * expert, **kw))


@pytest.mark.parametrize("slots, host_slots, workers, policy", [
    (12, 40, 2, "lrfu-next"),
    (12, 10_000, 4, "lru"),  # the host tier holds every expert
    (2, 200, 1, "lrfu"),  # fewer slots than a layer's routed experts: chunked
])
def test_a_host_tier_is_bit_identical_to_resident_and_serves_misses_by_copy(model, expert, resident, slots,
                                                                            host_slots, workers, policy):
    """On the CPU streamed experts compute what resident ones do, bit for bit. On CUDA the prompt's expert gathers
    take other MLX kernels for a pool of slots than for all experts (another order of bf16 arithmetic; on this
    prompt of arbitrary ids the next-token distribution is flat and routings flip: results/gpu-cuda-checks-h100.json),
    so there the host tier is held to the same streaming without it."""
    loaded = _streamed(model, expert, slots, host_slots, workers, policy=policy)
    logits, tokens = _run(loaded.model)
    reference = resident
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        plain = _streamed(model, expert, slots, 0, workers, policy=policy)
        reference = _run(plain.model)
        plain.streamer.close()
    np.testing.assert_array_equal(logits, reference[0])
    assert tokens == reference[1]
    st = loaded.streamer.stats
    events = loaded.streamer.drain()
    served = [k for e in events for k in e.served]
    assert st.hits_host == served.count("host") > 0  # misses the host tier served by copy
    assert st.misses == served.count("miss") and st.hits_gpu == len(served) - st.misses - st.hits_host
    assert st.critical_bytes == st.misses * expert  # a host hit reads nothing
    assert sum(st.tier_rates().values()) == pytest.approx(1.0)
    assert st.host_slots == host_slots and st.host_bytes <= st.host_budget_bytes
    assert st.host_admitted >= st.hits_host  # only what a slot gave up comes back from the host
    if host_slots >= L * E:
        assert st.host_dropped == 0
        assert st.misses == len({(e.layer, x) for e in events for x in e.experts})  # each expert read once at most
    loaded.streamer.close()


def test_the_host_tier_is_exclusive_and_holds_each_experts_bytes(model, expert):
    """After a run: no expert is both in a GPU slot and in the host tier, and each host slot holds the expert's bytes
    exactly as the store reads them from disk."""
    loaded = _streamed(model, expert, 12, 60)
    _run(loaded.model, 6)
    s = loaded.streamer
    gpu = {k for p in s.pools for k in p.cache.slots}
    host = set(s.host.cache.slots)
    assert host and not gpu & host
    buf = np.zeros(s.store.buffer_bytes(1), dtype=np.uint8)
    for (layer, e), i in sorted(s.host.cache.slots.items())[:20]:
        s.store.read(layer, e, buf)
        want = buf[s.store.shift(layer, e):][:expert]
        for p in s.pools[0].parts:  # bytes between parts (alignment) are never copied
            np.testing.assert_array_equal(part_array(s.host.slot(i, expert), p), part_array(want, p))
    s.close()


@pytest.mark.slow  # four streamed runs at growing host tiers (~6 s)
def test_more_host_tier_means_fewer_disk_reads(model, expert):
    """The same prompt at the same GPU budget: reads from disk fall as the host tier grows, to the distinct experts
    routed when it holds them all; the GPU tier's hits do not change (it makes the same choices)."""
    seen = []
    for host_slots in (0, 20, 80, 10_000):
        budget = staging_bytes(expert, 2) + 12 * expert
        cfg = StreamConfig(budget_bytes=budget, workers=2, page_cache="on", host_budget_bytes=host_slots * expert)
        loaded = load(model, streaming=cfg)
        _run(loaded.model)
        st = loaded.streamer.stats
        seen.append((st.misses, st.hits_gpu, st.hits_host))
        loaded.streamer.close()
    misses = [m for m, _, _ in seen]
    assert misses == sorted(misses, reverse=True) and misses[0] > misses[-1]
    assert len({g for _, g, _ in seen}) == 1
    assert seen[0][2] == 0


def test_a_host_tier_below_one_expert_is_refused(model, expert):
    loaded = _streamed(model, expert, 12, 0)  # 0: no host tier
    assert loaded.streamer.host is None
    loaded.streamer.close()
    with pytest.raises(StoreError, match="host cache .* cannot hold one expert"):
        load(model, streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + 12 * expert, workers=2,
                                           host_budget_bytes=expert - 1))


def test_host_tier_bookkeeping():
    tier = HostTier(3 * 100 + 50, 100)
    assert tier.capacity == 3
    got = tier.take([(1, 1), (1, 2)], set())
    assert set(got) == {(1, 1), (1, 2)} and len(set(got.values())) == 2
    got = tier.take([(1, 3), (1, 4)], {(1, 1)})  # (1, 1) is being copied out: (1, 2) goes, least recently taken
    assert set(got) == {(1, 3), (1, 4)} and (1, 1) in tier and (1, 2) not in tier
    assert tier.dropped == 1 and tier.admitted == 4
    assert tier.take([(2, 0), (2, 1), (2, 2)], {(1, 1), (1, 3), (1, 4)}) == {}  # no room without a locked key
    tier.release([(1, 1)])
    assert (1, 1) not in tier and len(tier) == 2 and tier.bytes_held == 200
    with pytest.raises(ValueError, match="cannot hold one expert"):
        HostTier(99, 100)


def test_host_slots_start_on_pages_of_their_own_and_are_pinned_once_each_ahead_of_use():
    """On CUDA each host slot is page-locked (DmaCopy.pin) before its first use, by a thread of its own in the order
    slots are handed out: the ranges must not share a page (the driver refuses to lock a page twice), every slot is
    locked exactly once, and a slot asked for before that thread reached it is pinned first where it is asked for."""
    pinned, gate = [], threading.Event()

    def pin(view):
        if threading.current_thread().name == "tqbench-pin":
            gate.wait(5)  # the pinning thread holds slot 0 until the engine side asked for slot 2
        pinned.append((view.ctypes.data, view.nbytes, threading.current_thread().name))
        return True

    tier = HostTier(4 * 5000, 5000, pin=pin)
    assert tier.capacity == 4
    view = tier.slot(2, 5000)  # not reached by the pinning thread yet: pinned here
    assert [(n, who) for _, n, who in pinned] == [(8192, threading.current_thread().name)]
    gate.set()
    tier.slot(0, 4000)  # the thread holds it: waited for, not pinned twice
    tier.close()
    assert sorted(a for a, _, _ in pinned) == [tier.arena[i].ctypes.data for i in range(4)]  # each slot once
    assert {who for _, _, who in pinned[1:]} == {"tqbench-pin"} and all(n == 8192 for _, n, _ in pinned)
    first = tier.arena[0].ctypes.data
    assert first % mmap.PAGESIZE == 0 and tier.arena[1].ctypes.data - first == 8192  # page-aligned, none shared
    view[:] = 7
    assert (tier.slot(2, 5000) == 7).all() and not tier.slot(3, 5000).any() and len(pinned) == 4
    assert tier.cache.place_many([(0, 0), (0, 1)], 0, set()) == [0, 1]  # handed out from slot 0 up, as pinned


def test_part_views_round_trip(model, expert):
    """copy_out is copy_in's reverse: an expert copied into a slot and out again gives its bytes back."""
    loaded = _streamed(model, expert, 4, 8)
    s = loaded.streamer
    pool = s.pools[0]
    buf = np.zeros(s.store.buffer_bytes(1), dtype=np.uint8)
    s.store.read(1, 3, buf)
    src = buf[s.store.shift(1, 3):][:expert]
    pool.copy_in(0, src)
    out = np.zeros(expert, dtype=np.uint8)
    pool.copy_out(0, out)
    covered = np.zeros(expert, dtype=bool)
    for p in pool.parts:
        covered[p.offset:p.offset + p.nbytes] = True
        np.testing.assert_array_equal(part_array(out, p), part_array(src, p))
    assert covered.any()
    s.close()


# ---- the tier's size, and what the faces say ------------------------------------------------------------------------


def test_host_tier_plan_by_machine(model, expert):
    from tqbench.chat.request import parse_host_cache
    from tqbench.errors import TqbenchError
    from tqbench.stream.budget import HOST_RESERVE, host_tier_plan, model_bytes

    mb = model_bytes(model)
    gpu = 10 * expert
    plan = host_tier_plan("auto", model, gpu, unified=True)
    assert (plan.nbytes, plan.why) == (0, "unified memory")
    plan = host_tier_plan(parse_host_cache("1MB"), model, gpu, unified=True)
    assert (plan.nbytes, plan.why) == (10**6, "asked on unified memory")
    assert host_tier_plan(parse_host_cache("off"), model, gpu, unified=False).why == "off"
    assert parse_host_cache("0") == "off" and parse_host_cache("24") == 24 * 10**9
    # CUDA: what is free now minus the reserve, at most the experts the GPU budget leaves out (plus one)
    from tqbench.machine import physical_memory

    reserve = max(HOST_RESERVE, physical_memory() // 10)
    plan = host_tier_plan("auto", model, gpu, unified=False, available=reserve + 5 * expert)
    assert (plan.nbytes, plan.why) == (5 * expert, "auto")
    plan = host_tier_plan("auto", model, gpu, unified=False, available=reserve + 10**15)
    assert plan.nbytes == mb.experts - gpu + mb.one_expert
    assert host_tier_plan("auto", model, gpu, unified=False, available=reserve).why == "no room"
    assert host_tier_plan("auto", model, mb.experts, unified=False, available=10**15).why == "nothing left"
    with pytest.raises(TqbenchError, match=r"host cache 'lots': give auto, off or a size"):
        parse_host_cache("lots")


@pytest.mark.slow  # four chats through the CLI, two of them streamed 24-token replies (~6 s)
def test_chat_with_a_host_tier_says_so_and_counts_it(model, expert, tmp_path, capsys, monkeypatch):
    import json

    from cli_helpers import tqbench

    stats = tmp_path / "stats.json"
    budget = staging_bytes(expert, 2) + 12 * expert
    args = ["chat", "--model", model, "--prompt", "def fib(n):", "--max-tokens", "24", "--prefetch-workers", "2",
            "--cache-budget-gb", f"{budget}B", "--page-cache", "on", "--no-learn"]
    plain = tqbench(capsys, monkeypatch, *args)
    assert plain.code == 0, plain.err
    assert "one tier (unified memory: the GPU's memory is the RAM)" in plain.err  # auto, here
    r = tqbench(capsys, monkeypatch, *args, "--host-cache-gb", f"{200 * expert}B", "--stats-json", stats)
    assert r.code == 0, r.err
    assert r.out == plain.out  # the same text with the tier
    from tqbench import units

    assert (f"host tier {units.size(200 * expert)} (200 experts, asked, unified memory: a second copy in the same "
            "RAM)") in r.err
    doc = json.loads(stats.read_text())
    assert doc["host_budget_bytes"] == 200 * expert and doc["host_slots"] == 200
    assert doc["hits_host"] > 0 and doc["hits"] == doc["hits_pinned"] + doc["hits_cache"] + doc["hits_prefetched"] \
        + doc["hits_host"]
    n = doc["hits"] + doc["misses"]
    assert doc["tiers"] == {"gpu": round((doc["hits"] - doc["hits_host"]) / n, 4),
                            "host": round(doc["hits_host"] / n, 4), "disk": round(doc["misses"] / n, 4)}
    bad = tqbench(capsys, monkeypatch, *args, "--host-cache-gb", "lots")
    assert bad.code == 1 and bad.err.splitlines()[-1] == ("tqbench: error: host cache 'lots': give auto, off or a "
                                                          "size (24GB, 512MB; a bare number is GB)")
    small = tqbench(capsys, monkeypatch, *args, "--host-cache-gb", "100B")
    assert small.code == 1 and small.err.splitlines()[-1] == (
        f"tqbench: error: {model}: the host cache (100 bytes) cannot hold one expert ({expert:,} bytes)")


@pytest.mark.slow  # a streamed eval of 48 tokens, token by token, against the model itself (~12 s)
def test_eval_reports_tiers_and_a_host_tier_changes_nothing(model, expert, tmp_path, capsys, monkeypatch):
    """`tqbench eval M --against M` with a small cache and a host tier, token by token: the same logits as the
    reference (KL 0, every top-1 agreeing: the tier only moves bytes), and where MODEL's experts came from."""
    import json

    from cli_helpers import tqbench

    budget = staging_bytes(expert, 2) + 12 * expert
    r = tqbench(capsys, monkeypatch, "eval", model, "--against", model, "--decode", "--tokens", "48", "--window", "48",
                "--prompts", "0", "--prefetch-workers", "2", "--cache-budget-gb", f"{budget}B", "--host-cache-gb",
                f"{200 * expert}B", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    t = doc["tiers"]
    assert t["host"] > 0 and t["disk"] > 0 and sum(t.values()) == pytest.approx(1.0, abs=2e-4)
    total = doc["total"]
    assert total["kl"] == 0.0 and total["top1_agreement"] == 1.0

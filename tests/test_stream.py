"""Expert streaming: the cache policies, and streamed generation bit-identical to resident at every budget, with
every combination of workers, fan-out and policy; the budget holds; a model that changes under a session gives one
clear error."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from conftest import converted, shipped_demo
from model_helpers import OnDemand, expert_bytes, logits_and_tokens, takes_o_direct
from tqbench.demo import SHIPPED_SPEC
from tqbench.runtime.load import load
from tqbench.stream import StoreError, StreamConfig
from tqbench.stream.cache import SlotCache
from tqbench.stream.policies import LRFU, LRU
from tqbench.stream.store import ExpertStore
from tqbench.stream.pagein import read_buffers, staging_bytes

# ---- policies (pure bookkeeping) --------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_unlocked_key():
    c = SlotCache(3, "lru")
    for t, k in enumerate("abc"):
        c.place(k, t, set())
    assert c.lookup("a", 3) is not None  # a is now the most recent
    slot_b = c.slots["b"]
    slot, evicted = c.place("d", 4, set())
    assert (evicted, slot) == ("b", slot_b)
    _, evicted = c.place("e", 5, {"c"})  # c is locked: the next least recent is a
    assert evicted == "a" and set(c.slots) == {"c", "d", "e"}
    c.pin(["c"])
    _, evicted = c.place("f", 6, set())
    assert evicted == "d" and "c" in c  # pinned never goes
    assert c.evictions == 3


def test_lrfu_keeps_frequent_keys_and_their_history():
    c = SlotCache(2, "lrfu")
    c.place("hot", 0, set())
    for t in range(1, 6):
        c.lookup("hot", t)
    c.place("x", 6, set())
    _, evicted = c.place("y", 7, set())  # hot has C ~ 6, x has C = 1
    assert evicted == "x"
    _, evicted = c.place("z", 8, {"y"})  # hot is the only unlocked key: it goes
    assert evicted == "hot"
    _, evicted = c.place("hot", 9, {"z"})  # comes back; y (C = 1) goes
    assert evicted == "y"
    _, evicted = c.place("w", 10, set())  # hot came back with its history: z (C = 1) goes, not hot
    assert evicted == "z"


def test_lrfu_value_matches_its_definition():
    """C(t) = sum of 2^(-lam * (t - t_i)) over accesses t_i, computed directly."""
    p = LRFU(lam=0.3)
    times = [0, 1, 5, 6, 9]
    for t in times:
        p.touch("k", t)
    log_c, t_last = p._state["k"]
    assert t_last == 9
    assert 2 ** log_c == pytest.approx(sum(2 ** (-0.3 * (9 - t)) for t in times), rel=1e-12)


def test_lrfu_beats_lru_on_a_skewed_trace_and_never_loses_locked_keys():
    random.seed(1)
    rates = {}
    for policy in ("lru", "lrfu"):
        random.seed(1)
        c, hits, n = SlotCache(20, policy), 0, 0
        for t in range(400):
            for layer in range(7):
                ks = set(random.choices(range(64), weights=[1 / (i + 1) for i in range(64)], k=4))
                locked = {(layer, e) for e in ks if c.lookup((layer, e), t) is not None}
                hits += len(locked)
                n += len(ks)
                for e in ks - {e for _, e in locked}:
                    _, evicted = c.place((layer, e), t, locked)
                    assert evicted not in locked
                    locked.add((layer, e))
                assert all(k in c for k in locked)
        rates[policy] = hits / n
    assert rates["lrfu"] > 0.2 > 0.05 > rates["lru"]


def test_policies_validate():
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        SlotCache(2, "fifo")
    with pytest.raises(ValueError, match="at least one slot"):
        SlotCache(0)
    assert isinstance(SlotCache(1, "lru").policy, LRU)


# ---- streamed == resident --------------------------------------------------------------------------------------------

PROMPT = [4352, 100, 517, 2300, 42, 7, 1311, 260, 9, 88, 1000, 61]
# Ternary gate/up and 4-bit down experts, all TurboQuant. g32, not the first demo's g64: the shipped demo's experts are
# 32 wide (moe_intermediate_size), so at g64 the down projection (input 32) is kept as the source's mxfp4 ("in % 64 !=
# 0"), down4 would not apply and the model would not have TurboQuant-MLX's stacked layout.
RECIPE = "tq3a-tqTe-down4-g32"

# The shipped demo's routing: experts per MoE layer, top-k, MoE layers (layers 1..L).
E, K = SHIPPED_SPEC.num_experts, SHIPPED_SPEC.num_experts_per_token
L = sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers))


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The shipped demo's conversions (RECIPE, affine4, src), shared with other modules (read-only: a test that
    changes one copies it); each converted when a test first asks for it."""
    return OnDemand(converted)


@pytest.fixture(scope="module")
def expert(models) -> int:
    """One routed expert's bytes in the RECIPE conversion, as its expert map says (every MoE layer alike)."""
    return expert_bytes(models[RECIPE])


def _run(model, n: int = 10) -> tuple[np.ndarray, list[int]]:
    return logits_and_tokens(model, PROMPT, n)


@pytest.fixture(scope="module")
def resident(models) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Each model's logits and tokens, resident (computed when a test first asks for that model's)."""
    return OnDemand(lambda name: _run(load(models[name]).model))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [RECIPE, "affine4", "src"])
@pytest.mark.parametrize("slots, workers, fanout, policy, page_cache", [
    (10_000, 4, False, "lrfu", "on"),  # everything fits
    (K * L * 10 // 7, 1, True, "lru", "off"),  # ~1.4 tokens' worth (40 at top-4); O_DIRECT reads of aligned supersets
    (12, 4, True, "lrfu", "off"),
    (12, 3, True, "lrfu", "on"),
    (2, 2, False, "lru", "auto"),  # fewer slots than one layer's K active experts: chunked
    (1, 1, False, "lrfu", "off"),
])
def test_streamed_generation_is_bit_identical_to_resident(models, resident, recipe, slots, workers, fanout, policy,
                                                         page_cache):
    path = models[recipe]
    from tqbench.stream.budget import model_bytes
    from tqbench.stream.store import ALIGN

    expert = model_bytes(path).one_expert
    budget = staging_bytes(expert + (2 * ALIGN if page_cache == "off" else 0), workers) + slots * expert
    loaded = load(path, streaming=StreamConfig(budget_bytes=budget, workers=workers, policy=policy, fanout=fanout,
                                               page_cache=page_cache))
    assert loaded.streamer.direct == (page_cache == "off" and takes_o_direct(next(path.glob("*.safetensors"))))
    st = loaded.streamer.stats
    assert st.slots == min(slots, L * E)
    logits, tokens = _run(loaded.model)
    want_logits, want_tokens = resident[recipe]
    np.testing.assert_array_equal(logits, want_logits)
    assert tokens == want_tokens
    assert st.cache_bytes_max + st.staging_bytes <= budget  # nothing held outside the budget
    assert st.cache_bytes_max <= st.slots * expert
    assert st.misses > 0 and st.critical_bytes == st.misses * expert
    assert st.reads >= st.misses and (fanout or st.reads == st.misses)
    if slots >= 10_000:
        assert st.evictions == 0 and st.hits > 0
    loaded.streamer.close()


def test_evictions_do_not_depend_on_which_read_finishes_first(models, expert):
    """With several read workers the reads complete in any order; slots are chosen before they start, in expert
    order, so two runs serve every routing the same way and end with the same experts in the same slots."""
    runs = []
    for _ in range(3):
        loaded = load(models[RECIPE], streaming=StreamConfig(budget_bytes=staging_bytes(expert, 4) + 24 * expert,
                                                             workers=4, policy="lru"))
        _run(loaded.model)
        st = loaded.streamer
        runs.append(([(e.layer, e.experts, e.served) for e in st.drain()],
                     [dict(p.cache.slots) for p in st.pools], st.stats.evictions))
        st.close()
    assert runs[0][2] > 0  # the budget made it evict
    assert runs[1] == runs[0] and runs[2] == runs[0]


@pytest.mark.parametrize("page_cache", ["on", "off"])
def test_reads_in_flight_caps_concurrent_reads_and_changes_no_output(models, resident, expert, page_cache):
    """Four workers, one read at a time: the reads never overlap (counted around the store's own read functions),
    the copies still run on the workers, and the tokens and logits are the resident model's."""
    import threading

    from tqbench.stream.store import ALIGN

    workers = 4
    budget = staging_bytes(expert + 2 * ALIGN, workers) + 12 * expert
    loaded = load(models[RECIPE], streaming=StreamConfig(budget_bytes=budget, workers=workers, page_cache=page_cache,
                                                         reads_in_flight=1))
    store = loaded.streamer.store
    lock, now, most, calls = threading.Lock(), [0], [0], [0]

    def counted(fn):
        def run(*args):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
                calls[0] += 1
            try:
                return fn(*args)
            finally:
                with lock:
                    now[0] -= 1
        return run

    for name in ("read", "read_direct", "read_run"):
        setattr(store, name, counted(getattr(store, name)))
    logits, tokens = _run(loaded.model)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1]
    assert calls[0] >= loaded.streamer.stats.misses > 0 and most[0] == 1
    loaded.streamer.close()


def test_page_in_events_account_for_every_routed_expert(models):
    loaded = load(models[RECIPE], streaming=StreamConfig(budget_bytes=10**7, workers=2))
    loaded.model(mx.array([PROMPT[:1]]))
    loaded.model(mx.array([PROMPT[1:2]]))
    events = loaded.streamer.drain()
    assert [e.token for e in events] == [1] * L + [2] * L and [e.layer for e in events[:L]] == list(range(1, L + 1))
    assert all(len(e.experts) == K and len(e.served) == K for e in events)  # one token, top-K
    assert all(k == "miss" for k in events[0].served)  # a cold cache
    st = loaded.streamer.stats
    assert st.misses == sum(k == "miss" for e in events for k in e.served)
    assert st.hits == sum(k != "miss" for e in events for k in e.served)
    assert sum(e.bytes_read for e in events) == st.critical_bytes
    loaded.streamer.close()


def test_page_in_timing_totals_are_present_and_consistent(models, expert):
    """The miss_* totals (where the demand page-ins' time went): a preload adds none, every miss of a run without
    look-ahead is timed, each total is >= 0, the reads took time, and the parts fit in the windows they lie in."""
    import time

    from tqbench.stream.stats import MISS_TIMES

    workers = 2
    loaded = load(models[RECIPE],
                  streaming=StreamConfig(budget_bytes=staging_bytes(expert, workers) + 12 * expert, workers=workers))
    s = loaded.streamer
    st = s.stats
    assert s.preload([(1, e) for e in range(4)], 0.5) > 0 and st.preload_bytes > 0
    assert all(getattr(st, k) == 0 for k in MISS_TIMES)  # a preload's page-ins are not misses
    t0 = time.perf_counter()
    _run(loaded.model)
    wall = time.perf_counter() - t0
    d = st.to_dict()
    assert all(k in d and d[k] >= 0 for k in MISS_TIMES)
    assert st.misses > 0 and st.miss_timed == st.misses and st.miss_read_s > 0
    eps = 1e-6
    # the page-ins' wall time (before the first read + reading + after the last) lies inside the stall
    page_ins = st.miss_before_reads_s + st.miss_reading_s + st.miss_after_reads_s
    assert page_ins <= st.stall_s + eps and st.stall_s <= wall
    assert st.miss_to_host_s <= st.miss_reading_s + st.miss_after_reads_s + eps  # asked once the reads are submitted
    # each read lies in its page-in's reading window; an expert's copy (by the worker that read it) and to_gpu (on the
    # engine thread) come after its read and end before its page-in returns; the `workers` threads run at most
    # `workers` reads and copies at once
    assert st.miss_to_gpu_s <= st.miss_reading_s + st.miss_after_reads_s + eps
    assert st.miss_read_s <= workers * st.miss_reading_s + eps
    assert st.miss_read_s + st.miss_copy_s <= workers * (st.miss_reading_s + st.miss_after_reads_s) + eps
    # every queued or running read holds a staging buffer, and so does every running copy: at most read_buffers at once
    buffers = read_buffers(workers)
    assert st.miss_queue_s + st.miss_read_s <= buffers * st.miss_reading_s + eps
    held = st.miss_queue_s + st.miss_read_s + st.miss_copy_s
    assert held <= buffers * (st.miss_reading_s + st.miss_after_reads_s) + eps
    assert held / buffers + st.miss_to_host_s <= wall
    assert (st.miss_read_s + st.miss_copy_s) / workers + st.miss_to_host_s <= wall
    s.close()


@pytest.mark.parametrize("fanout, page_cache, lookahead", [(False, "on", False), (True, "off", True)])
def test_slot_copies_run_on_the_workers_and_the_gpu_prefetch_on_the_engine_thread(models, resident, expert, monkeypatch,
                                                                                   fanout, page_cache, lookahead):
    """Each expert's copy into its slot is made by a read worker (after its last read, with fan-out after its last
    piece); the slot's GPU prefetch (a CUDA call) stays on the engine thread; the result is still exact."""
    import threading

    from tqbench.stream.pool import Pool

    seen: dict[str, set] = {"copy_in": set(), "to_gpu": set(), "to_host": set()}
    order: list[tuple] = []  # (call, pool, slot) in call order
    for name in seen:
        def spy(self, slot, *args, _name=name, _f=getattr(Pool, name)):
            seen[_name].add(threading.current_thread().name)
            order.append((_name, id(self), slot))
            return _f(self, slot, *args)
        monkeypatch.setattr(Pool, name, spy)
    budget = staging_bytes(expert + 8192, 2) + 12 * expert
    loaded = load(models[RECIPE], streaming=StreamConfig(budget_bytes=budget, workers=2, policy="lrfu", fanout=fanout,
                                                         page_cache=page_cache, lookahead=lookahead))
    logits, tokens = _run(loaded.model, 6)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1][:6]
    assert seen["copy_in"] and all(n.startswith("tqbench-read") for n in seen["copy_in"])
    assert seen["to_gpu"] == seen["to_host"] == {threading.current_thread().name}
    if not lookahead:  # (look-ahead reads skip to_host) per slot and page-in: to_host (asked once the reads are
        # submitted, so a fast read's copy may come first) and the copy, then to_gpu
        per_slot: dict[tuple, list[str]] = {}
        for call, pool, slot in order:
            per_slot.setdefault((pool, slot), []).append(call)
        assert per_slot
        for calls in per_slot.values():
            groups = [calls[i:i + 3] for i in range(0, len(calls), 3)]
            assert all(sorted(g[:2]) == ["copy_in", "to_host"] and g[2] == "to_gpu" for g in groups), calls
    assert not lookahead or loaded.streamer.stats.lookahead_used > 0
    loaded.streamer.close()


def test_a_budget_below_one_expert_is_refused(models, expert):
    assert read_buffers(2) == 4  # two staging buffers per read worker
    staging = staging_bytes(expert, 2)
    with pytest.raises(StoreError, match=rf"cannot hold one expert \({expert:,} bytes\) plus 4 read buffers "
                                         rf"\({staging:,} bytes\)"):
        load(models[RECIPE], streaming=StreamConfig(budget_bytes=staging + expert - 1, workers=2))
    load(models[RECIPE], streaming=StreamConfig(budget_bytes=staging + expert, workers=2)).streamer.close()  # one slot


def test_a_model_that_changes_under_the_session_gives_one_clear_error(models, expert, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(models[RECIPE], path)
    loaded = load(path, streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + expert, workers=2))  # one slot
    loaded.model(mx.array([PROMPT[:2]]))
    shard = next(path.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(StoreError, match=r"model-00001-of-00001.safetensors: expert \d+ of layer \d+: read \d+ of "
                                         rf"{expert} bytes .* it changed under the session") as err:
        for _ in range(40):  # until a page-in reaches past the cut
            mx.eval(loaded.model(mx.array([PROMPT[:3]])))
    # the expert whose read failed is not left resident with whatever its slot held, and no slot is lost
    e, layer = map(int, re.search(r"expert (\d+) of layer (\d+)", str(err.value)).groups())
    st = loaded.streamer
    assert (layer, e) not in st.pool_of[layer].cache
    assert sum(len(p.cache.free) + len(p.cache) for p in st.pools) == st.stats.slots
    loaded.streamer.close()


def test_a_dropped_placement_frees_its_slot_and_history():
    c = SlotCache(2, "lru")
    c.place("a", 1, set())
    s, _ = c.place("b", 2, set())
    c.drop("b")
    assert "b" not in c and s in c.free and len(c) == 1
    assert c.place("c", 3, set()) == (s, None)  # the freed slot, nothing evicted
    c.drop("zzz")  # unknown: nothing happens
    assert len(c) == 2


def test_max_active_experts_routes_to_k_and_native_is_unchanged(models, resident):
    from tqbench.errors import TqbenchError
    from tqbench.runtime.routing import set_active_experts

    path = models[RECIPE]
    loaded = load(path, streaming=StreamConfig(budget_bytes=10**7, workers=2))
    assert set_active_experts(loaded.model, 0).active == K
    assert set_active_experts(loaded.model, K).layers == 0
    logits, _ = _run(loaded.model, 1)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])  # native: the same model
    ae = set_active_experts(loaded.model, 2)
    assert (ae.native, ae.active, ae.layers, ae.cut) == (K, 2, L, K / 2)
    loaded.streamer.drain()
    cut = np.array(loaded.model(mx.array([PROMPT[:1]])).astype(mx.float32))
    events = loaded.streamer.drain()
    assert len(events) == L and all(len(e.experts) == 2 for e in events)  # one token, two experts per layer
    assert np.abs(cut[0, -1] - logits[0, 0]).max() > 0  # a different model
    with pytest.raises(TqbenchError, match=rf"--max-active-experts {K + 1}: choose 1..{K}"):
        set_active_experts(loaded.model, K + 1)
    loaded.streamer.close()


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_prefill_entries_are_evicted_before_the_decode_working_set(policy):
    c = SlotCache(4, policy)
    for t in range(3):  # decode: a and b in use
        for k in "ab":
            if c.lookup(k, t) is None:
                c.place(k, t, set())
    c.place("p1", 3, set(), cold=True)  # a prefill's experts
    c.place("p2", 3, set(), cold=True)
    assert c.lookup("a", 3, touch=False) is not None
    _, evicted = c.place("d", 4, set())  # the next decode miss evicts a prefill entry, not a or b
    assert evicted in {"p1", "p2"}
    _, evicted = c.place("e", 5, set())
    assert evicted in {"p1", "p2"} and {"a", "b", "d", "e"} == set(c.slots)


# A slot's widest array in RECIPE: the down projection's 4-bit codes, latent x moe_intermediate / 2 bytes per expert
# ((64, 4) uint32 = 1,024 bytes in the shipped demo).
WIDEST = SHIPPED_SPEC.routed_expert_hidden_size * SHIPPED_SPEC.moe_intermediate_size // 2


@pytest.mark.parametrize("max_array", [1 << 30, WIDEST * 20, WIDEST * 7])  # 1 pool; 3 pools; one pool per layer
def test_pools_split_under_the_array_limit_and_stay_bit_identical(models, resident, expert, max_array):
    path = models[RECIPE]
    loaded = load(path, streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + 60 * expert, workers=2,
                                               max_array_bytes=max_array))
    s = loaded.streamer
    pools = s.pools
    assert max(p.nbytes for p in s.store.layers[1].parts) == WIDEST
    assert all(p.slots * WIDEST <= max_array for p in pools)
    assert len(pools) == {1 << 30: 1, WIDEST * 20: 3, WIDEST * 7: L}[max_array]
    assert sorted(s.pool_of) == list(range(1, L + 1)) and len({id(s.pool_of[n]) for n in s.pool_of}) == len(pools)
    assert sum(p.slots for p in pools) <= 60
    logits, tokens = _run(loaded.model)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1]
    s.close()


@pytest.mark.slow
@pytest.mark.parametrize("slots", [3])  # fewer slots than a layer's experts: evictions and re-reads
def test_a_source_checkpoint_streams_its_per_expert_tensors(models, slots):
    """The demo as published (compressed-tensors mxfp4, one tensor per expert and projection): each expert is six
    extents, mxfp4 `weight_packed` read as MLX's uint32 weight, and the output is the resident source's."""
    src = shipped_demo()  # the demo as published: a copy shared by the test session (read-only)
    store = ExpertStore.open(src)
    lay = store.layers[1]
    assert lay.experts == E and len(lay.extents[7]) == 6
    weight = next(p for p in lay.parts if (p.projection, p.param) == ("gate_proj", "weight"))
    assert weight.dtype == "U32" and weight.nbytes == weight.shape[0] * weight.shape[1] * 4
    assert lay.nbytes == sum(p.nbytes for p in lay.parts)
    store.close()
    want_logits, want_tokens = _run(load(src).model)
    loaded = load(src, streaming=StreamConfig(budget_bytes=staging_bytes(lay.nbytes, 2) + slots * lay.nbytes, workers=2,
                                              policy="lrfu"))
    logits, tokens = _run(loaded.model)
    np.testing.assert_array_equal(logits, want_logits)
    assert tokens == want_tokens and loaded.streamer.stats.misses > 0
    loaded.streamer.close()


@pytest.mark.slow
@pytest.mark.parametrize("slots, fanout", [(10_000, False), (3, True), (1, False)])
def test_a_stacked_layout_streams_bit_identically(models, resident, expert, tmp_path, slots, fanout):
    """TurboQuant-MLX's stacked layout (experts as slices of `switch_mlp` tensors, no expert map): one extent per
    tensor per expert, the same slots and the same logits."""
    from test_runtime_tqmlx import to_turboquant_mlx

    theirs = to_turboquant_mlx(models[RECIPE], tmp_path / "tqmlx")
    store = ExpertStore.open(theirs)
    assert sorted(store.layers) == list(range(1, L + 1))
    lay = store.layers[1]
    # an expert as many bytes as in tqbench's layout
    assert lay.experts == E and lay.nbytes == expert and len(lay.extents[5]) == 6  # weight + scales per projection
    assert {(p.projection, p.param) for p in lay.parts} == {(j, q) for j in ("gate_proj", "up_proj", "down_proj")
                                                           for q in ("weight", "scales")}
    store.close()
    loaded = load(theirs, streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + slots * expert, workers=2,
                                                 policy="lrfu", fanout=fanout))
    logits, tokens = _run(loaded.model)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1]
    st = loaded.streamer.stats
    # six ranges per expert in this layout; adjacent missed experts share one scatter read per tensor (the prefill
    # misses many neighbours at once), except with fan-out, which splits instead
    assert st.reads <= 6 * st.misses if not fanout else st.reads >= 6 * st.misses
    if slots == 10_000:
        assert st.reads < 6 * st.misses
    # a run read equals the experts read one by one
    store = loaded.streamer.store
    one = [np.zeros(expert, np.uint8) for _ in range(3)]
    run = [np.zeros(expert, np.uint8) for _ in range(3)]
    for e, b in zip((10, 11, 12), one):
        assert store.read(1, e, b) == 6
    assert store.read_run(1, [10, 11, 12], run) == 6
    assert all(np.array_equal(a, b) for a, b in zip(one, run)) and one[0].any()
    loaded.streamer.close()


@pytest.mark.parametrize("workers, fanout", [(4, False), (2, True)])
def test_lookahead_is_bit_identical_and_counted_honestly(models, resident, expert, workers, fanout):
    """Look-ahead reads layer L+1's likely experts (its router on layer L's input) during decode; a routed expert
    whose read was done in time is "prefetched", its bytes speculative; an unused read is speculative too."""
    path = models[RECIPE]
    runs = {}
    for lookahead in (False, True):
        budget = staging_bytes(expert, workers) + 60 * expert
        loaded = load(path, streaming=StreamConfig(budget_bytes=budget, workers=workers, policy="lrfu", fanout=fanout,
                                                   lookahead=lookahead))
        logits, tokens = _run(loaded.model, 16)
        np.testing.assert_array_equal(logits, resident[RECIPE][0])
        want = resident[RECIPE][1]  # 10 greedy tokens
        assert len(tokens) == 16 and tokens[:len(want)] == want
        runs[lookahead] = loaded.streamer.stats
        events = loaded.streamer.drain()
        st = runs[lookahead]
        assert st.hits_prefetched == sum(k == "prefetched" for e in events for k in e.served)
        assert st.hits + st.misses == sum(len(e.experts) for e in events)
        loaded.streamer.close()
    off, on = runs[False], runs[True]
    assert off.lookahead_reads == off.hits_prefetched == off.speculative_bytes == 0
    assert 0 < on.hits_prefetched <= on.lookahead_used <= on.lookahead_reads
    # every expert read counts once, on the critical path or as speculative: a look-ahead read that was still running
    # when its layer needed it is a miss (critical) and is not read again
    late = on.lookahead_used - on.hits_prefetched
    assert on.critical_bytes + on.speculative_bytes == (on.misses - late + on.lookahead_reads) * expert
    assert on.critical_bytes == on.misses * expert
    assert on.critical_bytes < off.critical_bytes  # it took reads off the critical path


def test_lookahead_with_fewer_slots_than_one_tokens_experts_stays_exact(models, resident, expert):
    loaded = load(models[RECIPE],
                  streaming=StreamConfig(budget_bytes=staging_bytes(expert, 4) + 3 * expert, workers=4, lookahead=True))
    logits, tokens = _run(loaded.model, 8)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1][:8]
    loaded.streamer.close()


@pytest.mark.parametrize("max_slots", [1024, 25])  # one pool; one per 25 slots of the 60 (three pools)
def test_pools_split_under_the_slot_limit_and_stay_bit_identical(models, resident, expert, max_slots):
    """No pool holds more than StreamConfig.max_pool_slots slots (MLX's CUDA gather_mm takes at most 1,024
    matrices: a pool of more is more than one float SwitchLinear's gather can take)."""
    loaded = load(models[RECIPE], streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + 60 * expert, workers=2,
                                                         max_pool_slots=max_slots))
    pools = loaded.streamer.pools
    assert len(pools) == {1024: 1, 25: 3}[max_slots] and all(p.slots <= max_slots for p in pools)
    assert 58 <= sum(p.slots for p in pools) <= 60  # whole slots per pool, in proportion to its layers
    logits, tokens = _run(loaded.model)
    np.testing.assert_array_equal(logits, resident[RECIPE][0])
    assert tokens == resident[RECIPE][1]
    loaded.streamer.close()


def test_a_prompt_of_more_routings_than_gather_mm_takes_streams_like_resident(models, expert, monkeypatch):
    """140 tokens at top-8 (1,120 routings) with 1,217 slots (the demo's at a 4 MB budget): on CUDA this prompt
    failed ("[gather_mm] Group count can not be larger than 1024"). Every gather_mm now takes at most 1,024 matrices,
    and the streamed logits and tokens are resident's."""
    from tqbench.runtime import codebook

    prompt = mx.array([[4352] + [(7 * i) % 4000 + 100 for i in range(139)]])
    resident_model = load(models[RECIPE]).model
    want = np.array(resident_model(prompt).astype(mx.float32))
    want_tokens = [int(t) for t, _ in zip((t for t, _ in generate_step(prompt[0], resident_model, max_tokens=3)),
                                          range(3))]
    calls = []
    real = mx.gather_mm

    def spy(a, b, *args, **kw):
        calls.append(int(np.prod(b.shape[:-2])))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(mx, "gather_mm", spy)
    assert codebook.GATHER_MAX_GROUPS == 1024
    loaded = load(models[RECIPE],
                  streaming=StreamConfig(budget_bytes=staging_bytes(expert, 4) + 1217 * expert, workers=4))
    assert len(loaded.streamer.pools) == 2 and max(p.slots for p in loaded.streamer.pools) <= 1024  # was one pool
    np.testing.assert_array_equal(np.array(loaded.model(prompt).astype(mx.float32)), want)
    model = loaded.model
    assert [int(t) for t, _ in zip((t for t, _ in generate_step(prompt[0], model, max_tokens=3)), range(3))] == \
        want_tokens
    assert calls and max(calls) <= 1024
    loaded.streamer.close()

"""The `lrfu-next` replacement policy (tqbench/stream/policies.py: NextLRFU) on hand-computed traces: what it learns from
decode touches, the prediction it makes, the victim it picks (against a brute-force minimum), the halving that keeps
its uint16 counts from overflowing; and benchmarks/policies.py's budgets and gap figures."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script
from tqbench.stream.cache import SlotCache
from tqbench.stream.policies import DEFAULT_POLICY, LRFU, POLICIES, NextLRFU

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "policies.py"


def _history(policy) -> None:
    """Layer 0 routes {1} at tick 1, {2} at tick 2, {1} at tick 3; layer 1 routes {4} at tick 3."""
    policy.touch((0, 1), 1)
    policy.touch((0, 2), 2)
    policy.touch((0, 1), 3)
    policy.touch((1, 4), 3)


def test_it_counts_which_expert_followed_which_and_predicts_from_the_latest_routing():
    p = NextLRFU(lam=0.0, beta=1.0, mu=0.0)
    _history(p)
    st = p._layers[0]
    assert st.counts[1, 2] == 1 and st.counts[2, 1] == 1  # 2 followed 1 (ticks 1 -> 2), 1 followed 2 (2 -> 3)
    assert int(st.counts.sum()) == 2
    assert st.uses[1] == 2 and st.uses[2] == 1
    # layer 0's latest routing is {1}: e2 followed 1 at one of its 2 ticks, e1 never followed 1
    assert p.predicted((0, 2)) == 0.5
    assert p.predicted((0, 1)) == 0.0
    assert p.predicted((1, 4)) == 0.0  # layer 1 has one tick: nothing followed yet
    assert p.predicted((2, 0)) == 0.0 and p.predicted("k") == 0.0  # unseen layer, not a (layer, expert) key
    p.touch((0, 3), 5)  # tick 5 does not follow tick 3: no count
    assert st.counts[1, 3] == 0 and st.uses[3] == 1
    assert p.predicted((0, 1)) == 0.0 and p.predicted((0, 2)) == 0.0  # latest routing {3}: nothing followed it


def test_the_victim_has_the_smallest_recency_frequency_plus_prediction():
    # lam = 1: at tick 3, C(0,1) = 2^-2 + 1 = 1.25, C(0,2) = 2^-1 = 0.5, C(1,4) = 1; p(0,2) = 0.5, the others 0
    for beta, want in ((0.8, (0, 2)), (1.2, (1, 4))):  # V(0,2) = 0.5 + 0.5 beta: 0.9 < 1, 1.1 > 1
        p = NextLRFU(lam=1.0, beta=beta, mu=0.0)
        _history(p)
        assert p.victim(set(), now=3) == want
    # LRFU alone takes (0,2), the smallest C
    lrfu = LRFU(lam=1.0)
    _history(lrfu)
    assert lrfu.victim(set()) == (0, 2)
    # at tick 4 every C halves: V(0,2) = 0.25 + 0.6 = 0.85, V(1,4) = 0.5, V(0,1) = 0.625
    p = NextLRFU(lam=1.0, beta=1.2, mu=0.0)
    _history(p)
    assert p.victim(set(), now=4) == (1, 4)
    assert p.victim({(1, 4)}, now=4) == (0, 1)
    # lam = 0 (C counts accesses): C(0,1) = 2, C(0,2) = 1 + beta/2, C(1,4) = 1
    p = NextLRFU(lam=0.0, beta=4.0, mu=0.0)
    _history(p)
    assert p.victim({(1, 4)}, now=3) == (0, 1)  # V(0,2) = 3 > V(0,1) = 2: the prediction keeps (0,2)
    assert p.victim({(1, 4), (0, 1)}, now=3) == (0, 2)
    assert p.victim({(1, 4), (0, 1), (0, 2)}, now=3) is None


def test_the_slow_value_keeps_what_was_often_routed():
    """lam = 1, lam_slow = 0 (C_slow counts accesses): (0,1) routed at ticks 1..4, (1,2) at tick 9. At tick 10
    C(0,1) = 2^-6 + 2^-7 + 2^-8 + 2^-9 = 15/512, C(1,2) = 1/2; C_slow = 4 and 1."""
    for mu, want in ((0.25, (1, 2)), (0.1, (0, 1))):  # V(0,1) = 15/512 + 4 mu, V(1,2) = 1/2 + mu
        p = NextLRFU(lam=1.0, beta=0.0, lam_slow=0.0, mu=mu)
        for t in range(1, 5):
            p.touch((0, 1), t)
        p.touch((1, 2), 9)
        assert p.value((0, 1), 10) == pytest.approx(15 / 512 + 4 * mu, rel=1e-12)
        assert p.value((1, 2), 10) == pytest.approx(0.5 + mu, rel=1e-12)
        assert p.victim(set(), now=10) == want
    assert NextLRFU(lam=0.02, lam_slow=0.001).mu == pytest.approx(0.05)  # the default weighs both scales alike
    lrfu = LRFU(lam=1.0)
    for t in range(1, 5):
        lrfu.touch((0, 1), t)
    lrfu.touch((1, 2), 9)
    assert lrfu.victim(set()) == (0, 1)


def test_halving_keeps_counts_within_uses(monkeypatch):
    monkeypatch.setattr(NextLRFU, "HALVE_AT", 4)
    p = NextLRFU()
    for t in range(1, 5):  # layer 0 routes {1, 2} at ticks 1..4
        p.touch((0, 1), t)
        p.touch((0, 2), t)
    st = p._layers[0]
    # at tick 4: (0,1) counts 1<-1 and 1<-2 up to 3, uses[1] reaches 4: row 1 halves (1<-1: 3 -> 1, 2<-1: 2 -> 1),
    # uses[1] -> 2; then (0,2): 2<-1 -> 2, 2<-2 -> 3, uses[2] reaches 4: row 2 halves (1<-2: 3 -> 1, 2<-2: 3 -> 1)
    assert st.counts[1, 1] == 1 and st.counts[1, 2] == 2 and st.counts[2, 1] == 1 and st.counts[2, 2] == 1
    assert st.uses[1] == 2 and st.uses[2] == 2
    assert p.predicted((0, 1)) == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert p.predicted((0, 2)) == pytest.approx((2 / 2 + 1 / 2) / 2)


def test_cold_keys_go_first_and_teach_nothing():
    c = SlotCache(3, "lrfu-next")
    c.place((0, 1), 1, set())
    c.place((0, 2), 2, set())
    p = c.policy
    assert p._layers[0].counts[1, 2] == 1
    c.place((0, 3), 3, set(), cold=True)  # a prefill's expert
    assert p._layers[0].tick == 2 and p._layers[0].uses[3] == 0  # not learned
    assert c.lookup((0, 1), 4) is not None
    slot3 = c.slots[(0, 3)]
    assert c.place((0, 7), 4, {(0, 1)}) == (slot3, (0, 3))  # the cold key goes first


def test_a_prefill_that_locks_every_slot_is_refused_as_with_the_other_policies():
    c = SlotCache(2, "lrfu-next")
    c.place((3, 500), 1, set(), cold=True)  # experts no decode touch has shown yet
    c.place((3, 501), 1, {(3, 500)}, cold=True)
    with pytest.raises(RuntimeError, match="every slot is locked"):
        c.place((3, 502), 1, {(3, 500), (3, 501)}, cold=True)
    assert c.place((3, 502), 1, {(3, 501)}, cold=True) == (c.slots.get((3, 502)), (3, 500))
    assert set(c.slots) == {(3, 501), (3, 502)}
    assert c.lookup((3, 501), 2) is not None  # a decode hit: warm now
    assert c.place((1, 7), 2, {(3, 501)})[1] == (3, 502)


@pytest.mark.parametrize("slots, experts", [(12, 16), (150, 90)])  # 150: more rows than the 64 it starts with
def test_lrfu_next_in_a_slot_cache_keeps_locked_and_pinned_keys_and_matches_a_brute_force_minimum(slots, experts):
    rng = random.Random(3)
    c = SlotCache(slots, "lrfu-next")
    c.policy = NextLRFU(lam=0.37, beta=3.0, lam_slow=0.05, mu=0.2)
    c.place((0, 0), 0, set())
    c.pin([(0, 0)])
    checked = 0
    for t in range(1, 400):
        for layer in range(3):
            es = sorted(set(rng.choices(range(experts), weights=[1 / (i + 1) for i in range(experts)], k=3)))
            locked = {(layer, e) for e in es if c.lookup((layer, e), t) is not None}
            for e in es:
                if (layer, e) in locked:
                    continue
                full = len(c) == c.capacity
                if full:  # every unlocked, unpinned resident's value, from the policy's state
                    p = c.policy
                    values = {k: 2 ** (p._state[k][0] - p.lam * (t - p._state[k][1]))
                              + p.mu * 2 ** (p._slow[k] - p.lam_slow * (t - p._state[k][1])) + p.beta * p.predicted(k)
                              for k in c.slots if k not in locked and k not in c.pinned}
                    best = min(values.values())
                slot, evicted = c.place((layer, e), t, locked)
                if full:
                    assert evicted not in locked and evicted != (0, 0)
                    assert values[evicted] == pytest.approx(best, rel=1e-12)
                    checked += 1
                else:
                    assert evicted is None
                assert c.slots[(layer, e)] == slot
                locked.add((layer, e))
            assert all(k in c for k in locked) and (0, 0) in c
    assert checked > 300


def _trace(seed: int, layers: int = 4, experts: int = 40, k: int = 6, tokens: int = 200):
    rng = random.Random(seed)
    return [[(layer, sorted(set(rng.choices(range(experts), weights=[1 / (i + 1) for i in range(experts)], k=k))))
             for layer in range(layers)] for _ in range(tokens)]


def _drive(cache: SlotCache, trace, batched: bool) -> list:
    """The streamer's use of a cache per layer call: look the routed experts up, then place the misses, one at a time
    or together; returns the slots given, in order."""
    given = []
    for t, token in enumerate(trace, 1):
        for layer, es in token:
            keys = [(layer, e) for e in es]
            if batched:
                found = cache.lookup_many(keys, t)
            else:
                found = [cache.lookup(k, t) for k in keys]
            locked = {k for k, s in zip(keys, found) if s is not None}
            missing = [k for k, s in zip(keys, found) if s is None]
            if batched:
                given += cache.place_many(missing, t, locked)
            else:
                for key in missing:
                    given.append(cache.place(key, t, locked)[0])
                    locked.add(key)
    return given


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_placing_a_layers_misses_together_is_placing_them_one_by_one_for_lru_and_lrfu(policy):
    trace = _trace(7)
    one, many = SlotCache(30, policy), SlotCache(30, policy)
    assert _drive(one, trace, False) == _drive(many, trace, True)
    assert one.slots == many.slots and one.evictions == many.evictions > 1000


def test_lrfu_next_chooses_a_layers_victims_in_one_pass_as_its_one_by_one_minimum_would():
    """victims(count) = `count` calls of victim(), each removing its key, with nothing touched in between; brute force
    over the policy's own values, including ties (lam = 0 and beta = 0: equal values, the least recently touched)."""
    for beta, lam in ((3.0, 0.37), (0.0, 0.0)):
        c = SlotCache(25, "lrfu-next")
        c.policy = NextLRFU(lam=lam, beta=beta, lam_slow=0.05, mu=0.2)
        trace = _trace(11, tokens=60)
        _drive(c, trace, True)
        p, t = c.policy, len(trace)
        locked = set(list(c.slots)[:5])
        got = p.victims(locked, 8, t)
        values = {k: p.value(k, t) for k in c.slots if k not in locked}
        order = sorted(values, key=lambda k: (values[k], p._last[p._row[k]]))
        assert got == order[:8]
        assert p.victims(set(c.slots), 3, t) == []  # everything locked: none


def test_lrfu_next_touching_together_learns_and_values_as_touching_one_by_one():
    one, many = NextLRFU(lam=0.37, beta=3.0, lam_slow=0.05, mu=0.2), NextLRFU(lam=0.37, beta=3.0, lam_slow=0.05, mu=0.2)
    for t, token in enumerate(_trace(5, tokens=80), 1):
        for layer, es in token:
            keys = [(layer, e) for e in es]
            for key in keys:
                one.touch(key, t)
            many.touch_many(keys, t)
    assert one._state.keys() == many._state.keys()
    for key in one._state:
        assert many._state[key][1] == one._state[key][1]
        assert many._state[key][0] == pytest.approx(one._state[key][0], rel=1e-12, abs=1e-12)
        assert many._slow[key] == pytest.approx(one._slow[key], rel=1e-12, abs=1e-12)
        assert many.predicted(key) == pytest.approx(one.predicted(key), rel=1e-12)
    for layer in one._layers:
        np.testing.assert_array_equal(one._layers[layer].counts, many._layers[layer].counts)
        np.testing.assert_array_equal(one._layers[layer].uses, many._layers[layer].uses)


def test_learning_together_keeps_the_order_of_a_halving(monkeypatch):
    monkeypatch.setattr(NextLRFU, "HALVE_AT", 4)
    one, many = NextLRFU(), NextLRFU()
    for t in range(1, 7):  # layer 0 routes {1, 2, 3, 5} at every tick: rows halve in the middle of a tick
        for e in (1, 2, 3, 5):
            one.touch((0, e), t)
        many.touch_many([(0, 1), (0, 2), (0, 3), (0, 5)], t)
    np.testing.assert_array_equal(one._layers[0].counts, many._layers[0].counts)
    np.testing.assert_array_equal(one._layers[0].uses, many._layers[0].uses)
    assert one._layers[0].uses[1] < 4  # it did halve


@pytest.mark.parametrize("policy", ["lru", "lrfu", "lrfu-next"])
def test_placing_more_misses_than_unlocked_slots_is_refused_before_anything_changes(policy):
    c = SlotCache(3, policy)
    c.place_many([(0, 1), (0, 2), (0, 3)], 1, set())
    before = dict(c.slots)
    with pytest.raises(RuntimeError, match="every slot is locked"):
        c.place_many([(1, 1), (1, 2)], 2, {(0, 1), (0, 2)})
    assert c.slots == before and c.evictions == 0
    assert c.place_many([(1, 1)], 2, {(0, 1), (0, 2)}) == [before[(0, 3)]]


def test_without_prediction_it_evicts_what_lrfu_evicts():
    rng = random.Random(5)
    trace = [[(layer, sorted(set(rng.choices(range(20), k=4)))) for layer in range(4)] for _ in range(300)]
    evicted = {}
    for name, policy in (("lrfu", LRFU(0.05)), ("next", NextLRFU(0.05, beta=0.0, mu=0.0))):
        c = SlotCache(10, "lrfu")
        c.policy = policy
        out = []
        for t, token in enumerate(trace, 1):
            for layer, es in token:
                locked = {(layer, e) for e in es if c.lookup((layer, e), t) is not None}
                for e in es:
                    if (layer, e) not in locked:
                        out.append(c.place((layer, e), t, locked)[1])
                        locked.add((layer, e))
        evicted[name] = out
    assert evicted["lrfu"] == evicted["next"] and sum(e is not None for e in evicted["lrfu"]) > 500


def test_seed_gives_lrfu_next_its_history_and_policies_validate():
    c = SlotCache(4, "lrfu-next")
    c.seed({(0, 1): 4.0, (0, 2): 1.0, (0, 3): 0.0})
    assert c.policy._state == {(0, 1): (3.0, 0), (0, 2): (1.0, 0)}  # log2(8 * w / 4)
    assert c.policy._slow == {(0, 1): 3.0, (0, 2): 1.0}  # the slow value starts from the same history
    c.seed({(0, 1): 1.0, (0, 4): 1.0})  # keys with history keep it
    assert c.policy._state[(0, 1)] == (3.0, 0) and c.policy._state[(0, 4)] == (3.0, 0)
    lrfu = SlotCache(4, "lrfu")
    lrfu.seed({(0, 1): 4.0, (0, 2): 1.0})
    assert lrfu.policy._state == {(0, 1): (3.0, 0), (0, 2): (1.0, 0)}
    lru = SlotCache(4, "lru")
    lru.seed({(0, 1): 4.0})  # nothing to seed
    assert list(lru.policy._order) == []
    assert isinstance(c.policy, NextLRFU) and list(POLICIES) == ["lru", "lrfu", "lrfu-next"]
    # the default, in the cache and in the streamer's config
    from tqbench.stream import StreamConfig

    assert isinstance(SlotCache(4).policy, NextLRFU)
    assert StreamConfig(budget_bytes=1).policy == DEFAULT_POLICY == "lrfu-next"
    # the CLI and the chat request spell it out (importing the cache there would load MLX at start-up): they agree
    import inspect

    from tqbench.cli.chat import chat
    from tqbench.chat.request import POLICIES as REQUEST_POLICIES
    from tqbench.chat.request import StreamRequest

    assert inspect.signature(chat).parameters["cache_policy"].default == DEFAULT_POLICY
    assert StreamRequest().policy == REQUEST_POLICIES[0] == DEFAULT_POLICY and set(REQUEST_POLICIES) == set(POLICIES)
    with pytest.raises(ValueError, match="choose lru, lrfu, lrfu-next"):
        SlotCache(2, "arc")


# ---- benchmarks/policies.py ------------------------------------------------------------------------------------------


def _script():
    return load_script(SCRIPT)


def test_policies_script_budgets_and_gap_on_a_small_trace():
    b = _script()
    assert b.parse_budgets("ws/2,1/16,1/2,100", 3136, 56, 8) == [("ws/2", 28), ("1/16", 196), ("1/2", 1568),
                                                                    ("100", 100)]
    with pytest.raises(SystemExit, match="one layer's top-8"):
        b.parse_budgets("4", 3136, 56, 8)
    rng = np.random.default_rng(0)
    trace = rng.choice(12, size=(2, 200, 2), p=np.arange(12, 0, -1) / 78).astype(np.int16)
    cfg = dict(budgets="ws,1/2", policies="lru,lrfu,lrfu-next", oracles="1")
    w = b.replay("t", trace, dict(moe_layers=[0, 1], num_experts=12), cfg)
    assert [(r["label"], r["budget"]) for r in w["rows"]] == [("ws", 4), ("1/2", 12)]
    assert w["expert_layers"] == 24 and w["working_set"] == 4
    for r in w["rows"]:
        for p in ("lru", "lrfu", "lrfu-next", "oracle-next-1"):
            assert r["gap_closed"][p] == pytest.approx((r[p] - r["lru"]) / (r["belady"] - r["lru"]))
            assert r["closes_third"][p] == (r["gap_closed"][p] >= 1 / 3)
            assert r["beats_fixed"][p] == (r[p] > r["best_fixed"])
            assert 0 <= r[p] <= r["belady"] + 1e-12
    s = b.summarize([w], ["lrfu"])["lrfu"]
    assert s["budgets"] == 2 and s["closes_third"] == sum(r["closes_third"]["lrfu"] for r in w["rows"])
    assert s["min_gap_closed"] == min(r["gap_closed"]["lrfu"] for r in w["rows"])
    assert not math.isnan(s["min_gap_closed"])


def test_belady_within_a_horizon_is_belady_past_the_trace_and_the_rest_of_the_token_oracle_at_zero():
    """`belady-h` against two independent computations: Belady's MIN (streaming.py's heap of next uses) once the
    horizon passes the trace's end, and oracle-next-0 (SlotCache's LRFU guarded from the rest of the token) at h = 0,
    where both keep exactly the rest of the token; in between it lies between them."""
    b = _script()
    from streaming import batches_of, belady_hit_rate

    for seed in range(3):
        rng = np.random.default_rng(seed)
        trace = rng.choice(12, size=(2, 300, 2), p=np.arange(12, 0, -1) / 78).astype(np.int16)
        batches = batches_of(trace, [0, 1])
        for budget in (4, 7, 12, 20):
            belady = belady_hit_rate(batches, budget)
            assert b.horizon_hit_rate(batches, budget, 300) == belady
            h0 = b.horizon_hit_rate(batches, budget, 0)
            assert h0 == b.oracle_hit_rate(batches, budget, 0)
            assert h0 - 1e-12 <= b.horizon_hit_rate(batches, budget, 4) <= belady + 1e-12
    assert b.token_counts("--horizons", "1, 4,16") == [1, 4, 16] and b.token_counts("--oracles", "") == []
    cfg = dict(budgets="ws,1/2", policies="lru", oracles="", horizons="2")
    w = b.replay("t", trace, dict(moe_layers=[0, 1], num_experts=12), cfg)
    for r in w["rows"]:
        assert r["belady-2"] == b.horizon_hit_rate(batches, r["budget"], 2)
        assert r["gap_closed"]["belady-2"] == pytest.approx((r["belady-2"] - r["lru"]) / (r["belady"] - r["lru"]))


def test_policies_script_refuses_a_bad_horizon_before_tracing_anything(tmp_path):
    b = _script()
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit, match=r"^--horizons 1,x: comma-separated whole numbers of tokens"):
        b.main(["--quick", "--horizons", "1,x", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert not out.exists() and not (tmp_path / "work").exists()


# ---- in the streamer -------------------------------------------------------------------------------------------------


def test_streamed_generation_with_lrfu_next_is_bit_identical_with_a_seeded_and_pinned_cache():
    """The streamer drives lrfu-next as it drives the others (place with the layer's experts locked, cold prefill
    entries, drop, pins, a profile's seed): the output is resident's, and the pinned experts stay."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from conftest import converted
    from tqbench.runtime.load import load
    from tqbench.stream import StreamConfig
    from tqbench.stream.budget import model_bytes
    from tqbench.stream.pagein import staging_bytes

    path = converted("src")  # the shipped demo's passthrough conversion, shared (read-only)
    prompt = [4352, 100, 517, 2300, 42, 7, 1311, 260, 9, 88, 1000, 61]

    def run(model, n=8):
        logits = np.array(model(mx.array([prompt])).astype(mx.float32))
        return logits, [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)),
                                               range(n))]

    want_logits, want_tokens = run(load(path).model)
    expert = model_bytes(path).one_expert
    loaded = load(path, streaming=StreamConfig(budget_bytes=staging_bytes(expert, 2) + 40 * expert, workers=2,
                                               policy="lrfu-next"))
    st = loaded.streamer
    pool = st.pools[0]
    assert isinstance(pool.cache.policy, NextLRFU)
    layers = sorted(st.pool_of)
    ranked = [(layer, e) for e in range(3) for layer in layers]  # 3 hot experts per layer, as a profile ranks them
    pinned = st.preload(ranked, 0.25, {k: 10.0 - k[1] for k in ranked})
    assert pinned == int(pool.slots * 0.25) > 0
    keys = set(pool.cache.pinned)
    # seeded (the hottest weight = 8 accesses), then read in by the preload at tick 0: C = 9
    assert pool.cache.policy._state[ranked[0]] == (math.log2(9), 0)
    assert pool.cache.policy._slow[ranked[0]] == math.log2(9)
    logits, tokens = run(loaded.model)
    np.testing.assert_array_equal(logits, want_logits)
    assert tokens == want_tokens
    assert st.stats.misses > 0 and st.stats.evictions > 0
    assert keys <= set(pool.cache.slots) and pool.cache.pinned == keys  # pinned experts never left
    assert len(pool.cache) <= pool.slots
    learned = pool.cache.policy._layers
    assert set(learned) == set(layers) and all(int(s.counts.sum()) > 0 for s in learned.values())
    st.close()

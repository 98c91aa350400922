"""scripts/demo_eval.py's measurements on synthetic traces and texts: the docstring-word test, consecutive overlap
within windows, per-domain hot sets and what a profile learned elsewhere serves."""

from __future__ import annotations

import numpy as np
import pytest

from demo_eval import (
    copy_probe,
    load_model,
    paired_docstring,
    pick_functions,
    selection_functions,
    Stream,
    derangement,
    docstring_win,
    hot_set_overlap,
    per_domain_loss,
    routing_report,
    skew_row,
    third_party_files,
    window_jaccard,
    words,
)

from training.modelstats import consecutive_jaccard, random_trace  # noqa: E402


def test_docstring_win_counts_content_words():
    true = "Return the number of seconds since the epoch as a float."
    other = "Open a file and return a stream object for reading bytes."
    assert words("The Seconds since EPOCH, as a float!") == {"seconds", "since", "epoch", "float"}
    assert docstring_win("the seconds since the epoch", true, other) == (True, 3, 0)
    assert docstring_win("read bytes from a file", true, other) == (False, 0, 2)  # no stemming: read != reading
    assert docstring_win("nothing in common", true, other) == (False, 0, 0)  # a tie is no win
    # words of the question earn nothing in the strict variant
    assert docstring_win("time.seconds seconds", true, other, exclude=words("What does time.seconds do?"))[0] is False
    p = derangement(30, 0)
    assert sorted(p) == list(range(30)) and all(i != j for i, j in enumerate(p)) and p == derangement(30, 0)


def test_window_jaccard_matches_modelstats_within_one_window():
    t = random_trace(2, 256, 16, 4, seed=1)
    assert np.allclose(window_jaccard(t, 256), consecutive_jaccard(t))
    same = np.repeat(np.arange(4, dtype=np.int16)[None, None, :], 256, axis=1)
    assert window_jaccard(same, 128).tolist() == [1.0]  # identical sets; window boundaries are not compared


def test_hot_sets_tell_domains_apart():
    E, k, n = 40, 2, 4096
    rng = np.random.default_rng(0)
    # domain a routes to experts 0-9, domain b to 20-29: a profile of a serves a, not b
    a = rng.integers(0, 10, (1, n, k)).astype(np.int16)
    b = rng.integers(20, 30, (1, n, k)).astype(np.int16)
    trace = np.concatenate([a, b], axis=1)
    segs = {"a": [(0, n)], "b": [(n, 2 * n)], "tiny": [(0, 10)]}
    h = hot_set_overlap(trace, segs, E, fraction=0.25)
    assert h["hot_set_size"] == 10 and h["domains"] == ["a", "b"]  # the tiny domain is left out
    row = h["layers"][0]
    assert row["halves_jaccard"] == 1.0 and row["domains_jaccard"] == 0.0
    assert row["served_by_own_first_half"] == 1.0 and row["served_by_other_domains"] == 0.0
    assert row["served_by_oracle"] == 1.0 and h["uniform_served"] == 0.25
    # uniform routing: the halves overlap like random sets, a profile serves about the uniform share
    u = random_trace(1, 2 * n, E, k, seed=2)
    hu = hot_set_overlap(u, {"a": [(0, n)], "b": [(n, 2 * n)]}, E, fraction=0.25)["layers"][0]
    assert abs(hu["served_by_own_first_half"] - 0.25) < 0.05 and hu["halves_jaccard"] < 0.6


def test_skew_row_and_report():
    counts = np.array([50, 30, 10, 5, 5] + [0] * 20)
    row = skew_row(counts)
    assert (row["experts_for_50pct"], row["experts_for_80pct"], row["experts_for_90pct"]) == (1, 2, 3)
    assert row["hottest4pct_share"] == 0.5 and row["unused"] == 20 and row["cover80_share_of_experts"] == 0.08
    t = random_trace(3, 4096, 32, 4, seed=3)
    rep = routing_report(t, {"x": (0, 2048), "y": (2048, 4096)}, {"d1": [(0, 2048)], "d2": [(2048, 4096)]}, 32,
                         [1, 2, 3], 128)
    assert [r["layer"] for r in rep["overall"]] == [1, 2, 3] and set(rep["per_domain"]) == {"d1", "d2"}
    assert rep["uniform"]["experts_for_50pct"] == 16 and abs(rep["overall"][0]["experts_for_50pct"] - 15) <= 2
    assert abs(rep["overall"][0]["jaccard_consecutive"] - rep["jaccard_random"]) < 0.02


def test_streams_segments_and_domain_losses():
    s = Stream([("a", [1, 2, 3]), ("b", [4, 5]), ("a", [6])], eos=0)
    assert s.tokens.tolist() == [1, 2, 3, 0, 4, 5, 0, 6, 0] and s.ends == [4, 7, 9]
    assert s.segments(8) == {"a": [(0, 4), (7, 8)], "b": [(4, 7)]}
    nll = np.arange(4096, dtype=np.float64) % 2
    out = per_domain_loss(nll, {"a": [(0, 3000)], "b": [(3000, 4096)]})
    assert set(out) == {"a"} and out["a"]["tokens"] == 2999  # b has too few tokens


def test_third_party_sources_are_installed():
    files = third_party_files()
    pkgs = {p for p, _ in files}
    assert pkgs == {"click", "diskcache"} and all(f.suffix == ".py" for _, f in files)


def test_paired_docstring_counts_and_exact_sign_test():
    """Counts over the same functions, and the two-sided sign test by hand: 5 discordant wins against 1 is
    2 * (C(6,0) + C(6,1)) / 2**6 = 14/64; an even split or no discordance is p = 1."""
    def test(wins):
        return {"rows": [{"name": f"f{i}", "win": w} for i, w in enumerate(wins)]}

    a = test([1, 1, 1, 1, 1, 1, 0, 0, 1, 0])
    b = test([0, 0, 0, 0, 0, 1, 1, 0, 1, 0])
    d = paired_docstring(a, b)
    assert (d["only_base"], d["only_other"], d["both"], d["neither"], d["functions"]) == (5, 1, 2, 2, 10)
    assert d["sign_test_p"] == round(14 / 64, 4)
    assert paired_docstring(b, a)["sign_test_p"] == d["sign_test_p"]
    assert paired_docstring(a, a)["sign_test_p"] == 1.0
    assert paired_docstring(test([1, 0]), test([0, 1]))["sign_test_p"] == 1.0
    # 9 against 0: 2 / 2**9
    assert paired_docstring(test([1] * 9), test([0] * 9))["sign_test_p"] == round(2 / 512, 4)
    with pytest.raises(ValueError, match="different functions"):
        paired_docstring(a, test([1, 0]))


def test_selection_functions_never_meet_the_test():
    """The selection set comes from the same eligible pool (held out, docstring in no training text) and never holds
    a function the test would ask about, at any test size; it is seeded and in name order."""
    from training.conversations import DocItem

    items = [DocItem(f"m{f}.py", f"m{f}", f"m{f}", kind, f"m{f}.fn{j}", f"m{f}.fn{j}()", f"Doc of m{f} fn{j} here.")
             for f in range(12) for j, kind in enumerate(["function"] * 7 + ["method"] * 2 + ["class"])]
    train_text = "Doc of m0 fn0 here."  # in a training file: eligible for neither
    chosen = selection_functions(items, train_text, 200, seed=0)
    eligible = {i.name for i in items if i.kind in ("function", "method") and i.name != "m0.fn0"}
    test_all = {i.name for i in pick_functions(items, train_text, 1000, seed=0)}
    assert len(test_all) == 12 * 4 and "m0.fn0" not in test_all  # at most 4 a file
    names = [i.name for i in chosen]
    assert set(names) == eligible - test_all and names == sorted(names)
    for n in (5, 30, 48):
        assert not {i.name for i in pick_functions(items, train_text, n, seed=0)} & set(names)
    assert [i.name for i in selection_functions(items, train_text, 10, seed=0)] == \
        [i.name for i in selection_functions(items, train_text, 10, seed=0)]
    assert len(selection_functions(items, train_text, 10, seed=0)) == 10


def test_the_test_is_the_first_draw_of_any_larger_one_and_pairs_split_on_it():
    """`--functions N` above 30 asks the test's 30 functions and more of the same draw, so the pairs can be split into
    the test's functions and the others; the split counts only the named functions."""
    from training.conversations import DocItem

    items = [DocItem(f"m{f}.py", f"m{f}", f"m{f}", "function", f"m{f}.fn{j}", f"m{f}.fn{j}()", f"Doc {f} {j} here.")
             for f in range(30) for j in range(6)]
    test = {i.name for i in pick_functions(items, "", 30, seed=0)}
    for n in (31, 73, 120):
        assert test <= {i.name for i in pick_functions(items, "", n, seed=0)}
    rows = lambda wins: {"rows": [{"name": f"f{i}", "win": w} for i, w in enumerate(wins)]}  # noqa: E731
    a, b = rows([1, 1, 1, 0, 0, 1]), rows([0, 0, 1, 1, 1, 1])
    first = paired_docstring(a, b, {"f0", "f1", "f2"})
    assert (first["functions"], first["only_base"], first["only_other"], first["both"]) == (3, 2, 0, 1)
    rest = paired_docstring(a, b, {"f3", "f4", "f5"})
    assert (rest["functions"], rest["only_base"], rest["only_other"], rest["both"]) == (3, 0, 2, 1)
    assert paired_docstring(a, b)["only_base"] == first["only_base"] + rest["only_base"]


def test_copy_probe_asks_each_function_under_its_real_and_a_made_up_module():
    """The shipped demo, two training functions: each asked twice, the counts are the rows' (the model's answers are
    whatever they are; what the probe records about them is checked)."""
    from tqbench.demo.install import SHIPPED_DEMO
    from training.conversations import mine_stdlib, split_items
    from training.corpus import stdlib_root

    items = split_items(mine_stdlib(stdlib_root(), ["json/__init__.py", "shlex.py"]))[0]
    picked = pick_functions(items, "", 2, 0)
    model, tok = load_model(SHIPPED_DEMO)
    a = copy_probe(model, tok, picked, seed=0, max_tokens=8)
    assert a == copy_probe(model, tok, picked, seed=0, max_tokens=8)  # seeded names, greedy answers
    assert a["functions"] == 2 and [r["name"] for r in a["rows"]] == [i.name for i in picked]
    for r, item in zip(a["rows"], picked):
        assert r["renamed"] != item.name and r["renamed"].endswith(item.name[len(item.module):])
        assert r["real_named"] == (item.name in r["real_answer"])
        assert r["made_up_named"] == (r["renamed"] in r["made_up_answer"])
        assert r["made_up_answer_names_the_real_one"] == (item.name in r["made_up_answer"])
    assert a["real_named"] == sum(r["real_named"] for r in a["rows"]) / 2
    assert a["made_up_named"] == sum(r["made_up_named"] for r in a["rows"]) / 2

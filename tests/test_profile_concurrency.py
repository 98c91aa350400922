"""The learned-profile store under concurrent use, with real processes: sessions saving into one store at once lose
no routing count, and a reader (an export, a chat choosing its profile) always reads one whole state of the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import diskcache
import numpy as np
import pytest

from conftest import demo_tq4
from tqbench.paths import cache_dir, shipped_profiles
from tqbench.profile import DECAY, Profile, ProfileStore, identify, import_file
from tqbench.profile.choose import read_file
from tqbench.profile.fingerprint import Geometry

# The demo's routing geometry: with counts in every cell the store's entry is over 32 KB, so diskcache keeps it in a
# file of its own, which each save replaces (the case where a reader once found the file gone).
GEO = Geometry(model_type="kimi_k3", layers=tuple(range(1, 8)), experts=448, top_k=8)
SEED_COUNT, DELTA_COUNT = 1000, 3  # per cell, decode and prefill
CELLS = 2 * len(GEO.layers) * GEO.experts


def _uniform(count: float) -> Profile:
    p = Profile.empty("fp", GEO)
    for n in GEO.layers:
        p.decode[n] += count
        p.prefill[n] += count
    p.routings = count * CELLS
    return p


_WRITER = f"""
import sys, time
from tqbench.profile.fingerprint import Geometry
from tqbench.profile.profile import Profile
from tqbench.profile.store import ProfileStore
geo = Geometry(model_type="kimi_k3", layers={GEO.layers!r}, experts={GEO.experts}, top_k={GEO.top_k})
store = ProfileStore(sys.argv[1])
for _ in range(int(sys.argv[2])):
    delta = Profile.empty("fp", geo)
    for n in geo.layers:
        delta.decode[n] += {DELTA_COUNT}
        delta.prefill[n] += {DELTA_COUNT}
    delta.routings = {DELTA_COUNT * CELLS}
    store.commit(delta, first=False)
    time.sleep(0.01)  # as a session decodes between its saves
store.close()
"""


def test_reads_during_two_writers_saves_see_whole_states_and_no_save_is_lost(tmp_path):
    """Two processes each commit the same delta 40 times into a store seeded with one profile, while this process
    loads the entry over and over. Every state of the store is seed + k x delta: each load must be one of them (never
    empty, never torn, no warning), k must never go back, and the final state has k = 80 (no save lost)."""
    store_dir, saves = tmp_path / "store", 40
    store = ProfileStore(store_dir)
    store.put(_uniform(SEED_COUNT))
    assert list(store_dir.rglob("*.val")), "the entry is no longer kept in a file of its own: make it larger"
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(store_dir), str(saves)], stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    seen = []
    try:
        while any(w.poll() is None for w in writers):
            p = store.load("fp", GEO)
            k = (p.routings / CELLS - SEED_COUNT) / DELTA_COUNT
            assert k == round(k) and np.array_equal(_cells(p), np.full(CELLS, SEED_COUNT + k * DELTA_COUNT)), \
                f"read a state that never was: {p.routings} routings"
            seen.append(int(k))
            time.sleep(0.002)
    finally:
        errors = [w.communicate(timeout=60)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert store.warnings == []
    assert seen == sorted(seen), "a load went back to an older state"
    assert any(0 < k < 2 * saves for k in seen), "no load happened while the writers saved"
    final = store.load("fp", GEO)
    store.close()
    assert final.routings == (SEED_COUNT + 2 * saves * DELTA_COUNT) * CELLS


def _cells(p: Profile) -> np.ndarray:
    return np.concatenate([np.concatenate([p.decode[n], p.prefill[n]]) for n in p.geometry.layers])


# ---- two chat sessions learning at once, exports meanwhile --------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A fresh tq4 conversion of the demo (the one profiles/demo-tq4.json was made for)."""
    return demo_tq4(tmp_path_factory.mktemp("concurrency"))


# `tqbench chat` saving every 0.25 s, each save logged (its delta, and the state of the store it left); the reply
# starts once both sessions have loaded, so their saves interleave.
_CHAT = """
import json, os, pathlib, sys, time
import tqbench.profile.learn as learn
from tqbench.profile.store import ProfileStore

learn.SAVE_EVERY_S = 0.25
log = pathlib.Path(os.environ["TQBENCH_TEST_LOG"]) / f"{os.getpid()}.jsonl"
commit = ProfileStore.commit

def logged(self, delta, first):
    start = time.time()
    stored = commit(self, delta, first)
    counts = sum(a.sum() for a in (*stored.decode.values(), *stored.prefill.values()))
    with open(log, "a") as f:
        f.write(json.dumps(dict(start=start, end=time.time(), first=first, delta=delta.routings,
                                routings=stored.routings, sessions=stored.sessions, counts=float(counts))) + "\\n")
    return stored

ProfileStore.commit = logged
init = learn.Learner.__init__

def start_together(self, *a, **kw):
    init(self, *a, **kw)
    (log.parent / f"{os.getpid()}.ready").touch()
    t = time.monotonic()
    while len(list(log.parent.glob("*.ready"))) < 2 and time.monotonic() - t < 120:
        time.sleep(0.01)

learn.Learner.__init__ = start_together
from tqbench.cli.main import run
sys.argv = ["tqbench"] + sys.argv[1:]
run()
"""


@pytest.mark.slow  # two chat processes and a series of export processes, all at once
def test_two_chats_learning_at_once_lose_no_routing_and_exports_meanwhile_are_whole_states(model, tmp_path):
    """Two `tqbench chat` processes learn into one store, seeded with the demo's shipped profile, while `tqbench
    profile export` runs again and again. Every process exits 0 without a traceback. Each chat's --stats-json reports
    the routings it learned, the sum of its saves. Replaying the saves in the store's order (a save's state is the
    previous one, decayed once at a session's first save, plus its delta) gives every state the store went through
    and its final one: no save lost or doubled. In closed form, with S0 the seed, A and B the sessions' routings and
    X what the earlier session saved before the later one's first save: S0 x DECAY^2 + A + B - (1 - DECAY) x X.
    Every export is a valid profile file (the engine's reader) holding one of those states, whole (its routings and
    its counts from the same state), in order; one taken after both first saves is never more than the final store."""
    fp, geo = identify(model)
    seed, _ = import_file(model, shipped_profiles() / "demo-tq4.json")
    assert list((cache_dir() / "profiles").rglob("*.val")), "the entry is no longer kept in a file of its own"
    log = tmp_path / "log"
    log.mkdir()
    env = {**os.environ, "TQBENCH_TEST_LOG": str(log)}
    prompts = ("def fib(n):", "class Stack:\n    def __init__(self):\n")
    stats = [tmp_path / f"stats-{i}.json" for i in range(2)]
    chats = [subprocess.Popen([sys.executable, "-c", _CHAT, "chat", "--model", str(model), "--no-chat-template",
                               "--prompt", prompt, "--max-tokens", "64", "--cache-budget-gb", "0.02",
                               "--stats-json", str(st)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for prompt, st in zip(prompts, stats)]
    exports = []
    try:
        while any(c.poll() is None for c in chats):
            out = tmp_path / f"export-{len(exports)}.json"
            start = time.time()
            r = subprocess.run([sys.executable, "-m", "tqbench", "profile", "export", "--model", str(model), "-o",
                                str(out)], capture_output=True, text=True, timeout=120)
            exports.append((start, time.time(), out, r))
    finally:
        errors = [c.communicate(timeout=300)[1] for c in chats]
    for c, err in zip(chats, errors):
        assert c.returncode == 0 and "Traceback" not in err, err

    saves = {f.stem: [json.loads(line) for line in f.read_text().splitlines()] for f in log.glob("*.jsonl")}
    assert len(saves) == 2 and all(saves.values())
    # the sessions overlapped: each saved several times while the other was saving too
    lo = max(s[0]["start"] for s in saves.values())
    hi = min(s[-1]["end"] for s in saves.values())
    assert all(sum(lo <= x["start"] <= hi for x in s) >= 3 for s in saves.values()), (lo, hi)

    learned = [json.loads(st.read_text())["learned_routings"] for st in stats]
    assert learned == [sum(x["delta"] for x in saves[str(c.pid)]) for c in chats] and min(learned) > 0

    # every save saw the state the one before it left
    order = sorted((x for s in saves.values() for x in s), key=lambda x: (x["sessions"], x["routings"]))
    states = [(seed.sessions, seed.routings, seed.routings)]  # (sessions, routings, sum of the counts)
    for x in order:
        before = round(states[-1][1], 3)  # as the store holds it
        assert x["routings"] == pytest.approx(before * (DECAY if x["first"] else 1) + x["delta"], abs=1e-6), x
        states.append((x["sessions"], x["routings"], x["counts"]))
    assert [x["sessions"] for x in order if x["first"]] == [seed.sessions + 1, seed.sessions + 2]
    earlier = sum(x["delta"] for x in order if x["sessions"] == seed.sessions + 1)
    store = ProfileStore()
    final = store.load(fp, geo)
    store.close()
    assert store.warnings == []
    with diskcache.Cache(str(cache_dir() / "profiles")) as cache:
        assert cache.check() == []  # SQLite's integrity check and every entry's file
    assert (final.sessions, final.routings) == (states[-1][0], pytest.approx(states[-1][1], abs=1e-3))
    assert final.routings == pytest.approx(seed.routings * DECAY ** 2 + sum(learned) - (1 - DECAY) * earlier,
                                           abs=0.05)

    first_saves_done = max(x["end"] for x in order if x["first"])
    during = [e for e in exports if e[0] < hi and e[1] > lo]
    assert len(during) >= 2, "no export ran while both sessions saved"
    at = 0
    for start, _, out, r in exports:
        assert r.returncode == 0 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"wrote {out}: the learned profile of {model} (")
        p = read_file(out, fp, geo)
        found = [i for i, (n, routings, counts) in enumerate(states) if n == p.sessions
                 and abs(routings - p.routings) < 2e-3 and abs(counts - _cells(p).sum()) < 0.5]
        assert found and found[0] >= at, f"{out} holds no state the store went through, or an older one"
        at = found[0]
        if start > first_saves_done:
            assert (_cells(p) <= _cells(final) + 1e-3).all() and p.routings <= final.routings + 1e-3

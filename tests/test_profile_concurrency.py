"""The learned-profile store under concurrent use, with real processes: sessions saving into one store at once lose
no routing count, and a reader (an export, a chat choosing its profile) always reads one whole state of the store."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from tqbench.profile import Profile, ProfileStore
from tqbench.profile.fingerprint import Geometry

# The demo's routing geometry: with counts in every cell the store's entry is over 32 KB, so diskcache keeps it in a
# file of its own, which each save replaces (the case where a reader once found the file gone).
GEO = Geometry("kimi_k3", tuple(range(1, 8)), 448, 8)
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
geo = Geometry("kimi_k3", {GEO.layers!r}, {GEO.experts}, {GEO.top_k})
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


"""Hot-expert profiles (tqbench.profile, `tqbench profile`, chat's --profile): on the real demo model converted with
tq4 and a real diskcache store (each test its own, through TQBENCH_CACHE_DIR).

Routings are checked against an independent count: a fresh resident load whose `switch_mlp` modules this file wraps
itself, recording every forward pass's expert ids (`_passes`). A "pass" is one forward pass of the model; a decode
pass has one position (mlx-lm also feeds a prompt's last token that way), a prefill pass several."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import diskcache
import mlx.nn as nn
import numpy as np
import pytest

from cli_helpers import tqbench
from conftest import demo_tq4
from tqbench.demo import SHIPPED_SPEC
from tqbench.chat.request import ChatRequest, ProfileOptions, StreamRequest
from tqbench.chat.session import ChatSession
from tqbench.paths import cache_dir, shipped_profiles
from tqbench.profile import (DECAY, MATURE, PIN_SHARE, SCHEMA, SHIPPED_PIN_SHARE, Profile, ProfileStore, choose, diff,
                             hot_set, identify, merge, read_profile, summary)
from tqbench.profile.report import coverage_report, number
from tqbench.runtime.conversation import Sampling
from tqbench.events import ReplyDone

SMALL_BUDGET = "0.0005"  # GB: a few percent of the demo's tq4 experts
P1, P2 = "def fib(n):", "class Stack:\n    def __init__(self):\n"

# The shipped demo's routing: experts per MoE layer, top-k, MoE layers.
E, K = SHIPPED_SPEC.num_experts, SHIPPED_SPEC.num_experts_per_token
L = sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A fresh tq4 conversion of the demo (the one profiles/demo-tq4.json was made for)."""
    return demo_tq4(tmp_path_factory.mktemp("profile"))


def _other(model: Path, dest: Path) -> Path:
    """The same model under another fingerprint (a config key added), so no shipped profile matches it."""
    shutil.copytree(model, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["tqbench_test"] = "another model of the same geometry"
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# ---- an independent count of the routing ------------------------------------------------------------------------------

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class _Recorder(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, record):
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.record = record  # a bound method: a plain attribute, no child module

    def __call__(self, x, indices, *args, **kw):
        self.record((self.layer, np.array(indices)))
        return self.inner(x, indices, *args, **kw)


def _passes(path: Path, runs: list[tuple[str, int]]) -> list[np.ndarray]:
    """For each (prompt, max tokens), a fresh plain-text conversation on one fresh resident load: every forward pass's
    routing as counts [passes, 2 (decode, prefill), layers, experts]."""
    from mlx.utils import tree_unflatten

    _, geo = identify(path)
    index = {n: i for i, n in enumerate(geo.layers)}
    calls: list[tuple[int, np.ndarray]] = []

    def install(conv):
        m = conv.loaded.model
        wraps = [(p, _Recorder(mod, int(_LAYER.search(p)[1]), calls.append)) for p, mod in m.named_modules()
                 if p.endswith(".switch_mlp")]
        m.update_modules(tree_unflatten(wraps))

    s = ChatSession()
    out = []
    try:
        with s.open(ChatRequest(model=str(path), chat_template=False, profile=ProfileOptions(learn=False))) as job:
            job.result()
        s.on_engine(install)
        for prompt, n in runs:
            s.reset()
            calls.clear()
            with s.reply(prompt, Sampling(max_tokens=n)) as job:
                job.result()
            passes, last = [], None
            for layer, ids in calls:
                if last is None or layer <= last:
                    passes.append(np.zeros((2, len(geo.layers), geo.experts)))
                last = layer
                kind = 1 if ids.ndim >= 2 and ids.shape[-2] > 1 else 0
                passes[-1][kind, index[layer]] += np.bincount(ids.ravel(), minlength=geo.experts)
            out.append(np.stack(passes))
    finally:
        s.close()
    return out


def _cumulative(passes: np.ndarray) -> np.ndarray:
    """[passes + 1, ...]: the counts of the first k passes, k = 0..passes."""
    return np.concatenate([np.zeros((1, *passes.shape[1:])), np.cumsum(passes, axis=0)])


def _array(p: Profile) -> np.ndarray:
    return np.stack([np.stack([p.decode[n] for n in p.geometry.layers]),
                     np.stack([p.prefill[n] for n in p.geometry.layers])])


def _stored(path: Path) -> Profile:
    fp, geo = identify(path)
    store = ProfileStore()
    try:
        return store.load(fp, geo)
    finally:
        store.close()


def _learn(path: Path, prompt: str, n: int, **opts) -> ReplyDone:
    """One chat session through the engine, learning into the default store."""
    s = ChatSession()
    try:
        with s.open(ChatRequest(model=str(path), chat_template=False, profile=ProfileOptions(**opts))) as job:
            job.result()
        with s.reply(prompt, Sampling(max_tokens=n)) as job:
            return job.result()[-1]
    finally:
        s.close()  # the learner's last save


# ---- learning ---------------------------------------------------------------------------------------------------------

def test_learning_is_exact_and_decays_once_per_session(model):
    """The store holds exactly the routing of the session's passes, decode and prefill apart; a second session
    stores DECAY x first + second."""
    _learn(model, P1, 16)
    first = _stored(model)
    ref1, ref2 = (x.sum(axis=0) for x in _passes(model, [(P1, 16), (P2, 16)]))
    assert np.array_equal(_array(first), ref1)
    assert ref1[1].sum() > 0 and ref1[0].sum() == 17 * K * L  # a prefill pass, then 17 single-token passes
    assert first.routings == ref1.sum() and first.sessions == 1

    _learn(model, P2, 16)
    second = _stored(model)
    np.testing.assert_allclose(_array(second), DECAY * ref1 + ref2, atol=1e-3)
    assert second.routings == pytest.approx(DECAY * ref1.sum() + ref2.sum()) and second.sessions == 2


@pytest.mark.slow  # two chat processes, one of them decoding for more than 5 s
def test_counts_persist_across_processes_and_survive_kill_9(model, tmp_path):
    """Process 1 chats and exits: its counts are in the store, exact. Process 2 (streamed, a long reply) reads them,
    decays them once, and is killed with SIGKILL after more than 5 s of decoding: the store holds DECAY x process 1
    + exactly the first k passes of process 2 for some k >= 1 (its saves, every 5 s), and reads cleanly."""
    cmd = [sys.executable, "-m", "tqbench", "chat", "--model", str(model), "--no-chat-template"]
    done = subprocess.run(cmd + ["--prompt", P1, "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    c1 = _array(_stored(model))

    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd + ["--prompt", P2, "--max-tokens", "100000", "--cache-budget-gb", SMALL_BUDGET,
                                       "--pin-share", "0", "--json"], stdout=subprocess.PIPE, stderr=err, text=True)
    tokens: list[float] = []

    def read() -> None:
        for _ in proc.stdout:
            tokens.append(time.monotonic())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, "the chat ended before it could be killed: " + (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "no save seen"
            if tokens and time.monotonic() - tokens[0] > 5.5 and _stored(model).sessions == 2:
                break
            time.sleep(0.2)
        decoding_s = time.monotonic() - tokens[0]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and decoding_s > 5

    p = _stored(model)
    assert p.sessions == 2
    saved = _array(p) - DECAY * c1
    steps = round(saved[0].sum() / (K * L))
    assert steps >= 1
    (passes,) = _passes(model, [(P2, steps + 1)])
    cum = _cumulative(passes)
    k = int(np.flatnonzero(cum.sum(axis=(1, 2, 3)) == saved.sum().round())[0])
    np.testing.assert_allclose(saved, cum[k], atol=1e-3)  # exactly the first k passes of process 2
    assert len(tokens) > steps - 2  # the process had decoded past its last save when it was killed


_CONCURRENT = """
import os, pathlib, sys, time
import tqbench.profile.learn as learn
learn.SAVE_EVERY_S = 0.25  # many saves, interleaved with the other process's
init = learn.Learner.__init__
def start_together(self, *a, **kw):  # both processes start decoding when both have loaded
    init(self, *a, **kw)
    d = pathlib.Path(os.environ["TQBENCH_TEST_BARRIER"])
    (d / str(os.getpid())).touch()
    t = time.monotonic()
    while len(list(d.iterdir())) < 2 and time.monotonic() - t < 60:
        time.sleep(0.01)
learn.Learner.__init__ = start_together
from tqbench.cli.main import run
sys.argv = ["tqbench"] + sys.argv[1:]
run()
"""


@pytest.mark.slow  # two chat processes at once
def test_two_processes_at_once_lose_no_update(model, tmp_path):
    """Two chat processes on one model, started together, each saving every 0.25 s. Every save is a transaction, so
    the result is exact: each session's first save decays what the store holds once, so with sessions A and B and
    X the one that saved first, the store holds A + B - (1 - DECAY) x (X's first m passes), m >= 1 being what X had
    saved before the other's first save. Asserted: such an X and m exist (every count of both arrived, none twice),
    and m is short of all of X's passes (the saves really interleaved)."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "TQBENCH_TEST_BARRIER": str(barrier)}
    prompts = (P1, P2)
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, "chat", "--model", str(model), "--no-chat-template",
                               "--prompt", p, "--max-tokens", "32"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for p in prompts]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    p = _stored(model)
    a, b = _passes(model, [(x, 32) for x in prompts])
    assert p.sessions == 2
    decayed = (a.sum(axis=0) + b.sum(axis=0) - _array(p)) / (1 - DECAY)
    found = [(name, m, len(x)) for name, x in (("A", a), ("B", b)) for m, c in enumerate(_cumulative(x))
             if m >= 1 and np.allclose(c, decayed, atol=1e-2)]
    assert found, "the store is not A + B with one session's prefix decayed: an update was lost or doubled"
    assert any(m < n for _, m, n in found), found
    assert p.routings == pytest.approx(a.sum() + b.sum() - (1 - DECAY) * decayed.sum())


# ---- validation: one line, never a crash ----------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["{not json", json.dumps({"schema": "other/9"}), {"pickled": "dict"}, b"\x80\x04junk",
                                   json.dumps({"schema": SCHEMA, "fingerprint": "x", "model": {}})])
def test_a_corrupt_or_foreign_store_entry_is_one_warning_and_empty(model, tmp_path, capsys, monkeypatch, entry):
    other = _other(model, tmp_path / "other")
    fp, _ = identify(other)
    c = diskcache.Cache(str(cache_dir() / "profiles"))
    c.set(fp, entry)
    c.close()
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", other, "--json")
    assert r.code == 0
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tqbench: warning: the learned profile is unreadable"), r.err
    doc = json.loads(r.out)
    assert doc["source"] == "none" and doc["routings"] == 0 and doc["warnings"] == lines  # the entry counts as empty


def test_a_session_over_a_corrupt_entry_warns_once_and_learns_afresh(model, capsys):
    fp, _ = identify(model)
    c = diskcache.Cache(str(cache_dir() / "profiles"))
    c.set(fp, "{not json")
    c.close()
    capsys.readouterr()
    _learn(model, P1, 4)
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warnings) == 1  # once, though the session read the entry at its start and at its first save
    p = _stored(model)
    assert p.sessions == 1 and p.routings == (4 + 1) * K * L + 4 * K * L  # 4 prefill positions, 5 decode passes


def test_an_unreadable_store_is_one_error_line(model, capsys, monkeypatch):
    d = cache_dir() / "profiles"
    d.mkdir(parents=True)
    (d / "cache.db").write_bytes(b"not a database" * 100)
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", model)
    assert r.code == 1 and r.err.count("\n") == 1 and "the profile store cannot be opened" in r.err


def _export(model: Path, capsys, monkeypatch, dest: Path) -> dict:
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", model, "-o", dest)
    assert r.code == 0, r.err
    return json.loads(dest.read_text())


@pytest.mark.slow  # twenty-odd `profile import` runs, each fingerprinting the model (~12 s)
def test_import_refuses_bad_files_with_one_line(model, tmp_path, capsys, monkeypatch):
    _learn(model, P1, 4)
    doc = _export(model, capsys, monkeypatch, tmp_path / "good.json")
    before = _array(_stored(model))

    def bad(name: str, content) -> Path:
        f = tmp_path / name
        f.write_text(content if isinstance(content, str) else json.dumps(content))
        return f

    geometry = {**doc, "model": {**doc["model"], "experts": 32},
                "counts": {k: {n: v[:32] for n, v in d.items()} for k, d in doc["counts"].items()}}
    layers = {**doc, "model": {**doc["model"], "layers": doc["model"]["layers"][:-1]},
              "counts": {k: {n: v for n, v in d.items() if n != "7"} for k, d in doc["counts"].items()}}
    cases = {
        bad("schema.json", {**doc, "schema": "tqbench.profile/0"}): "not a tqbench profile (schema 'tqbench.profile/0'",
        bad("experts.json", geometry): f"made for 7 MoE layers x 32 experts; this model has 7 x {E}",
        bad("layers.json", layers): f"made for 6 MoE layers x {E} experts; this model has 7 x {E}",
        bad("counts.json", {**doc, "counts": {"decode": {"1": [1, 2]}, "prefill": {}}}): "layer 1 decode counts",
        bad("negative.json", {**doc, "routings": -5}): "expected a non-negative number",
        bad("no-model.json", {k: v for k, v in doc.items() if k != "model"}): 'malformed profile: no "model" field',
        bad("no-top-k.json", {**doc, "model": {k: v for k, v in doc["model"].items() if k != "top_k"}}):
            'malformed profile: no "model.top_k" field',
        bad("model-5.json", {**doc, "model": 5}): 'malformed profile: "model" is not an object',
        bad("truncated.json", json.dumps(doc)[:200]): "invalid JSON",
        bad("list.json", [1, 2]): "neither a tqbench profile nor a pin list",
        bad("pins.json", {"pin": [[0, 3]]}): "layer 0 is not one of the model's MoE layers (1..7)",
        bad("pins2.json", {"pin": [[1, E]]}): f"expert {E} of layer 1: the model has {E} per layer",
        bad("pins3.json", {"pin": [["a", 1]]}): "is not [layer, expert]",
        bad("usage.json", {"version": 1, "num_experts": 32, "routings": 1, "counts": {"1": [1] * 32}}):
            "usage profile for 32 experts per layer",
        bad("usage2.json", {"version": 1, "num_experts": E, "counts": {"x": [1] * E}}): "malformed usage profile",
        tmp_path / "missing.json": "cannot read: No such file or directory",
    }
    for f, why in cases.items():
        r = tqbench(capsys, monkeypatch, "profile", "import", f, "--model", model)
        assert r.code == 1 and r.err.startswith(f"tqbench: error: {f}: ") and r.err.count("\n") == 1, r.err
        assert why in r.err, (why, r.err)
        if f.stem in ("schema", "experts", "layers", "pins"):  # --force forgives another model's fingerprint only
            assert r.err == tqbench(capsys, monkeypatch, "profile", "import", f, "--model", model, "--force").err
    np.testing.assert_array_equal(_array(_stored(model)), before)  # nothing replaced the learned profile

    r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--max-tokens", "1", "--profile",
                tmp_path / "experts.json")
    assert r.code == 1 and r.err.splitlines()[-1].startswith("tqbench: error: ") and "Traceback" not in r.err
    assert "made for 7 MoE layers x 32 experts" in r.err.splitlines()[-1]


def test_fingerprint_mismatch_is_refused_unless_forced(model, tmp_path, capsys, monkeypatch):
    other = _other(model, tmp_path / "other")
    assert identify(other)[0] != identify(model)[0] and identify(other)[1] == identify(model)[1]
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    assert identify(moved)[0] == identify(model)[0]  # the path is no part of the fingerprint
    _learn(model, P1, 4)
    _export(model, capsys, monkeypatch, tmp_path / "p.json")
    r = tqbench(capsys, monkeypatch, "profile", "import", tmp_path / "p.json", "--model", other)
    assert r.code == 1 and r.err.count("\n") == 1
    assert "made for another model (fingerprint" in r.err and "--force uses it anyway" in r.err
    assert _stored(other).routings == 0
    r = tqbench(capsys, monkeypatch, "profile", "import", tmp_path / "p.json", "--model", other, "--force")
    assert r.code == 0, r.err
    assert "--force" in r.err
    imported = _stored(other)
    np.testing.assert_array_equal(_array(imported), _array(_stored(model)))
    assert imported.fingerprint == identify(other)[0]


def test_seed_system_files_import(model, tmp_path, capsys, monkeypatch):
    """TurboQuant-MLX's pin list (hottest first) and usage profile become a learned profile of the same ranking."""
    pins = tmp_path / "hot_experts.json"
    pins.write_text(json.dumps({"pin": [[3, 7], [1, 2], [3, 9]]}))
    assert tqbench(capsys, monkeypatch, "profile", "import", pins, "--model", model).code == 0
    p = _stored(model)
    assert p.decode[3][7] > p.decode[3][9] > 0 and p.decode[1][2] > 0 and p.routings == 3 + 2 + 1
    assert p.ranked() == [(1, 2), (3, 7), (3, 9)]  # each layer's order kept; layers compared by their shares
    usage = tmp_path / "usage.json"
    counts = {str(n): [float(e == n) * 10 + 1 for e in range(E)] for n in range(1, 8)}
    usage.write_text(json.dumps({"version": 1, "num_experts": E, "routings": 7 * (10 + E), "counts": counts}))
    assert tqbench(capsys, monkeypatch, "profile", "import", usage, "--model", model).code == 0
    p = _stored(model)
    assert [p.ranked()[i] for i in range(7)] == [(n, n) for n in range(1, 8)] and p.routings == 7 * (10 + E)


# ---- precedence --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # seven streamed chats (~7 s)
def test_precedence_file_then_mature_learned_then_shipped_then_none(model, tmp_path, capsys, monkeypatch):
    """What a streamed chat starts from, in its profile line and --stats-json: none; still none while the learned
    profile is immature; a profile in the model directory (shipped); the learned one once it has MATURE routings;
    --profile FILE over everything."""
    other = _other(model, tmp_path / "other")  # no shipped profile in profiles/ matches it
    stats = tmp_path / "stats.json"

    def chat(*extra: str) -> tuple[str, dict]:
        r = tqbench(capsys, monkeypatch, "chat", "--model", other, "--no-chat-template", "--prompt", P1,
                    "--max-tokens", "2", "--cache-budget-gb", SMALL_BUDGET, "--stats-json", stats, *extra)
        assert r.code == 0, r.err
        line = next(x for x in r.err.splitlines() if x.startswith("hot-expert profile: "))
        return line, json.loads(stats.read_text())

    line, st = chat()
    assert line == "hot-expert profile: none yet; learning from this session"
    assert st["profile"]["source"] == "none" and st["pinned"] == 0 and st["preload_bytes"] == 0
    learned = _stored(other).routings
    assert 0 < learned < MATURE
    line, st = chat("--no-learn")
    assert st["profile"]["source"] == "none" and line.endswith("not learning (--no-learn)")

    _export(other, capsys, monkeypatch, other / "tqbench-profile.json")
    line, st = chat("--no-learn")
    assert st["profile"]["source"] == "shipped" and st["profile"]["where"] == str(other / "tqbench-profile.json")
    pins = int(SHIPPED_PIN_SHARE * st["slots"])  # a shipped profile's default share of the cache's slots
    assert pins > 0 and st["pinned"] == pins and st["preload_bytes"] > 0
    assert line.startswith(f"hot-expert profile: shipped ({other / 'tqbench-profile.json'}); pinned {pins} experts")

    # a mature learned profile: this one, weighted up past MATURE and imported
    big = tmp_path / "big.json"
    r = tqbench(capsys, monkeypatch, "profile", "merge", other / "tqbench-profile.json",
                other / "tqbench-profile.json", "-o", big, "--weight-a", str(MATURE), "--weight-b", "0")
    assert r.code == 0, r.err
    assert tqbench(capsys, monkeypatch, "profile", "import", big, "--model", other).code == 0
    line, st = chat("--no-learn")
    assert st["profile"]["source"] == "learned" and st["profile"]["routings"] == round(MATURE * learned)
    # one's own profile pins a larger share: as many experts as it counted, up to PIN_SHARE of the slots
    counted = sum(int((c > 0).sum()) for c in _stored(other).counts().values())
    own = min(int(PIN_SHARE * st["slots"]), counted)
    assert own > pins and st["pinned"] == own
    assert line.startswith(f"hot-expert profile: learned ({round(MATURE * learned):,} routings); pinned {own}")

    line, st = chat("--no-learn", "--profile", str(other / "tqbench-profile.json"))
    assert st["profile"]["source"] == "file" and line.startswith(
        f"hot-expert profile: from {other / 'tqbench-profile.json'}; pinned {own}")

    line, st = chat("--no-learn", "--cold")  # a mature learned and a shipped profile exist: --cold uses neither
    assert st["profile"]["source"] == "none" and st["pinned"] == 0 and st["preload_bytes"] == 0
    assert line == "hot-expert profile: none (--cold); not learning (--no-learn)"
    r = tqbench(capsys, monkeypatch, "chat", "--model", other, "--prompt", "x", "--cold", "--profile",
                other / "tqbench-profile.json")
    assert r.code == 2 and r.err == "tqbench: error: --cold starts from no profile: leave out --profile\n"


SHIPPED = shipped_profiles() / "demo-tq4.json"


@pytest.mark.skipif(not SHIPPED.is_file(), reason="profiles/demo-tq4.json is not there yet: make it with python "
                                                  "scripts/make_demo_profile.py")
def test_the_demo_ships_a_profile_a_fresh_conversion_picks(model, capsys, monkeypatch):
    """profiles/demo-tq4.json (scripts/make_demo_profile.py) is chosen for a fresh tq4 conversion of the demo when
    nothing is learned: from the source tree here (an editable install reads the same folder; tests/test_wheel.py
    checks the wheel)."""
    store = ProfileStore()
    c = choose(model, store=store)
    store.close()
    assert c.source == "shipped", ("profiles/demo-tq4.json does not match a fresh tq4 conversion of the demo: rerun "
                                   "python scripts/make_demo_profile.py")
    assert Path(c.where) == SHIPPED and c.profile.routings >= MATURE
    doc = json.loads(Path(c.where).read_text())
    assert doc["fingerprint"] == identify(model)[0] and doc["made_by"]["command"].startswith("python scripts/")
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", model)
    assert r.code == 0 and f"chat     starts from the shipped profile ({c.where})" in r.out


# ---- warm start -------------------------------------------------------------------------------------------------

@pytest.mark.slow  # four streamed loads and a learning session (~7 s)
def test_a_warm_start_hits_more_at_a_small_budget_and_keeps_the_output(model, tmp_path):
    """At a small budget: cold (no pins) vs warm (the profile a previous session on the same work learned, half the
    slots pinned and preloaded). Same tokens as resident both times; the same expert uses, more of them hits;
    misses and critical bytes exclude the preload, which is reported apart."""
    def run(budget, **opts):
        s = ChatSession()
        try:
            with s.open(ChatRequest(model=str(model), chat_template=False, stream=StreamRequest(budget=budget),
                                    profile=ProfileOptions(**opts))) as job:
                loaded = job.result()[-1]
            with s.reply(P2, Sampling(max_tokens=32)) as job:
                text = job.result()[-1].text
            stats = s.stats()
            return text, (stats.to_dict() if stats else None), loaded.profile.to_dict()
        finally:
            s.close()

    resident, _, _ = run("off", store=str(tmp_path / "store"))  # the previous session on this work, learning
    cold_text, cold, info = run(SMALL_BUDGET, learn=False, pin_share=0.0)
    assert info["pinned"] == 0 and cold["preload_bytes"] == 0
    warm_text, warm, info = run(SMALL_BUDGET, learn=False, store=str(tmp_path / "store"), mature=1,
                                pin_share=0.5)
    assert info["source"] == "learned" and info["pinned"] == warm["pinned"] == int(0.5 * warm["slots"]) > 0
    assert cold_text == warm_text == resident

    expert = warm["slot_bytes"] // warm["slots"]
    assert warm["hits"] + warm["misses"] == cold["hits"] + cold["misses"]  # the same routing, the preload apart
    assert warm["hits_pinned"] > 0 and warm["hit_rate"] > cold["hit_rate"] + 0.03
    assert warm["preload_bytes"] == warm["pinned"] * expert
    for st in (cold, warm):
        assert st["critical_bytes"] == st["misses"] * expert


# ---- engine figures: coverage, merge, diff ---------------------------------------------------------------------------

def _synthetic(rows: dict[int, list[float]], fp: str = "f" * 16) -> Profile:
    from tqbench.profile import Geometry

    geo = Geometry(model_type="kimi_k3", layers=tuple(sorted(rows)), experts=8, top_k=2)
    p = Profile.empty(fp, geo)
    for n, r in rows.items():
        p.decode[n] = np.array(r, dtype=float)
    p.routings = float(sum(sum(r) for r in rows.values()))
    return p


def test_coverage_merge_and_diff_figures():
    a = _synthetic({1: [50, 30, 10, 10, 0, 0, 0, 0], 2: [0, 0, 0, 0, 0, 0, 0, 0]})
    b = _synthetic({1: [0, 30, 50, 10, 10, 0, 0, 0], 2: [0, 0, 0, 0, 0, 0, 0, 8]})
    assert [a.coverage(1, s) for s in (0.5, 0.8, 0.9, 1.0)] == [1, 2, 3, 4]
    assert hot_set(a, 1) == {0, 1} and hot_set(b, 1) == {2, 1} and hot_set(a, 2) == set()
    d = diff(a, b)
    one, two = d.layers
    assert (one.common, one.jaccard) == (1, round(1 / 3, 4))
    assert one.a_covers_b == 0.3 and one.b_covers_a == 0.4  # b's 30 on {0, 1}; a's 30 + 10 on {1, 2}
    assert two.jaccard == 0.0 and two.a_covers_b == 0.0 and two.b_covers_a is None
    assert d.overall.jaccard == 0.25 and d.overall.mean_jaccard == round((1 / 3 + 0) / 2, 4)
    assert diff(a, a).overall.jaccard == 1.0

    report = coverage_report(summary(a, top=2))  # the rows `tqbench profile show` and the TUI both show
    assert report.columns == ("layer", "decode", "prefill", "used", "50%", "80%", "90%")
    one, two, total = report.rows
    assert (one.label, one.decode, one.experts_used, one.coverage, one.hottest) == ("1", "100", 4, (1, 2, 3),
                                                                                   "0 50.0%, 1 30.0%")
    assert two.hottest == "-" and two.coverage == (0, 0, 0) and one.section_end is not two.section_end
    assert (total.label, total.experts_used, total.coverage, total.hottest) == ("all", 4, (1, 2, 3), "of 16 experts")
    assert [number(x) for x in (12.5, 1234.0, 150.4, 0.0)] == ["12.5", "1,234", "150", "0"]

    c = merge(a, b, 2.0, 0.5)
    np.testing.assert_array_equal(c.decode[1], 2 * a.decode[1] + 0.5 * b.decode[1])
    assert c.routings == 2 * a.routings + 0.5 * b.routings and c.fingerprint == a.fingerprint

    from tqbench.profile import ProfileError

    with pytest.raises(ProfileError, match="different models"):
        merge(a, _synthetic({1: [1] * 8, 2: [1] * 8}, fp="0" * 16))
    assert merge(a, _synthetic({1: [1] * 8, 2: [1] * 8}, fp="0" * 16), force=True).fingerprint == a.fingerprint
    with pytest.raises(ProfileError, match="different geometry"):
        diff(a, _synthetic({1: [1] * 8}))
    with pytest.raises(ProfileError, match="non-negative"):
        merge(a, b, -1.0)


@pytest.mark.slow  # a learning session and a dozen profile commands (~6 s)
def test_show_export_merge_diff_reset_commands(model, tmp_path, capsys, monkeypatch):
    model = _other(model, tmp_path / "other")  # no shipped profile: the chat starts cold until MATURE
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", model)
    assert r.code == 0 and r.out.splitlines()[1:] == ["profile  none yet: chat sessions learn one (unless --no-learn)",
                                                      "chat     starts cold (no profile)"]
    _learn(model, P1, 8)
    learned = _stored(model)
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", model, "--json")
    doc = json.loads(r.out)
    assert list(doc) == ["model", "source", "where", "chat", "mature_at", "warnings", "fingerprint", "geometry",
                         "routings", "sessions", "decode", "prefill", "coverage", "experts", "layers"]
    assert list(doc["layers"][0]) == ["layer", "decode", "prefill", "experts_used", "top", "coverage"]
    assert doc["source"] == "learned" and doc["chat"]["source"] == "none" and doc["sessions"] == 1
    assert [x["coverage"]["80"] for x in doc["layers"]] == [learned.coverage(n, 0.8) for n in learned.geometry.layers]
    assert doc["coverage"]["80"] == sum(x["coverage"]["80"] for x in doc["layers"])
    r = tqbench(capsys, monkeypatch, "profile", "show", "--model", model)  # plain lines when piped
    assert r.out.splitlines()[0].startswith(f"model    {model} (kimi_k3: {L} MoE layers x {E} experts, top-{K};")
    assert "the learned profile takes over at 20,000 routings" in r.out
    assert re.search(r"^\s+1\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+ \d+\.\d%", r.out, re.M)

    exported = _export(model, capsys, monkeypatch, tmp_path / "a.json")
    assert exported["schema"] == SCHEMA and exported["pins"][0] == list(learned.ranked()[0])
    assert len(exported["pins"]) == len(learned.ranked())
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", model)  # stdout
    assert json.loads(r.out) == exported and not list(tmp_path.glob("*.partial"))

    r = tqbench(capsys, monkeypatch, "profile", "merge", tmp_path / "a.json", tmp_path / "a.json", "-o",
                tmp_path / "c.json", "--weight-a", "1", "--weight-b", "2")
    assert r.code == 0
    np.testing.assert_allclose(_array(read_profile(tmp_path / "c.json")), 3 * _array(learned), atol=1e-3)
    r = tqbench(capsys, monkeypatch, "profile", "diff", tmp_path / "a.json", tmp_path / "c.json", "--json")
    compared = json.loads(r.out)
    assert list(compared) == ["share", "a", "b", "same_model", "layers", "overall"]
    assert compared["overall"]["jaccard"] == 1.0
    assert compared["a"] == {"fingerprint": learned.fingerprint, "routings": round(learned.routings, 3),
                             "file": str(tmp_path / "a.json")}
    _learn(model, P2, 8)
    _export(model, capsys, monkeypatch, tmp_path / "b.json")
    r = tqbench(capsys, monkeypatch, "profile", "diff", tmp_path / "a.json", tmp_path / "b.json")
    assert r.code == 0 and r.out.splitlines()[-2].startswith("  all ") and len(r.out.splitlines()) == 2 + 1 + 1 + 7 + 2

    r = tqbench(capsys, monkeypatch, "profile", "reset", "--model", model)
    assert r.code == 0 and "forgot the learned profile" in r.err and _stored(model).routings == 0
    r = tqbench(capsys, monkeypatch, "profile", "export", "--model", model)
    assert r.code == 1 and "no learned profile for this model yet" in r.err and r.err.count("\n") == 1


# ---- a malformed profile file: one line naming the field -------------------------------------------------------------

def _good_doc(model: Path) -> dict:
    """A profile document of ours for `model`, counts in every layer."""
    fp, geo = identify(model)
    p = Profile.empty(fp, geo)
    for n in geo.layers:
        p.decode[n][:] = np.arange(geo.experts)
    p.routings, p.sessions = float(sum(a.sum() for a in p.decode.values())), 3
    return p.to_dict()


def _without(doc: dict, *keys: str) -> dict:
    out = json.loads(json.dumps(doc))
    inner = out
    for k in keys[:-1]:
        inner = inner[k]
    del inner[keys[-1]]
    return out


def _with(doc: dict, value, *keys: str) -> dict:
    out = json.loads(json.dumps(doc))
    inner = out
    for k in keys[:-1]:
        inner = inner[k]
    inner[keys[-1]] = value
    return out


MALFORMED = {  # file name: (how the good document is spoiled, what the error line says after "FILE: ")
    "no-fingerprint": (lambda d: _without(d, "fingerprint"), 'malformed profile: no "fingerprint" field'),
    "no-layers": (lambda d: _without(d, "model", "layers"), 'malformed profile: no "model.layers" field'),
    "no-experts": (lambda d: _without(d, "model", "experts"), 'malformed profile: no "model.experts" field'),
    "no-model-type": (lambda d: _without(d, "model", "model_type"), 'malformed profile: no "model.model_type" field'),
    "no-counts": (lambda d: _without(d, "counts"), 'malformed profile: no "counts" field'),
    "no-prefill": (lambda d: _without(d, "counts", "prefill"), 'malformed profile: no "counts.prefill" field'),
    "no-routings": (lambda d: _without(d, "routings"), 'malformed profile: no "routings" field'),
    "experts-text": (lambda d: _with(d, "64", "model", "experts"),
                     'malformed profile: "model.experts" is not a positive whole number'),
    "experts-huge": (lambda d: _with(d, 10 ** 12, "model", "experts"),
                     'malformed profile: "model.experts" is 1,000,000,000,000, more than any model has (1,048,576 at '
                     'most)'),
    "layers-number": (lambda d: _with(d, 7, "model", "layers"),
                      'malformed profile: "model.layers" is not a list of distinct layer numbers'),
    "top-k-null": (lambda d: _with(d, None, "model", "top_k"),
                   'malformed profile: "model.top_k" is not a non-negative whole number'),
    "fingerprint-number": (lambda d: _with(d, 12, "fingerprint"), 'malformed profile: "fingerprint" is not a string'),
    "decode-list": (lambda d: _with(d, [], "counts", "decode"), 'malformed profile: "counts.decode" is not an object'),
    "decode-key": (lambda d: _with(d, {"x": [0] * E}, "counts", "decode"),
                   'malformed profile: "counts.decode" has the key "x", which is no layer number'),
    "decode-text": (lambda d: _with(d, ["a"] * E, "counts", "decode", "1"),
                    f"layer 1 decode counts: expected {E} non-negative numbers"),
    "routings-text": (lambda d: _with(d, "many", "routings"), 'routings "many": expected a non-negative number'),
    "sessions-negative": (lambda d: _with(d, -1, "sessions"),
                          'malformed profile: "sessions" is not a non-negative whole number'),
    "usage-experts-text": (lambda d: {"version": 1, "num_experts": str(E), "counts": {"1": [1] * E}},
                           'malformed usage profile: "num_experts" is not a positive whole number'),
    "usage-routings-text": (lambda d: {"version": 1, "num_experts": E, "routings": "x", "counts": {"1": [1] * E}},
                            'malformed usage profile: "routings" is not a non-negative number'),
    "pin-half": (lambda d: {"pin": [[1, 2.5]]}, "pin 0: [1, 2.5] is not [layer, expert]"),
}


@pytest.mark.slow  # a dozen `profile import` and `profile diff` runs, each import fingerprinting the model (~6 s)
def test_a_malformed_profile_names_what_is_wrong_in_one_line(model, tmp_path, capsys, monkeypatch):
    """`profile import` (and `diff`, which reads a file on its own): each spoiled field is named in the one error line,
    never a KeyError/TypeError/ValueError, and the learned profile stays as it was."""
    good = _good_doc(model)
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert tqbench(capsys, monkeypatch, "profile", "import", tmp_path / "good.json", "--model", model).code == 0
    before = _array(_stored(model))
    for name, (spoil, why) in MALFORMED.items():
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(spoil(good)))
        r = tqbench(capsys, monkeypatch, "profile", "import", f, "--model", model)
        assert (r.code, r.out, r.err) == (1, "", f"tqbench: error: {f}: {why}\n"), name
        if "usage" not in name and "pin" not in name:  # ours: the same line where a file is read on its own
            r = tqbench(capsys, monkeypatch, "profile", "diff", f, tmp_path / "good.json")
            assert (r.code, r.out, r.err) == (1, "", f"tqbench: error: {f}: {why}\n"), name
    np.testing.assert_array_equal(_array(_stored(model)), before)  # nothing replaced the learned profile
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["good.json", *(f"{n}.json" for n in MALFORMED)])


def test_chat_with_a_malformed_profile_file_says_which_field(model, tmp_path, capsys, monkeypatch):
    """`chat --profile FILE` reads the file as import does: the same line, before anything is learned."""
    for name in ("no-routings", "experts-text"):
        spoil, why = MALFORMED[name]
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(spoil(_good_doc(model))))
        r = tqbench(capsys, monkeypatch, "chat", "--model", model, "--prompt", "x", "--max-tokens", "1", "--profile", f)
        assert r.code == 1 and "Traceback" not in r.err and r.out == "", r.err
        assert r.err.splitlines()[-1] == f"tqbench: error: {f}: {why}"
        assert _stored(model).routings == 0  # the chat did not run, so learned nothing


def test_an_overviews_stamp_changes_with_the_store_and_the_file(model, tmp_path):
    """profile_stamp reads again what an overview was read from: equal while nothing changed, different once a
    session commits (another process's save, as here through the real store) or the file shown is rewritten."""
    from tqbench.profile import overview, profile_stamp

    shown = overview(model)
    assert shown.stamp == profile_stamp(shown) == profile_stamp(shown)  # nothing changed: no reload
    fp, geo = identify(model)
    delta = Profile.empty(fp, geo)
    delta.decode[geo.layers[0]][3] = 5
    delta.routings = 5.0
    store = ProfileStore()
    try:
        store.commit(delta, first=True)
    finally:
        store.close()
    assert profile_stamp(shown) != shown.stamp and profile_stamp(shown).learned == (5.0, 1)
    again = overview(model)
    assert again.stamp == profile_stamp(again) and again.summary.routings == 5.0

    f = tmp_path / "hot.json"
    f.write_text(_stored(model).to_text())
    with_file = overview(model, file=f)
    assert with_file.stamp == profile_stamp(with_file)
    f.write_text(_stored(model).to_text() + "\n")  # the same profile, rewritten
    assert profile_stamp(with_file).file != with_file.stamp.file
    assert profile_stamp(with_file).learned == with_file.stamp.learned

"""Several ranks on loopback (MLX's ring backend), started by `mlx.launch` as a user would: each rank holds its
pipeline layers, streams its own experts, and the greedy tokens are one process's; a rank killed mid-reply ends every
rank within seconds; a rank that cannot load is one line on rank 0 naming it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import demo_tq4

pytestmark = pytest.mark.slow  # each run starts two or three processes that load the demo (~10-30 s on 2 cores)

BIN = Path(sys.executable).parent
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("dist"))


def free_port(count: int) -> int:
    """A port with `count` free ones from it (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def chat_args(model: Path, *extra: str) -> list[str]:
    return ["chat", "--model", str(model), "--prompt", PROMPT, "--no-learn", "--json", *extra]


def token_ids(stdout: str) -> list[int]:
    return [e["id"] for e in map(json.loads, stdout.splitlines()) if e["event"] == "token"]


def launch(n: int, args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(n), "--starting-port",
                             str(free_port(n)), str(BIN / "tqbench"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture(scope="module")
def one_process(model) -> list[int]:
    p = subprocess.run([str(BIN / "tqbench"), *chat_args(model, "--max-tokens", "16")], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    ids = token_ids(p.stdout)
    assert len(ids) == 16
    return ids


@pytest.mark.parametrize("ranks, budget", [(2, None), (3, "200KB")])
def test_ranks_give_one_process_greedy_tokens(model, one_process, ranks, budget, tmp_path):
    """Two resident ranks, and three ranks each streaming its own layers' experts through a small cache: the same
    greedy tokens as one resident process, printed once (rank 0 is the only face), and rank 0's --stats-json has
    every rank's streaming figures."""
    stats = tmp_path / "stats.json"
    extra = ["--max-tokens", "16"] + (["--cache-budget-gb", budget, "--stats-json", str(stats)] if budget else [])
    p = launch(ranks, chat_args(model, *extra))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert token_ids(out) == one_process
    assert sum(json.loads(line)["event"] == "done" for line in out.splitlines()) == 1  # one face
    if budget:
        doc = json.loads(stats.read_text())
        by_rank = doc["ranks"]
        assert [r["rank"] for r in by_rank] == list(range(ranks))
        # contiguous layers, rank 0 the last ones (mlx-lm's split), together every layer of the model
        spans = sorted(tuple(r["layers"]) for r in by_rank)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert by_rank[0]["layers"][1] == spans[-1][1]
        # rank 0's own figures are the document's; every streaming rank ran the same forward passes
        assert {k: by_rank[0][k] for k in ("misses", "critical_bytes", "tokens")} == {
            k: doc[k] for k in ("misses", "critical_bytes", "tokens")}
        assert len({r["tokens"] for r in by_rank if r["streamed"]}) == 1 and doc["tokens"] > 0


def test_a_rank_killed_mid_reply_ends_every_rank_within_10_s(model):
    p = launch(2, chat_args(model, "--max-tokens", "100000"), start_new_session=True)
    try:
        tokens = 0
        for line in p.stdout:  # rank 0 prints each token as it comes (a pipe: in blocks)
            tokens += json.loads(line)["event"] == "token"
            if tokens >= 8:  # both ranks are well into the reply
                break
        rank1 = _rank_pid(1, p.pid)
        assert tokens >= 8 and rank1 is not None
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "rank 1 exited with code -9" in err  # the launcher names the rank that died
    lines = [ln for ln in err.splitlines() if ln.startswith("tqbench: error:")]
    assert len(lines) == 1 and lines[0].startswith("tqbench: error: rank 0")  # rank 0 says why it stopped
    assert _rank_pid(0, p.pid) is None


def _rank_pid(rank: int, launcher: int) -> int | None:
    """The pid of the launched process of `rank` (its environment says MLX_RANK), among the launcher's descendants."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == launcher:
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env and b"tqbench" in cmd and b"chat" in cmd:
            return int(d.name)
    return None


def test_a_rank_that_cannot_load_is_one_line_on_rank_0(model, tmp_path):
    """Two ranks started by hand from one hosts file, rank 1 given a model that is not there: rank 0 loads, then
    both stop, rank 0 with one line naming rank 1 and its cause, rank 1 with nothing printed."""
    port = free_port(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = dict(os.environ, MLX_HOSTFILE=str(hosts))
    missing = tmp_path / "nowhere"
    procs = [subprocess.Popen([str(BIN / "tqbench"), *chat_args(m, "--max-tokens", "4")],
                              env=dict(env, MLX_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r, m in ((1, missing), (0, model))]
    (out1, err1), (out0, err0) = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == 1 and procs[0].returncode != 0  # rank 0, rank 1
    assert out1 == err1 == "" and out0 == ""
    assert err0.splitlines()[-1] == f"tqbench: error: rank 1 of 2 failed to load: {missing}: no such model directory"
    assert sum(ln.startswith("tqbench: error:") for ln in err0.splitlines()) == 1

"""Several ranks on loopback (MLX's ring backend), started by `mlx.launch` as a user would: each rank holds its
pipeline layers, streams its own experts, and the greedy tokens are one process's; a rank killed mid-reply ends every
rank within seconds; a rank that cannot load is one line on rank 0 naming it. Rank 0 shares each turn (typed chat
lines, a server's requests) and the other ranks follow it, stopping at the token where rank 0 stops; eval takes part
on every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

import pytest

from conftest import demo_tq4
from model_helpers import free_port

pytestmark = pytest.mark.slow  # each run starts two or three processes that load the demo (~10-30 s on 2 cores)

BIN = Path(sys.executable).parent
PROMPT = "def fib(n):"
SECOND = "class Stack:"
N = 16  # tokens per reply where replies are compared


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return demo_tq4(tmp_path_factory.mktemp("dist"))


def chat_args(model: Path, *extra: str) -> list[str]:
    return ["chat", "--model", str(model), "--prompt", PROMPT, "--no-learn", "--json", *extra]


def token_ids(stdout: str) -> list[int]:
    return [e["id"] for e in map(json.loads, stdout.splitlines()) if e["event"] == "token"]


def launch(n: int, args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(n), "--starting-port",
                             str(free_port(n)), str(BIN / "tqbench"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def replies(stdout: str) -> list[dict]:
    """Each reply of `chat --json`: its summary, with its token ids and text."""
    out, ids, text = [], [], []
    for ev in map(json.loads, stdout.splitlines()):
        if ev["event"] == "token":
            ids.append(ev["id"])
            text.append(ev["text"])
        elif ev["event"] == "done":
            out.append({**ev, "ids": ids, "text": "".join(text)})
            ids, text = [], []
    return out


@pytest.fixture(scope="module")
def two_turns(model, tmp_path_factory) -> tuple[list[dict], dict]:
    """One process, two piped turns streaming through a small cache: its replies and its --stats-json."""
    stats = tmp_path_factory.mktemp("one") / "stats.json"
    p = subprocess.run([str(BIN / "tqbench"), "chat", "--model", str(model), "--no-learn", "--json", "--max-tokens",
                        str(N), "--cache-budget-gb", "200KB", "--stats-json", str(stats)],
                       input=f"{PROMPT}\n{SECOND}\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = replies(p.stdout)
    assert [r["generated_tokens"] for r in got] == [N, N] and got[1]["cached_tokens"] > 0
    return got, json.loads(stats.read_text())


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


def raw_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def _drain(stream, into: list[str]) -> threading.Thread:
    t = threading.Thread(target=lambda: into.extend(line.rstrip("\n") for line in stream), daemon=True)
    t.start()
    return t


def test_typed_turns_reach_every_rank_and_ctrl_c_stops_them_at_one_token(model, two_turns, tmp_path):
    """Turns typed into `mlx.launch` reach rank 0, which shares each with rank 1: the first reply is one process's,
    /stats shows each rank in step, the second reply continues the cached conversation as one process does. Ctrl-C,
    as a terminal sends it to the launcher and every rank, stops that reply on both ranks at the same forward pass,
    and every process leaves."""
    (one1, one2), one_stats = two_turns
    stats = tmp_path / "stats.json"
    p = launch(2, ["chat", "--model", str(model), "--no-learn", "--json", "--max-tokens", str(N), "--cache-budget-gb",
                   "200KB", "--stats-json", str(stats)], stdin=subprocess.PIPE, start_new_session=True)
    err: list[str] = []
    _drain(p.stderr, err)
    try:
        p.stdin.write(f"{PROMPT}\n/stats\n{SECOND}\n")  # the pipe stays open: a terminal's input has no end
        p.stdin.flush()
        done, ids = [], [[]]
        for line in p.stdout:
            ev = json.loads(line)
            if ev["event"] == "done":
                done.append(ev)
                ids.append([])
            elif ev["event"] == "token":
                ids[-1].append(ev["id"])
                if done and len(ids[-1]) >= 4:  # well into the second reply
                    break
        first, second = ids[0], ids[1]
        assert done[0]["generated_tokens"] == N
        assert first == one1["ids"] and second == one2["ids"][:len(second)]
        os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher and every rank get it
        t0 = time.monotonic()
        p.wait(timeout=30)
        while _rank_pid(0, p.pid) or _rank_pid(1, p.pid):
            assert time.monotonic() - t0 < 10
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # /stats after the first reply: a line per rank, both in step
    lines = [x for x in err if x.startswith("rank ")]
    assert [x.split(" (")[0] for x in lines] == ["rank 0", "rank 1"], err
    assert len({x.rsplit(" over ", 1)[1] for x in lines}) == 1
    # the second reply stopped on both ranks at the same forward pass, before its end
    ranks = json.loads(stats.read_text())["ranks"]
    passes = {r["tokens"] for r in ranks}
    assert len(passes) == 1 and passes.pop() < one_stats["tokens"]


def test_a_server_on_two_ranks_answers_as_one_process_after_replies_stopped_mid_way(model, two_turns):
    """`tqbench serve` under mlx.launch: rank 0 listens, each request runs on both ranks. A reply cut by a stop
    string, one whose client leaves mid-way, and one cut by max tokens leave the ranks in step: the next request
    answers as one process does, and /metrics shows each rank with the same forward passes. The server stops by
    itself after --max-requests."""
    (one1, one2), _ = two_turns
    p = launch(2, ["serve", "--model", str(model), "--port", "0", "--no-learn", "--cache-budget-gb", "200KB",
                   "--max-requests", "5"], start_new_session=True)
    err: list[str] = []
    drained = _drain(p.stderr, err)
    try:
        t0 = time.monotonic()
        while not any(x.startswith("serving ") for x in err):
            assert p.poll() is None and time.monotonic() - t0 < 120, err
            time.sleep(0.1)
        url = next(x for x in err if x.startswith("serving ")).split(" at ")[1].split("/v1")[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(content: str, **kw):
            return client.chat.completions.create(model="tq4", messages=[{"role": "user", "content": content}],
                                                  temperature=0, **kw)

        full = one1["text"]
        stop = full[len(full) // 3: len(full) // 3 + 3]
        cut = ask(PROMPT, max_tokens=N, stop=[stop])  # 1: a stop string, mid-way
        assert cut.choices[0].message.content == full[:full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        stream = ask(SECOND, max_tokens=1000, stream=True)  # 2: the client leaves after a few tokens
        for i, _ in enumerate(stream):
            if i >= 3:
                break
        stream.close()
        short = ask(PROMPT, max_tokens=5)  # 3: max tokens
        assert short.choices[0].finish_reason == "length" and full.startswith(short.choices[0].message.content)
        whole = ask(PROMPT, max_tokens=N)  # 4: one process's reply
        assert whole.choices[0].message.content == full and whole.usage.completion_tokens == N
        metrics = raw_get(url + "/metrics")
        passes = {m: float(v) for m, v in (x.split(" ") for x in metrics.splitlines()
                                           if x.startswith("tqbench_rank_forward_passes_total{"))}
        assert sorted(passes) == ['tqbench_rank_forward_passes_total{rank="0"}',
                                  'tqbench_rank_forward_passes_total{rank="1"}']
        assert len(set(passes.values())) == 1
        status = json.loads(raw_get(url + "/tqbench/status"))
        assert [r["rank"] for r in status["ranks"]] == [0, 1]
        turn2 = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": full},
                 {"role": "user", "content": SECOND}]  # 5: the conversation goes on, from the prompt cache
        r = client.chat.completions.create(model="tq4", messages=turn2, temperature=0, max_tokens=N)
        assert r.choices[0].message.content == one2["text"]
        assert r.usage.prompt_tokens_details.cached_tokens == one2["cached_tokens"]
        assert p.wait(timeout=60) == 0  # five completions: it stopped by itself, and rank 1 with it
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    drained.join(5)
    assert any(x.startswith("requests 5 (4 ok, 1 cancelled") for x in err), err


def test_eval_on_two_ranks_gives_one_process_numbers(model, tmp_path):
    """`tqbench eval` under mlx.launch: both ranks hold their layers of both models and take part in every pass;
    rank 0 alone prints, and its --json has one process's perplexity, KL, agreement and greedy agreement."""
    from tqbench.demo import ensure_demo

    args = ["eval", str(model), "--against", str(ensure_demo()), "--window", "16", "--tokens", "32", "--prompts", "1",
            "--generate", "3", "--json"]
    one = subprocess.run([str(BIN / "tqbench"), *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    p = launch(2, args, stdin=subprocess.DEVNULL)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    a, b = json.loads(one.stdout), json.loads(out)  # one document: rank 1 printed nothing
    for doc in (a, b):
        del doc["seconds"], doc["model_bytes"]  # the time, and the weights rank 0 holds (its layers)
    # both ran the greedy comparison (whether 3 greedy tokens agree is the model's business, not the launch's)
    assert b == a and a["greedy"]["generated"] == 3 and a["greedy"]["prompts"] == 1
    assert sum(ln.startswith("evaluating ") for ln in err.splitlines()) == 1

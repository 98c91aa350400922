"""`tqbench serve`: a real server process on 127.0.0.1 driven by the official `openai` client (and raw HTTP for what
a client library would never send), against the demo checkpoint as published (it runs without a conversion)."""

from __future__ import annotations

import http.client
import json
from dataclasses import replace
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import openai
import pytest

from tqbench.demo import ensure_demo

KEY = "sk-tqbench-test"
U1, U2 = "def fibonacci(n):", "class Stack:"
N = 24  # tokens per reply in the comparisons
# A CUDA server's first request compiles MLX's kernels (over a minute on a cold H100: test_serve's first request timed
# out at 60 s there); on the CPU a minute is already generous.
CLIENT_TIMEOUT = 60 if mx.default_device().type == mx.cpu else 600


class Served:
    """A `tqbench serve` process: its URL, its stderr lines (drained by a thread), its client."""

    def __init__(self, model: Path, cache: Path, *args: str, key: str | None = KEY) -> None:
        env = dict(os.environ, TQBENCH_CACHE_DIR=str(cache))
        cmd = [sys.executable, "-m", "tqbench", "serve", "-m", str(model), "--port", "0", *args]
        if key:
            cmd += ["--api-key", key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("serving "):
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(120) or self.proc.poll() is not None:
            raise AssertionError("the server did not start:\n" + "\n".join(self.lines))
        serving = next(x for x in self.lines if x.startswith("serving "))
        self.url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", serving).group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0,
                                    timeout=CLIENT_TIMEOUT)

    def get(self, path: str, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
        return raw(self.port, "GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})

    def status(self) -> dict:
        return json.loads(self.get("/tqbench/status")[2])

    def rss(self) -> int:
        return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{self.proc.pid}/status").read_text()).group(1)) * 1024

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


def raw(port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        length: bool = True) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        if length:
            conn.request(method, path, body=body, headers=headers or {})
        else:  # no Content-Length: what a client library never sends
            conn.putrequest(method, path)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^tqbench_{re.escape(name)} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TQBENCH_CACHE_DIR", str(root / "cache"))
        return Path(shutil.copytree(ensure_demo(), root / "demo"))


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    s = Served(demo, tmp_path_factory.mktemp("served-cache"), "--max-queue", "16")
    yield s
    assert s.stop() == 130, "\n".join(s.lines)  # Ctrl-C: 130, as every command interrupted


@pytest.fixture(scope="module")
def cli_replies(demo, tmp_path_factory) -> list[dict]:
    """`tqbench chat --json` over the same two turns: each reply's text and summary."""
    env = dict(os.environ, TQBENCH_CACHE_DIR=str(tmp_path_factory.mktemp("chat-cache")))
    out = subprocess.run([sys.executable, "-m", "tqbench", "chat", "-m", str(demo), "--json", "--no-learn",
                          "--max-tokens", str(N)], input=f"{U1}\n{U2}\n", capture_output=True, text=True, env=env,
                         check=True).stdout
    replies, text = [], []
    for line in out.splitlines():
        ev = json.loads(line)
        if ev["event"] == "token":
            text.append(ev["text"])
        elif ev["event"] == "done":
            replies.append({**ev, "text": "".join(text)})
            text = []
    return replies


def ask(server: Served, messages: list[dict], **kw):
    return server.client.chat.completions.create(model="demo", messages=messages, temperature=0, **kw)


# ---- answers --------------------------------------------------------------------------------------------------------

def test_greedy_replies_equal_chat_cli_and_turn_two_reuses_the_prompt_cache(server, cli_replies):
    r1 = ask(server, [{"role": "user", "content": U1}], max_tokens=N)
    assert r1.choices[0].message.content == cli_replies[0]["text"]
    assert r1.usage.prompt_tokens == cli_replies[0]["prompt_tokens"]
    assert r1.usage.completion_tokens == cli_replies[0]["generated_tokens"]
    assert r1.choices[0].finish_reason == cli_replies[0]["finish_reason"]
    assert r1.model == "demo" and r1.object == "chat.completion"
    turn2 = [{"role": "user", "content": U1}, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": U2}]
    r2 = ask(server, turn2, max_completion_tokens=N)
    assert r2.choices[0].message.content == cli_replies[1]["text"]
    # the conversation so far came from the cache, as it does in the CLI's chat
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached == cli_replies[1]["cached_tokens"] > r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens == cached + cli_replies[1]["prompt_tokens"]
    assert r2.usage.total_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens


def test_streaming_gives_the_same_text_and_usage(server):
    messages = [{"role": "user", "content": U1}]
    whole = ask(server, messages, max_tokens=N)
    chunks = list(ask(server, messages, max_tokens=N, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_logprobs_are_the_models_own_and_stream_as_they_come(server, demo):
    """Each generated token's log-probability and its 3 likeliest alternatives, as OpenAI gives them, equal the
    model's log-softmax computed independently (mlx-lm's model run here over the prompt and the tokens); streamed,
    the same entries arrive with the chunks; the completions endpoint gives its legacy form."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import make_prompt_cache

    messages = [{"role": "user", "content": U1}]
    r = ask(server, messages, max_tokens=N, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    assert len(entries) == r.usage.completion_tokens and r.choices[0].finish_reason == "length"
    model, tok = mlx_load(str(demo))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = [tok.encode(e.token, add_special_tokens=False) for e in entries]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]
    # mlx-lm's model run here as generation runs it (the prompt but its last token, then one token a pass through a
    # KV cache), each position's log-softmax in the model's dtype, as mlx-lm computes it
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    expected = []
    for t in [prompt[-1]] + ids[:-1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        expected.append((logits - mx.logsumexp(logits, keepdims=True)).astype(mx.float32).tolist())
    for e, i, row in zip(entries, ids, expected):
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(row[i], abs=1e-6)
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest token is the one generated
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(sorted(row, reverse=True)[:3], abs=1e-6)
    chunks = list(ask(server, messages, max_tokens=N, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    t = server.client.completions.create(model="demo", prompt=U1, max_tokens=N, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert "".join(lp.tokens) == t.choices[0].text and len(lp.token_logprobs) == len(lp.tokens) == N
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(N)]
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(p) for top, p in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    plain = ask(server, messages, max_tokens=N)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_stop_sequences_end_the_text_where_they_begin(server, cli_replies):
    full = cli_replies[0]["text"]
    stop = full[len(full) // 3: len(full) // 3 + 3]
    cut = full.index(stop)
    r = ask(server, [{"role": "user", "content": U1}], max_tokens=N, stop=[stop, "@@never@@"])
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    streamed = ask(server, [{"role": "user", "content": U1}], max_tokens=N, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:cut]


def test_text_completions_continue_a_plain_prompt_as_the_engine_does(server, demo):
    from tqbench.runtime.conversation import Conversation, Sampling
    from tqbench.runtime.load import load
    from tqbench.engine import engine

    def local() -> str:
        conv = Conversation(loaded=load(demo), chat_template=False)
        return list(conv.reply("import os", Sampling(max_tokens=12)))[-1].text

    expected = engine().call(local)
    r = server.client.completions.create(model="demo", prompt="import os", max_tokens=12, temperature=0)
    assert r.choices[0].text == expected and r.object == "text_completion"
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


def test_tools_the_chat_template_drops_are_refused_with_a_400_that_says_so(server):
    """The demo's template renders no tools: answering as if they were given would mislead the client."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, [{"role": "user", "content": "Weather in Tokyo?"}], max_tokens=8, tools=tools)
    assert e.value.status_code == 400
    assert "chat template does not render tools: it would answer without the 1 tool given" in e.value.message
    r = ask(server, [{"role": "user", "content": "Weather in Tokyo?"}], max_tokens=2)  # the same without tools: fine
    assert r.usage.completion_tokens == 2


# ---- the service around the answers ---------------------------------------------------------------------------------

def test_models_health_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    code, _, body = server.get("/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    assert json.loads(body)["warming_up"] is False  # MLX compiles its kernels in a CUDA server's first request only
    before = server.get("/metrics")[2].decode()
    r = ask(server, [{"role": "user", "content": "x = 1"}], max_tokens=3)
    code, headers, body = server.get("/metrics")
    text = body.decode()
    assert code == 200 and headers["content-type"].startswith("text/plain")
    assert metric(text, 'requests_total{outcome="ok"}') == metric(before, 'requests_total{outcome="ok"}') + 1
    assert metric(text, 'tokens_total{kind="completion"}') == \
        metric(before, 'tokens_total{kind="completion"}') + r.usage.completion_tokens
    assert metric(text, "queue_length") == 0 and metric(text, "decode_tokens_per_second") > 0
    assert "tqbench_expert_hits_total" not in text  # resident experts: no expert cache to report


MALFORMED = [  # (what, method, path, body, headers, status, param)
    ("not JSON", "POST", "/v1/chat/completions", b"{not json", {}, 400, None),
    ("a JSON array", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, None),
    ("no messages", "POST", "/v1/chat/completions", {"model": "demo"}, {}, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
    ("a bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, {}, 400,
     "messages[0].role"),
    ("an image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400,
     "messages[0].content"),
    ("a string temperature", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, {}, 400, "temperature"),
    ("max_tokens 0", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, {}, 400, "max_tokens"),
    ("n=2", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, {}, 400, "n"),
    ("an unknown field", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "frobnicate": True}, {}, 400, "frobnicate"),
    ("five stops", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop"),
    ("no prompt", "POST", "/v1/completions", {"model": "demo"}, {}, 400, "prompt"),
    ("an unknown model", "POST", "/v1/chat/completions",
     {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, {}, 404, "model"),
    ("a body over the limit", "POST", "/v1/chat/completions", b"x" * (5 << 20), {}, 413, None),
    ("no API key", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     {"Authorization": ""}, 401, None),
    ("a wrong API key", "GET", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
    ("an unknown route", "GET", "/v1/embeddings", None, {}, 404, None),
    ("GET on a POST route", "GET", "/v1/chat/completions", None, {}, 405, None),
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server):
    refused = metric(server.get("/metrics")[2].decode(), 'requests_total{outcome="refused"}')
    for what, method, path, body, headers, status, param in MALFORMED:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
        code, _, answer = raw(server.port, method, path, data, h)
        assert code == status, what
        err = json.loads(answer)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
        assert err["param"] == param, what
    code, _, answer = raw(server.port, "POST", "/v1/chat/completions", None, {"Authorization": f"Bearer {KEY}"},
                          length=False)
    assert code == 411 and json.loads(answer)["error"]["message"]
    assert metric(server.get("/metrics")[2].decode(), 'requests_total{outcome="refused"}') == \
        refused + len(MALFORMED) + 1
    assert ask(server, [{"role": "user", "content": U1}], max_tokens=2).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_leaving_mid_stream_stops_its_generation_and_leaks_nothing(server, cli_replies):
    prompt = [{"role": "user", "content": U1}]
    threads = server.threads()
    for _ in range(3):
        before = server.status()
        chunks = 0
        with ask(server, prompt, max_tokens=500, stream=True) as stream:
            for c in stream:
                chunks += bool(c.choices and c.choices[0].delta.content)
                if chunks == 3:
                    break  # leaving the block closes the connection
        deadline = time.monotonic() + 10
        while (st := server.status())["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert st["cancelled"] == before["cancelled"] + 1 and st["running"] == 0 and st["queued"] == 0
        # the generation stopped within a token of the last one the client read (one may be on the wire)
        assert 3 <= st["completion_tokens"] - before["completion_tokens"] <= 5
    r = ask(server, prompt, max_tokens=N)  # the next request runs at once, with the same answer
    assert r.choices[0].message.content == cli_replies[0]["text"]
    time.sleep(0.2)
    assert server.threads() <= threads


@pytest.mark.slow
def test_eight_clients_at_once_lose_nothing_and_memory_stays_flat(server):
    """8 clients x 5 chat requests at once: every one answered, with its greedy text; then 160 short completions to
    warm the completion path, and 160 more with other prompts of the same lengths (360 in all), over which the
    server's resident memory does not grow. The warm burst matters on CUDA: a server's first requests of a shape
    compile MLX's kernels (an H100 server grew 2.4 GiB over its first 80 completions, then 0.6-5.2 MiB per 80)."""
    prompts = [f"def f{i}(x):" for i in range(8)]
    expected = {p: ask(server, [{"role": "user", "content": p}], max_tokens=4).choices[0].message.content
                for p in prompts}
    results: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def client(p: str, n: int, chat: bool, tag: str) -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            for i in range(n):
                if chat:
                    r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": p}],
                                                  max_tokens=4, temperature=0)
                    results.append((p, r.choices[0].message.content))
                else:  # a short plain prompt, a different one each time (the prompt cache keeps turning over)
                    r = c.completions.create(model="demo", prompt=f"{p} {tag} {i}", max_tokens=2, temperature=0)
                    results.append((p, r.choices[0].text if r.usage.completion_tokens == 2 else None))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def burst(n: int, chat: bool, tag: str = "") -> None:
        workers = [threading.Thread(target=client, args=(p, n, chat, tag)) for p in prompts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    ok = server.status()["ok"]
    burst(5, chat=True)
    assert not errors and len(results) == 40 and all(text == expected[p] for p, text in results)
    assert server.status()["ok"] == ok + 40
    burst(20, chat=False, tag="a")
    rss = server.rss()
    burst(20, chat=False, tag="b")
    assert not errors and len(results) == 360 and all(text is not None for _, text in results[40:])
    assert server.status()["ok"] == ok + 360
    grown = server.rss() - rss
    assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 160 requests"


@pytest.mark.slow  # a second server process, streamed (~9 s)
def test_streamed_experts_give_the_resident_text_and_a_full_queue_answers_429(demo, tmp_path, cli_replies):
    """A small expert budget serves the same greedy text as resident experts; with one place in the queue a third
    request gets 429 with Retry-After; the server stops by itself after --max-requests and keeps what it learned."""
    from tqbench.profile import ProfileStore, identify

    cache = tmp_path / "cache"
    s = Served(demo, cache, "--cache-budget-gb", "0.002", "--max-queue", "1", "--max-requests", "3", key=None)
    r = ask(s, [{"role": "user", "content": U1}], max_tokens=N)
    assert r.choices[0].message.content == cli_replies[0]["text"]
    text = s.get("/metrics")[2].decode()
    assert metric(text, "expert_misses_total") > 0 and metric(text, "expert_read_bytes_total") > 0

    stream = ask(s, [{"role": "user", "content": U2}], max_tokens=40, stream=True)
    next(iter(stream))  # running
    waiting = threading.Thread(target=lambda: ask(s, [{"role": "user", "content": "x"}], max_tokens=2))
    waiting.start()
    while s.status()["queued"] < 1:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:
        ask(s, [{"role": "user", "content": "y"}], max_tokens=2)
    assert int(e.value.response.headers["retry-after"]) >= 1
    list(stream)
    waiting.join()
    assert s.proc.wait(60) == 0  # three completions: it stopped by itself
    assert any(x.startswith("requests 3 (3 ok, 1 rejected") for x in s.lines), s.lines

    fp, geo = identify(demo)
    store = ProfileStore(cache / "profiles")
    try:
        assert store.load(fp, geo).routings > 0  # serving kept learning the profile
    finally:
        store.close()


def test_tool_choice_and_response_format_hold_a_real_reply_to_the_schema(demo, tmp_path):
    """A model whose template renders tools (the demo, which has not learned to call them, with today's template):
    tool_choice naming a tool gets a call to it whose arguments satisfy its schema, streamed as the same deltas;
    "none" gets text alone; response_format json_schema gets JSON that follows the schema; both at once is a 400. The
    server stops by itself after --max-requests."""
    from tqbench.eval.tools import schema_problem
    from tqbench.tokenizer import CHAT_TEMPLATE

    model = Path(shutil.copytree(demo, tmp_path / "tools"))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    s = Served(model, tmp_path / "cache", "--max-requests", "4", key=None)
    try:
        user = [{"role": "user", "content": "Weather in Oslo for three days?"}]
        choice = {"type": "function", "function": {"name": "get_weather"}}
        r = s.client.chat.completions.create(model="tools", messages=user, tools=tools, tool_choice=choice,
                                             max_tokens=80, temperature=0.8, seed=5)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
        for call in calls:
            assert call.function.name == "get_weather"
            assert schema_problem(json.loads(call.function.arguments), params) == "", call.function.arguments
        chunks = list(s.client.chat.completions.create(model="tools", messages=user, tools=tools, tool_choice=choice,
                                                       max_tokens=80, temperature=0.8, seed=5, stream=True))
        streamed: dict[int, list[str]] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                streamed.setdefault(d.index, []).append(d.function.arguments or "")
        assert ["".join(streamed[i]) for i in sorted(streamed)] == [c.function.arguments for c in calls]
        r = s.client.chat.completions.create(model="tools", messages=user, tools=tools, tool_choice="none",
                                             max_tokens=12)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "ok": {"type": "boolean"}},
                  "required": ["city", "ok"], "additionalProperties": False}
        r = s.client.chat.completions.create(model="tools", messages=user, max_tokens=60, temperature=0.7, seed=2,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "w", "schema": schema}})
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"city", "ok"} and isinstance(value["ok"], bool) and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as e:  # refused before it runs: not one of the 4 requests
            s.client.chat.completions.create(model="tools", messages=user, tools=tools,
                                             response_format={"type": "json_object"})
        assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
        assert s.proc.wait(120) == 0
    finally:
        if s.proc.poll() is None:  # a failed check above: the server still waits for its requests
            s.proc.kill()


# ---- the parts ------------------------------------------------------------------------------------------------------

def test_the_openai_parser_maps_fields_as_documented():
    from tqbench.serve.openai import ApiError, parse_request

    r = parse_request("chat", {"model": "m", "messages": [{"role": "developer", "content": [
        {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 5, "max_tokens": 9, "top_p": 1, "stop": "END", "user": "u1", "n": 1,
        "stream_options": {"include_usage": True}, "stream": True})
    c = r.completion
    assert c.messages[0] == {"role": "system", "content": "be brief"} and c.stop == ("END",)
    assert c.sampling.max_tokens == 5 and c.sampling.top_p == 0.0 and r.stream and r.include_usage
    with pytest.raises(ApiError) as e:
        parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert e.value.status == 400 and e.value.param == "n"
    one = [{"role": "user", "content": "x"}]
    assert parse_request("chat", {"messages": one, "logprobs": True}).completion.sampling.logprobs == 0
    four = parse_request("chat", {"messages": one, "logprobs": True, "top_logprobs": 4})
    assert four.completion.sampling.logprobs == 4
    assert parse_request("chat", {"messages": one, "logprobs": False}).completion.sampling.logprobs is None
    assert parse_request("text", {"prompt": "x", "logprobs": 2}).completion.sampling.logprobs == 2
    for kind, body, param in [("chat", {"messages": one, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
                              ("chat", {"messages": one, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                              ("text", {"prompt": "x", "logprobs": 6}, "logprobs"),
                              ("text", {"prompt": "x", "logprobs": True}, "logprobs")]:
        with pytest.raises(ApiError) as e:
            parse_request(kind, body)
        assert e.value.status == 400 and e.value.param == param
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    c = parse_request("chat", {"messages": one, "tools": tools, "tool_choice": {"type": "function",
                                                                               "function": {"name": "f"}}}).completion
    assert c.tool_choice == "f" and c.response_schema is None
    assert parse_request("chat", {"messages": one, "tool_choice": "none"}).completion.tool_choice == "auto"
    assert not parse_request("chat", {"messages": one, "tools": tools,
                                      "parallel_tool_calls": False}).completion.parallel_tool_calls
    fmt = parse_request("chat", {"messages": one, "response_format": {"type": "json_object"}}).completion
    assert fmt.response_schema == {"type": "object"}
    for body in [{"messages": one, "tool_choice": "required"},  # no tools
                 {"messages": one, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}},
                 {"messages": one, "tools": tools, "tool_choice": "always"},
                 {"messages": one, "tools": tools, "parallel_tool_calls": "no"},
                 {"messages": one, "response_format": {"type": "xml"}},
                 {"messages": one, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                 {"messages": one, "response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}]:
        with pytest.raises(ApiError) as e:
            parse_request("chat", body)
        assert e.value.status == 400, body
        assert e.value.param == next(k for k in ("response_format", "parallel_tool_calls", "tool_choice") if k in body)
    t = parse_request("text", {"prompt": ["only one"], "max_tokens": 3})
    assert t.completion.prompt == "only one" and t.completion.messages is None


def test_the_chat_template_receives_tools(demo, tmp_path):
    """A template that renders tools gets them: the tool's name is in the prompt the model sees."""
    from tqbench.runtime.complete import chat_prompt
    from tqbench.runtime.load import load

    model = Path(shutil.copytree(demo, tmp_path / "tools"))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}|{% endif %}"
                            + cfg["chat_template"])
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = load(model)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    with_tools = loaded.tokenizer.decode(chat_prompt(loaded, messages, tools))
    assert with_tools.startswith("tools: get_weather|")
    assert with_tools.removeprefix("tools: get_weather|") == loaded.tokenizer.decode(chat_prompt(loaded, messages))


def test_tool_calls_are_parsed_token_by_token_with_the_models_parser(demo):
    """The K3 tool-call format, fed as the demo tokenizer's tokens one at a time: the text before the call is the
    answer, the call is parsed by mlx-lm's kimi_k3 parser, and the markers never reach the answer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tqbench.chat.segment import Segmenter

    tok = load_tokenizer(demo)
    call = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|>')
    ids = tok.encode("Let me check. " + call + " Done.", add_special_tokens=False)
    seg = Segmenter(tok, [{"type": "function", "function": {"name": "get_weather"}}])
    content, calls = [], []
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
        c, _, t = seg.feed(detok.last_segment)
        content.append(c)
        calls += t
    detok.finalize()
    c, _, t = seg.feed(detok.last_segment, final="length")
    content.append(c)
    calls += t
    assert "".join(content) == "Let me check.  Done."
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("get_weather", {"city": "Tokyo"})]


def test_stop_strings_hold_back_only_what_could_begin_one():
    from tqbench.runtime.conversation import _stop_prefix

    assert _stop_prefix("abc\n", ("\n\n",)) == 1
    assert _stop_prefix("abcEN", ("END", "x")) == 2
    assert _stop_prefix("abc", ("END",)) == 0


def test_listening_beyond_loopback_warns():
    from tqbench.serve.http import warn_if_exposed

    assert warn_if_exposed("127.0.0.1") is None
    assert "0.0.0.0" in warn_if_exposed("0.0.0.0") and "--api-key" in warn_if_exposed("0.0.0.0")


def test_any_json_body_is_a_request_or_one_openai_error():
    """Random JSON values in every field the parser reads: a typed request or an ApiError (400 naming a field),
    never another exception."""
    import random

    from tqbench.serve.openai import ApiError, parse_request

    rng = random.Random(0)
    leaves = [None, True, False, 0, -1, 1, 2**70, 0.5, float("1e308"), "", "x", "user", [], {}, [1], {"a": 1},
              [{"role": "user", "content": "x"}], [{"type": "text", "text": "x"}], {"type": "function"}]
    fields = ["model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p",
              "top_k", "seed", "stop", "tools", "n", "logprobs", "stream_options", "tool_choice", "user"]
    outcomes = set()
    for _ in range(2000):
        body = {k: rng.choice(leaves) for k in rng.sample(fields, rng.randint(1, 6))}
        if rng.random() < 0.5:
            body["messages"] = [{"role": rng.choice(["user", "assistant", "x", None]),
                                 "content": rng.choice(leaves), "tool_calls": rng.choice(leaves)}]
        for kind in ("chat", "text"):
            try:
                parse_request(kind, body)
                outcomes.add("ok")
            except ApiError as e:
                assert e.status == 400 and e.message and "\n" not in e.message
                outcomes.add(400)
    assert outcomes == {"ok", 400}


def test_each_pipeline_rank_shows_in_the_status_metrics_and_live_feed():
    """A server on several ranks: every rank's figures after the last request, in its status lines, /metrics (a
    `rank` label) and /tqbench/status, which a face attached to the server reads back as the same records."""
    from tqbench.chat.events import StreamReport
    from tqbench.distributed.world import RankStats
    from tqbench.serve import metrics, report, wire
    from tqbench.serve.service import ServeStatus
    from tqbench.stream.stats import StreamStats

    ranks = (RankStats(rank=0, layers=(4, 8), streamed=True, hits_gpu=90, hits_host=3, misses=700,
                       critical_bytes=2_350_080, stall_s=0.25, tokens=11),
             RankStats(rank=1, layers=(0, 4), streamed=False, hits_gpu=0, hits_host=0, misses=0, critical_bytes=0,
                       stall_s=0.0, tokens=11))
    stats = StreamStats(misses=700, critical_bytes=2_350_080, tokens=11)
    served = ServeStatus(model="tq4", url="http://127.0.0.1:1", uptime_s=1.0, requests=1, ok=1, cancelled=0, failed=0,
                         rejected=0, refused=0, running=0, queued=0, prompt_tokens=1, cached_tokens=0,
                         completion_tokens=8, decode_tps=10.0, ttft_s=0.1,
                         stream=StreamReport(stats=stats, disk=None, profile=None, ranks=ranks))
    lines = report.status_lines(served)
    assert "rank 0 (layers 4-7): 93 hits, 700 misses, 2.35 MB (2.24 MiB) read, stalled 0.25 s over 11 forward passes" in lines
    assert "rank 1 (layers 0-3): experts resident" in lines
    text = metrics.prometheus(served)
    assert 'tqbench_rank_expert_misses_total{rank="0"} 700\n' in text
    assert 'tqbench_rank_expert_read_bytes_total{rank="1"} 0\n' in text
    assert 'tqbench_rank_expert_stall_seconds_total{rank="0"} 0.25\n' in text
    assert 'tqbench_rank_forward_passes_total{rank="1"} 11\n' in text
    assert wire.decode_status(json.loads(json.dumps(wire.status_dict(served)))).stream.ranks == ranks
    # the guard on tool calls the server gives every request: a line of its status, and it travels to an attached face
    assert not any(line.startswith("tool calls") for line in lines)
    guarded = replace(served, tool_syntax="schema")
    assert report.TOOL_GUARDS["schema"] in report.status_lines(guarded)
    assert wire.decode_status(json.loads(json.dumps(wire.status_dict(guarded)))).tool_syntax == "schema"


# ---- the server's edges ---------------------------------------------------------------------------------------------

def test_a_full_queue_is_counted_once_and_one_token_has_no_rate(demo, tmp_path):
    """--max-queue 0: a bad request (400) is refused, a request while another runs is rejected (429), each counted
    once; a one-token reply's log line gives no decode rate (one token has none)."""
    s = Served(demo, tmp_path, "--max-queue", "0", "--max-requests", "2", key=None)
    code, _, _ = raw(s.port, "POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
    assert code == 400
    stream = ask(s, [{"role": "user", "content": U2}], max_tokens=40, stream=True)
    next(iter(stream))  # running
    with pytest.raises(openai.RateLimitError):
        ask(s, [{"role": "user", "content": "y"}], max_tokens=2)
    text = s.get("/metrics", key=None)[2].decode()
    assert metric(text, 'requests_total{outcome="rejected"}') == 1 and metric(text, 'requests_total{outcome="refused"}') == 1
    list(stream)
    one = ask(s, [{"role": "user", "content": "x"}], max_tokens=1)
    assert one.usage.completion_tokens == 1
    assert s.proc.wait(60) == 0  # --max-requests: a normal end
    line = next(x for x in s.lines if " 1 generated (" in x)
    assert "tok/s" not in line and "first token" in line
    assert any(x.startswith("requests 2 (2 ok, 1 rejected (queue full), 1 refused)") for x in s.lines), s.lines


def test_ctrl_c_mid_stream_ends_the_clients_stream_with_an_error_and_exits_130(demo, tmp_path):
    """A client must tell a cut reply from a finished one: the server sends an error event before it closes."""
    s = Served(demo, tmp_path, key=None)
    stream = ask(s, [{"role": "user", "content": U2}], max_tokens=200, stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    s.proc.send_signal(signal.SIGINT)
    with pytest.raises(openai.APIError) as e:
        for _ in chunks:
            pass
    assert "the server stopped while this reply was being generated" in str(e.value)
    assert s.proc.wait(60) == 130
    assert "stopped" in s.lines and s.lines[-1] == "tqbench: interrupted"


@pytest.mark.slow  # a server of its own through ten rounds of refused bursts: a regression test of a race (~9 s)
def test_requests_after_a_burst_of_429s_are_answered(demo, tmp_path):
    """Once seen: two requests sent right after a burst of refusals (an API key, no queue, a small body limit) hung.
    Ten rounds of a burst (a running request, refused ones: 429, 401, 413) and then two requests in turn, each of which
    must be answered within its timeout."""
    s = Served(demo, tmp_path, "--max-queue", "0", "--max-body-mb", "0.01")
    for _ in range(10):
        running = ask(s, [{"role": "user", "content": U1}], max_tokens=12, stream=True)
        next(iter(running))
        refused = []

        def refuse(i: int) -> None:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY if i % 3 else 'wrong'}"}
            body = json.dumps({"messages": [{"role": "user", "content": "x" * (20_000 if i % 3 == 2 else 1)}]})
            refused.append(raw(s.port, "POST", "/v1/chat/completions", body.encode(), headers)[0])

        burst = [threading.Thread(target=refuse, args=(i,)) for i in range(6)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(30)
        assert sorted(set(refused)) == [401, 413, 429] and len(refused) == 6
        list(running)
        for _ in range(2):
            r = s.client.with_options(timeout=30).chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0)
            assert r.usage.completion_tokens == 2
    assert s.stop() == 130


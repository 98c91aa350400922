#!/usr/bin/env python3
"""What serving costs: the demo (converted with tq4, as chat runs it) answering the same greedy requests through
`tqbench serve` (HTTP, the openai client, server-sent events) and through the bare engine (`ChatSession.complete`
in a process of its own), in alternating order; and what the prompt cache saves a second turn.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/serve.py
    python benchmarks/serve.py --quick          # a smoke run

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset.)

1. Converts the shipped demo with tq4 into the work directory, once.
2. One `tqbench serve` process on 127.0.0.1 and, in this process, a ChatSession on the same model (both resident,
   both loaded once). `--pairs` pairs of the same greedy request, `--max-tokens` tokens, no profile learning: one
   through the server, driven with the official openai client and streamed (timed from the call to the first chunk
   with text and to the last), one through the bare engine (`ChatSession.complete`, timed from the call to its first
   CompletionDelta with text and its last), back to back, the order alternating. Pairing request by request matters:
   on this 2-core VM the same request decodes anywhere from 10 to 24 tok/s over minutes, so only neighbours compare.
   One warm-up request each, not counted.
   Per request: time to first token (TTFT) and decode tok/s = (tokens - 1) / (last - first), both as the caller sees
   them. Per pair: decode tok/s server / engine and TTFT server - engine; also the ratio of the engines' own decode
   rates (mlx-lm's figure: the server logs it per request), which leaves out what happens after a token is made. Goals, on the medians over pairs: ratio
   >= 0.95 (`TPS_GOAL`), TTFT overhead <= 20 ms (`TTFT_GOAL_S`).
3. The prompt cache: a conversation whose first turn is `--context` tokens of held-out code, then a second turn (the
   reply sent back and a short question), through a server with the prompt cache and one with `--prompt-cache-gb 0`;
   TTFT of each turn, `--turns` times (a new conversation each time, so nothing is reused across them).
4. Peak RSS of the server process and of this one (which holds the bare engine's model).

Writes JSON (`--out`, default bench-results/serve.json, schema tqbench.bench.serve/1) and prints a summary.
"""

from __future__ import annotations

import os
import sys

from harness import REPO, add_size_options, log, machine_info, median, peak_rss_bytes, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import convert_demo, dump_json  # noqa: E402

SCHEMA = "tqbench.bench.serve/1"
TPS_GOAL = 0.95
TTFT_GOAL_S = 0.020
RELEVANT = ("tqbench/serve", "tqbench/chat", "tqbench/runtime", "benchmarks/serve.py")
PROMPT = "def parse_args(argv):"
DEFAULTS = dict(pairs=24, max_tokens=48, context=600, turns=3)
QUICK = dict(pairs=2, max_tokens=12, context=200, turns=1)


# --- the bare engine (in this process) ----------------------------------------------------------------------------------

class Engine:
    def __init__(self, model: Path) -> None:
        from tqbench.chat.request import ChatRequest, ProfileOptions
        from tqbench.chat.session import ChatSession

        self.session = ChatSession()
        with self.session.open(ChatRequest(model=str(model), profile=ProfileOptions(learn=False))) as job:
            job.result()

    def stream(self, messages: list[dict], max_tokens: int) -> dict:
        from tqbench.events import CompletionDelta, CompletionDone
        from tqbench.chat.request import CompletionRequest, SamplingRequest

        request = CompletionRequest(messages=tuple(messages), sampling=SamplingRequest(max_tokens=max_tokens, temp=0.0))
        t0 = time.perf_counter()
        stamps = []
        done = None
        with self.session.complete(request) as job:
            for ev in job:
                if isinstance(ev, CompletionDelta) and ev.content:
                    stamps.append(time.perf_counter() - t0)
                elif isinstance(ev, CompletionDone):
                    done = ev
        return dict(timing(stamps), engine_decode_tps=done.reply.decode_tps)

    def close(self) -> None:
        self.session.close()


def timing(stamps: list[float]) -> dict:
    """TTFT and decode tok/s from the times (since the call) of the chunks that carried text."""
    n = len(stamps)
    return dict(ttft_s=stamps[0], tokens=n,
                decode_tps=(n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else None)


# --- the server (a `tqbench serve` process driven from here) -----------------------------------------------------------

class Server:
    def __init__(self, model: Path, work: Path, *args: str) -> None:
        self.cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        env = dict(os.environ, TQBENCH_CACHE_DIR=str(self.cache), PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-m", "tqbench", "serve", "-m", str(model), "--port", "0",
                                      "--no-learn", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env, cwd=REPO)
        self.lines: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                if line.startswith("serving "):
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        ready.wait(600)
        serving = [x for x in self.lines if x.startswith("serving ")]
        if not serving:
            raise RuntimeError("the server did not start:\n" + "\n".join(self.lines))
        url = re.search(r"(http://\S+)/v1", serving[0]).group(1)
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def stream(self, messages: list[dict], max_tokens: int) -> tuple[dict, str]:
        t0 = time.perf_counter()
        stamps, text = [], []
        for c in self.client.chat.completions.create(model="", messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True):
            if c.choices and c.choices[0].delta.content:
                stamps.append(time.perf_counter() - t0)
                text.append(c.choices[0].delta.content)
        time.sleep(0.05)  # the server's line for this request (its engine's own decode rate) is on its stderr by now
        logged = re.findall(r", ([\d.]+) tok/s$", self.lines[-1]) if self.lines else []
        return dict(timing(stamps), engine_decode_tps=float(logged[0]) if logged else None), "".join(text)

    def peak_rss(self) -> int | None:
        try:
            m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{self.proc.pid}/status").read_text())
            return int(m.group(1)) * 1024
        except OSError:
            return None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.cache, ignore_errors=True)


def pairs(model: Path, work: Path, z: dict) -> tuple[list[dict], dict]:
    """Request pairs, server and bare engine back to back, alternating which goes first."""
    server, bare = Server(model, work), Engine(model)
    messages = [{"role": "user", "content": PROMPT}]
    try:
        server.stream(messages, z["max_tokens"])  # warm-ups
        bare.stream(messages, z["max_tokens"])
        out = []
        for i in range(z["pairs"]):
            order = ("server", "engine") if i % 2 == 0 else ("engine", "server")
            got = {k: server.stream(messages, z["max_tokens"])[0] if k == "server" else
                   bare.stream(messages, z["max_tokens"]) for k in order}
            out.append(dict(order=list(order), server=got["server"], engine=got["engine"],
                            tps_ratio=got["server"]["decode_tps"] / got["engine"]["decode_tps"],
                            ttft_overhead_s=got["server"]["ttft_s"] - got["engine"]["ttft_s"],
                            engine_tps_ratio=got["server"]["engine_decode_tps"] / got["engine"]["engine_decode_tps"]))
            log(f"pair {i + 1}/{z['pairs']}: decode {out[-1]['tps_ratio']:.3f}, TTFT "
                f"{out[-1]['ttft_overhead_s'] * 1000:+.1f} ms")
        return out, dict(server_peak_rss=server.peak_rss(), client_and_engine_peak_rss=peak_rss_bytes())
    finally:
        server.close()
        bare.close()


def context_text(tokens: int) -> str:
    """About `tokens` tokens of the demo's held-out code (3.7 bytes a token)."""
    from tqbench.texts import default_texts

    code = "\n".join(doc for t in default_texts() if t.name == "code" for doc in t.documents)
    return code[: int(tokens * 3.7)]


def prompt_cache(model: Path, work: Path, a: dict) -> dict:
    """TTFT of turn 1 and turn 2 of fresh conversations, with the prompt cache and without."""
    out = {}
    for label, args in (("cache", ()), ("no_cache", ("--prompt-cache-gb", "0"))):
        s = Server(model, work, *args)
        try:
            s.stream([{"role": "user", "content": "hello"}], 2)  # warm-up
            turns = []
            for i in range(a["turns"]):
                first = [{"role": "user", "content": f"# file {i}\n" + context_text(a["context"])}]
                t1, reply = s.stream(first, 8)
                second = first + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": "What does this do?"}]
                t2, _ = s.stream(second, 8)
                turns.append(dict(turn1_ttft_s=t1["ttft_s"], turn2_ttft_s=t2["ttft_s"]))
            out[label] = dict(turns=turns, turn1_ttft_s=median([t["turn1_ttft_s"] for t in turns]),
                              turn2_ttft_s=median([t["turn2_ttft_s"] for t in turns]))
        finally:
            s.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(p, DEFAULTS, QUICK)
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "serve.json")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    p.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    a = p.parse_args()
    z = sizes(a, DEFAULTS, QUICK)
    work = a.work or Path(tempfile.mkdtemp(prefix="tqbench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    log("converting the demo with tq4")
    model = convert_demo(work)
    measured, memory = pairs(model, work, z)
    log("prompt cache: turn 1 and turn 2")
    cache = prompt_cache(model, work, z)
    ratio = median([p["tps_ratio"] for p in measured])
    engine_ratio = median([p["engine_tps_ratio"] for p in measured])
    overhead = median([p["ttft_overhead_s"] for p in measured])
    result = dict(schema=SCHEMA, command=" ".join(["python", "benchmarks/serve.py", *sys.argv[1:]]), sizes=z,
                  machine=machine_info(work, RELEVANT), model="demo converted with tq4", pairs=measured, memory=memory,
                  tps_ratio=ratio, engine_tps_ratio=engine_ratio, ttft_overhead_s=overhead, tps_goal=TPS_GOAL, ttft_goal_s=TTFT_GOAL_S,
                  tps_goal_met=ratio >= TPS_GOAL, ttft_goal_met=overhead <= TTFT_GOAL_S, prompt_cache=cache)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump_json(result))
    for key in ("tps_ratio", "engine_tps_ratio", "ttft_overhead_s"):
        xs = sorted(p[key] for p in measured)
        print(f"{key}: quartiles {xs[len(xs) // 4]:.4f} / {median(xs):.4f} / {xs[3 * len(xs) // 4]:.4f}")
    print(f"median: decode ratio {ratio:.3f} (goal >= {TPS_GOAL}), TTFT overhead {overhead * 1000:+.1f} ms "
          f"(goal <= {TTFT_GOAL_S * 1000:.0f} ms)")
    for label, c in cache.items():
        print(f"prompt cache {label}: turn 1 TTFT {c['turn1_ttft_s'] * 1000:.0f} ms, turn 2 "
              f"{c['turn2_ttft_s'] * 1000:.0f} ms")
    print(f"wrote {a.out}")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

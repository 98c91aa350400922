"""The Serve screen (w), driven with Pilot: serving the demo from the screen and answering a real OpenAI client, with
the page-ins on the expert map; attaching to a `tqbench serve` process and showing its request; attaching to a port
nobody listens on. The demo's source checkpoint runs directly (no conversion); a 2 MB cache budget streams its
experts."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading

import pytest
from textual.widgets import Input, RichLog, Select, Static

from tqbench.demo import ensure_demo
from tqbench.serve import report
from tqbench.state import remember_model
from tui.app import TqbenchApp
from tui.screens.serve import ServeScreen
from model_helpers import free_port
from tui_helpers import settle, wait_for

SIZE = (120, 40)
BUDGET = "2MB"
SERVING = re.compile(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1")


def ask(url: str, model: str, api_key: str | None = None):
    """One real request with the openai package: greedy, a few tokens."""
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0) as client:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "def add(a, b):"}],
                                              max_tokens=8, temperature=0)


async def open_serve(pilot) -> ServeScreen:
    await settle(pilot)
    await pilot.press("w")
    screen = pilot.app.screen
    assert isinstance(screen, ServeScreen)
    return screen


def text(screen: ServeScreen, selector: str) -> str:
    return str(screen.query_one(selector, Static).render())


def log_text(screen: ServeScreen) -> str:
    """The request log's lines, wrapped lines joined again."""
    return " ".join(t for strip in screen.query_one(RichLog).lines if (t := strip.text.strip()))


def set_field(screen: ServeScreen, name: str, value: str) -> None:
    screen.query_one(f"#{name}", Input).value = value


@pytest.mark.slow
async def test_serve_the_demo_from_the_screen(tmp_path):
    demo = ensure_demo()
    remember_model(demo)  # the model the Chat screen would open: the last converted, here the demo's source
    app = TqbenchApp(tmp_path / "nothing")  # the Source screen's load fails at once: no checkpoint to scan
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_serve(pilot)
        set_field(screen, "serve-port", "0")
        set_field(screen, "serve-key", "sekrit")
        set_field(screen, "serve-budget", BUDGET)
        screen.query_one("#serve-tools", Select).value = "schema"  # the guard `tqbench serve --tool-syntax` sets
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.status is not None or screen.error is not None, "the server", 60)
        assert screen.error is None
        assert screen.status.tool_syntax == "schema" and report.TOOL_GUARDS["schema"] in text(screen, "#serve-status")
        url = SERVING.match(text(screen, "#serve-line")).group(1)
        assert screen.server.url == url and screen.server.port != 0
        assert text(screen, "#serve-line") == report.serving_line(url, demo.name, True, "x stops")
        assert screen.experts is not None and screen.map_view.display
        assert dict(screen.status.layers) == {n: s.experts for n, s in screen.experts.layers.items()}

        done = threading.Event()
        answer = {}

        def request() -> None:
            try:
                answer["reply"] = ask(url, demo.name, "sekrit")
            except Exception as e:
                answer["error"] = e
            done.set()

        threading.Thread(target=request, daemon=True).start()
        await wait_for(pilot, lambda: done.is_set(), "the answer", 60)
        assert "error" not in answer, answer
        await wait_for(pilot, lambda: screen.status.requests == 1, "the request's status", 10)
        await pilot.pause(0.2)
        st = screen.status
        assert answer["reply"].usage.completion_tokens == st.completion_tokens > 0
        assert text(screen, "#serve-status").splitlines() == report.status_lines(st)
        assert text(screen, "#serve-status").startswith("requests 1 (1 ok); running 0, queued 0")
        logged = log_text(screen)
        assert logged.startswith(answer["reply"].id + ": ") and logged.count("chatcmpl-") == 1, logged
        assert f"{st.prompt_tokens} prompt tokens, {st.completion_tokens} generated (max tokens)" in logged
        # every routing the engine counted came to the map as a page-in
        seen = screen.experts.seen
        assert sum(seen.values()) == st.stream.stats.hits + st.stream.stats.misses > 0
        assert seen["miss"] == st.stream.stats.misses

        # a client that keeps its connection open (HTTP keep-alive) never holds the server up
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n\r\n")
            assert idle.recv(4096).startswith(b"HTTP/1.1 200")
            await pilot.press("x")
            await wait_for(pilot, lambda: screen.state == "idle", "the server to stop", 10)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert screen.session.loaded is None
        assert not any(t.name == "tqbench-http" for t in threading.enumerate())


def start_serve_process(tmp_path) -> subprocess.Popen:
    """`tqbench serve` of the demo in another process (one request, then it stops)."""
    import os

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "tqbench", "serve", "-m", str(ensure_demo()), "--port", "0",
                             "--max-requests", "1", "--no-learn", "--cache-budget-gb", "0.002"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)


def serving_url(proc: subprocess.Popen) -> str:
    """The URL the process serves at, from its stderr's serving line."""
    for line in proc.stderr:
        found = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # the rest, so the pipe never fills
            return found.group(1)
    proc.wait(10)
    raise AssertionError(f"tqbench serve ended (exit {proc.returncode}) without serving")


@pytest.mark.slow
async def test_attach_to_a_serve_process(tmp_path):
    demo = ensure_demo()
    proc = start_serve_process(tmp_path)
    try:
        app = TqbenchApp(tmp_path / "nothing")
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_serve(pilot)
            url = await asyncio.to_thread(serving_url, proc)  # the process loaded while the app started
            set_field(screen, "attach-url", url)
            await pilot.press("a")
            await wait_for(pilot, lambda: screen.status is not None or screen.error is not None, "the status", 10)
            assert screen.error is None and screen.status.requests == 0
            assert text(screen, "#serve-line") == report.attached_line(screen.status)
            assert screen.status.url == url and screen.experts is not None
            reply = await asyncio.to_thread(ask, url, demo.name)
            await wait_for(pilot, lambda: screen.status.requests == 1, "the request", 20)
            st = screen.status
            assert reply.usage.completion_tokens == st.completion_tokens > 0
            assert text(screen, "#serve-status").startswith("requests 1 (1 ok); running 0, queued 0")
            logged = log_text(screen)
            assert logged.startswith(reply.id + ": ") and logged.count("chatcmpl-") == 1, logged
            assert f"{st.prompt_tokens} prompt tokens, {st.completion_tokens} generated (max tokens)" in logged
            # the server stops after its one request: the feed's end is one line, the figures stay
            await wait_for(pilot, lambda: screen.state == "idle", "the feed's end", 20)
            assert screen.error == report.feed_ended_line(url)
            assert sum(screen.experts.seen.values()) == st.stream.stats.hits + st.stream.stats.misses > 0
    finally:
        assert proc.wait(20) == 0


@pytest.mark.slow
async def test_attach_to_a_dead_port_is_one_line(tmp_path):
    port = free_port()
    app = TqbenchApp(tmp_path / "nothing")  # the Source screen's load fails at once: no demo to scan
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_serve(pilot)
        set_field(screen, "attach-url", f"http://127.0.0.1:{port}")
        await pilot.press("a")
        await wait_for(pilot, lambda: screen.error is not None, "the error", 10)
        assert screen.error.startswith(f"http://127.0.0.1:{port}: cannot reach a tqbench server (")
        assert "\n" not in screen.error and screen.state == "idle" and screen.status is None
        assert text(screen, "#serve-error") == screen.error

#!/usr/bin/env python3
"""What the Chat screen's live expert view costs decode: the same greedy reply of the demo model, streaming its
experts with a small cache budget, run in the headless TUI with the view drawing and with the view paused (v), in
alternating order, plus the engine alone (no TUI) for scale.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/liveview.py
    python benchmarks/liveview.py --quick          # a smoke run (2 repeats)

(On Linux the script re-executes itself with that LD_PRELOAD when the library exists and LD_PRELOAD is unset: MLX's
Linux CPU wheel ships a reference BLAS. `--no-openblas` opts out.)

1. Converts the shipped demo (`tqbench.demo.ensure_demo()`) with tq4 into the work directory, once.
2. Per repeat (`--repeats`), two fresh subprocesses, each with its own empty tqbench cache directory (so no learned
   profile changes what is pinned), the model remembered as the last converted one:
   - TUI: `tui.app.TqbenchApp` headless (`App.run_test`, `--size`), the Chat screen re-opened with the cache budget
     (`--budget-share` of the experts' bytes plus the read buffers, `--workers`), one warm-up reply, then `--pairs` pairs of measured replies of the same prompt, each
     after ctrl+r (a new conversation: the same reply again; the expert cache stays warm): one with the view drawing
     every batch of page-ins (`view`), one with the view paused by v (`paused`: the worker posts the same batches,
     the screen holds them until v resumes, nothing is drawn). The order within a pair alternates (view first, then paused first, ...);
   - `engine`: `tqbench.chat.session.ChatSession` directly, the same settings, warm-up and as many replies after a reset each.
3. Reported per reply: decode tok/s (ReplyDone.decode_tps, the engine's own figure), tokens, the reply's misses, hits
   and stall (StreamStats after it minus before it), the batches the view received, the CPU seconds its handler took
   and the map spent drawing its lines (`render_line`; the compositor's own work is not in it), both as the UI
   thread's CPU time (`time.thread_time`: wall time there would count the waits for the GIL the engine holds);
   the process's CPU seconds over the reply (all threads: engine, readers, UI). The ratio of decode tok/s view /
   paused per pair and its median; overhead = 1 - that median, goal below 5% (`OVERHEAD_GOAL`). On a shared machine
   decode tok/s swings far more than 5% between two replies, so the run also bounds the overhead from CPU time: the
   UI thread's CPU seconds over the reply (`time.thread_time` on the app's thread) with the view minus without, over
   the reply's decode seconds (`ui_overhead_bound`): the engine can wait for the GIL at most that long.

Writes JSON (`--out`, default bench-results/liveview.json, schema tqbench.bench.liveview/1) and prints a table.
"""

from __future__ import annotations

import os
import sys

from harness import REPO, add_size_options, convert_demo, emit, machine_info, run_child, sizes, with_openblas

if __name__ == "__main__":
    with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SCHEMA = "tqbench.bench.liveview/1"
OVERHEAD_GOAL = 0.05
RELEVANT = ("tui", "tqbench/stream", "tqbench/runtime", "benchmarks/liveview.py")  # what the measurement runs
DEFAULTS = dict(repeats=3, pairs=8, budget_share=0.35, workers=4, prompt="def parse_args(argv):", size="100x30")
QUICK = dict(DEFAULTS, repeats=1, pairs=2)


# --- children ----------------------------------------------------------------------------------------------------------

def _figures(done, before, after) -> dict:
    """A reply's decode rate and text, and its page-ins: StreamStats after it minus before it."""
    b, a = before.to_dict(), after.to_dict()  # tqbench.events.StreamReport
    return dict(decode_tps=done.decode_tps, tokens=done.generated_tokens, text=done.text,
                misses=a["misses"] - b["misses"], hits=a["hits"] - b["hits"],
                stall_s=round(a["stall_s"] - b["stall_s"], 4))


def child_engine(a: dict) -> None:
    from tqbench.chat.request import ChatRequest, StreamRequest
    from tqbench.chat.session import ChatSession

    session = ChatSession()
    try:
        with session.open(ChatRequest(model=a["model"],
                                      stream=StreamRequest(budget=a["budget"], workers=a["workers"]))) as job:
            job.result()

        def reply():
            with session.reply(a["prompt"]) as job:
                return job.result()[-1]

        reply()  # warm-up
        replies = []
        for _ in a["sequence"]:
            session.reset()
            before = session.stats()
            cpu = time.process_time()
            done = reply()
            replies.append(dict(mode="engine", **_figures(done, before, session.stats()),
                                cpu_s=time.process_time() - cpu))
    finally:
        session.close()
    emit(dict(replies=replies))


def child_tui(a: dict) -> None:
    import asyncio
    from dataclasses import replace

    from tqbench.state import remember_model
    from tui.app import TqbenchApp
    from tui.screens.chat import ChatScreen
    from tqbench.chat.request import StreamRequest
    from tui.widgets.expert_map import ExpertMapView

    remember_model(Path(a["model"]))
    handled = {"batches": 0, "events": 0, "seconds": 0.0, "render_s": 0.0}
    original, render = ChatScreen.on_chat_experts, ExpertMapView.render_line

    def timed(self, message):  # the view's handler: applying a batch, the summary line, asking for a redraw
        t0 = time.thread_time()  # CPU time of the UI thread: wall time would count waits for the GIL
        original(self, message)
        handled["seconds"] += time.thread_time() - t0
        handled["batches"] += 1
        handled["events"] += len(message.events)

    def timed_render(self, y):  # the map's lines, as the compositor asks for them
        t0 = time.thread_time()
        strip = render(self, y)
        handled["render_s"] += time.thread_time() - t0
        return strip

    ChatScreen.on_chat_experts = timed
    ExpertMapView.render_line = timed_render
    width, height = (int(x) for x in a["size"].split("x"))

    async def until(pilot, condition, seconds: float = 300) -> None:
        end = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > end:
                raise TimeoutError("the TUI did not get there in time")
            await pilot.pause(0.01)

    async def run() -> dict:
        app = TqbenchApp()
        async with app.run_test(size=(width, height)) as pilot:
            await pilot.pause()
            await pilot.press("t")
            screen = app.screen
            await until(pilot, lambda: screen.loaded is not None or screen.error is not None)
            screen.request = replace(screen.request, stream=StreamRequest(budget=a["budget"], workers=a["workers"]))
            screen.load()
            await until(pilot, lambda: screen.loaded is not None or screen.error is not None)
            if screen.error or screen.experts.experts is None:
                raise RuntimeError(f"not streaming: {screen.error}")

            async def reply() -> None:
                turn = screen.turns.turn_id
                screen.chat_input.value = a["prompt"]
                screen.chat_input.focus()
                await pilot.press("enter")
                await until(pilot, lambda: screen.turns.turn_id > turn and not screen.replying)
                await pilot.pause()
                if screen.error:
                    raise RuntimeError(screen.error)

            await reply()  # warm-up
            view = screen.query_one("#expert-map")
            replies = []
            for mode in a["sequence"]:
                await pilot.press("ctrl+r")  # a new conversation: the same reply again; the expert cache stays warm
                await until(pilot, lambda: not screen.turns.resetting)
                if view.paused != (mode == "paused"):
                    screen.action_pause_view()
                before = screen.chat.stats()
                handled.update(batches=0, events=0, seconds=0.0, render_s=0.0)
                cpu, ui = time.process_time(), time.thread_time()  # this coroutine runs on the app's thread
                await reply()
                replies.append(dict(mode=mode, **_figures(screen.last_done, before, screen.chat.stats()),
                                    cpu_s=time.process_time() - cpu, ui_cpu_s=time.thread_time() - ui,
                                    view_batches=handled["batches"], view_events=handled["events"],
                                    view_handler_s=handled["seconds"], view_render_s=handled["render_s"],
                                    paused=view.paused))
            return dict(replies=replies)

    emit(asyncio.run(run()))


CHILDREN = {"engine": child_engine, "tui": child_tui}


def measure(kind: str, args: dict, work: Path, timeout: float = 900) -> dict:
    """One measurement in a fresh process with its own empty tqbench cache directory."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    try:
        return run_child(Path(__file__).resolve(), kind, args, timeout, cwd=REPO,
                         env=dict(TQBENCH_CACHE_DIR=str(cache), PYTHONPATH=str(REPO)))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# --- parent ------------------------------------------------------------------------------------------------------------

def machine() -> dict:
    import textual

    return dict(machine_info(relevant=RELEVANT), textual_version=textual.__version__)


def summarize(runs: list[dict], repeats: int) -> dict:
    by = {m: [r for r in runs if r["mode"] == m] for m in ("view", "paused", "engine")}
    # pairs: consecutive view and paused replies of one process (the order alternates)
    tui = [r for r in runs if r["mode"] != "engine"]
    pairs = [(a, b) if a["mode"] == "view" else (b, a) for a, b in zip(tui[::2], tui[1::2])]
    ratios = [v["decode_tps"] / p["decode_tps"] for v, p in pairs]
    ratio = statistics.median(ratios)
    out = {m: dict(decode_tps_median=statistics.median(r["decode_tps"] for r in rs),
                   cpu_s_median=statistics.median(r["cpu_s"] for r in rs),
                   decode_tps=[round(r["decode_tps"], 2) for r in rs], misses=[r["misses"] for r in rs])
           for m, rs in by.items()}
    cpu = statistics.median(v["cpu_s"] / p["cpu_s"] for v, p in pairs)
    for m in ("view", "paused"):
        out[m]["ui_cpu_s_median"] = statistics.median(r["ui_cpu_s"] for r in by[m])
    # The view's whole cost on the UI thread (its handler, its lines, the compositor's work for them, the messages),
    # as CPU time: the UI thread's CPU seconds with the view minus without, over the reply's decode seconds. The
    # engine waits at most that long for the GIL, so it bounds the decode slowdown, and CPU time hardly moves with
    # other load on the machine (decode tok/s does, a lot, on a shared 2-core machine).
    bound = statistics.median((v["ui_cpu_s"] - p["ui_cpu_s"]) * v["decode_tps"] / v["tokens"] for v, p in pairs)
    out["view"]["batches_median"] = statistics.median(r["view_batches"] for r in by["view"])
    out["view"]["handler_s_median"] = statistics.median(r["view_handler_s"] for r in by["view"])
    out["view"]["render_s_median"] = statistics.median(r["view_render_s"] for r in by["view"])
    # the view's own UI-thread time (handler + the map's lines) over the reply's decode seconds
    out["view"]["ui_share_median"] = statistics.median(
        (r["view_handler_s"] + r["view_render_s"]) * r["decode_tps"] / r["tokens"] for r in by["view"])
    same_text = len({r["text"] for r in runs}) == 1
    pooled = sum(r["decode_tps"] for r in by["view"]) / sum(r["decode_tps"] for r in by["paused"])
    return dict(modes=out, view_over_paused=[round(x, 4) for x in ratios], ratio_median=round(ratio, 4),
                overhead=round(1 - ratio, 4), overhead_goal=OVERHEAD_GOAL, goal_met=1 - ratio < OVERHEAD_GOAL,
                ratio_of_means=round(pooled, 4), cpu_view_over_paused_median=round(cpu, 4),
                ui_overhead_bound=round(bound, 4), ui_bound_goal_met=bound < OVERHEAD_GOAL,
                paused_over_engine=round(out["paused"]["decode_tps_median"] / out["engine"]["decode_tps_median"], 4),
                same_text_everywhere=same_text, repeats=repeats, pairs=len(pairs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_options(p, DEFAULTS, QUICK, f"smoke run: {QUICK['repeats']} repeats")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed afterwards; a given "
                                             "one keeps the converted model for reuse)")
    p.add_argument("--out", type=Path, default=Path("bench-results/liveview.json"), help="JSON result file")
    p.add_argument("--no-openblas", action="store_true", help="do not re-execute with OpenBLAS in LD_PRELOAD")
    a = p.parse_args(argv)
    cfg = sizes(a, DEFAULTS, QUICK)

    tmp = a.work is None
    work = Path(tempfile.mkdtemp(prefix="tqbench-bench-liveview-")) if tmp else a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    doc: dict = dict(schema=SCHEMA, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=[sys.executable, *sys.argv],
                     machine=machine(), config=dict(cfg, quick=a.quick), runs=[])
    try:
        model = convert_demo(work)
        from tqbench.stream.budget import model_bytes

        mb = model_bytes(model)
        budget = int(cfg["budget_share"] * mb.experts) + cfg["workers"] * mb.one_expert  # + the read buffers
        doc["config"].update(budget_bytes=budget, expert_bytes=mb.experts)
        base = dict(model=str(model), budget=f"{budget}B", workers=cfg["workers"], prompt=cfg["prompt"],
                    size=cfg["size"])
        for i in range(cfg["repeats"]):
            # view/paused pairs, the order alternating: view paused, paused view, view paused, ...
            sequence = [m for k in range(cfg["pairs"]) for m in (("view", "paused"), ("paused", "view"))[(i + k) % 2]]
            for kind in ("tui", "engine"):
                for r in measure(kind, dict(base, sequence=sequence), work)["replies"]:
                    doc["runs"].append(dict(r, repeat=i))
                    print(f"repeat {i}: {r['mode']:<6} {r['decode_tps']:6.1f} tok/s  {r['misses']:4} misses  "
                          f"{r.get('view_batches', '-')} batches", flush=True)
        doc["summary"] = summarize(doc["runs"], cfg["repeats"])
        doc["machine"]["load_average_end"] = os.getloadavg()
        doc["total_seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        if tmp:
            shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    s = doc["summary"]
    print(f"\n{'mode':<8}{'tok/s (median)':>16}{'CPU s/reply':>13}  tok/s per reply")
    for m, v in s["modes"].items():
        print(f"{m:<8}{v['decode_tps_median']:>16.2f}{v['cpu_s_median']:>13.2f}  {v['decode_tps']}")
    print(f"\nview / paused: median {s['ratio_median']:.3f} (per repeat {s['view_over_paused']}); overhead "
          f"{s['overhead']:.1%}, goal < {OVERHEAD_GOAL:.0%}: {'met' if s['goal_met'] else 'NOT met'}")
    print(f"CPU seconds per reply, view / paused: median {s['cpu_view_over_paused_median']:.3f}")
    print(f"UI thread CPU per reply: view {s['modes']['view']['ui_cpu_s_median']:.3f} s, paused "
          f"{s['modes']['paused']['ui_cpu_s_median']:.3f} s; the view's share of the decode time (the bound on its "
          f"overhead): {s['ui_overhead_bound']:.1%}, goal < {OVERHEAD_GOAL:.0%}: "
          f"{'met' if s['ui_bound_goal_met'] else 'NOT met'}")
    v = s["modes"]["view"]
    print(f"view: {v['batches_median']:.0f} batches per reply, handler {v['handler_s_median'] * 1000:.1f} ms + map "
          f"lines {v['render_s_median'] * 1000:.1f} ms per reply ({v['ui_share_median']:.1%} of its decode time); "
          f"paused / engine "
          f"{s['paused_over_engine']:.3f}; same text everywhere: {s['same_text_everywhere']}")
    print(f"\nwrote {a.out} ({doc['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
    else:
        sys.exit(main())

"""`tqbench chat`: talk to a model from the terminal, a script or a pipe. Replies stream to stdout; loading, progress
and the per-reply summary go to stderr; `--json` prints one JSON object per line on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Iterable, Iterator, Optional

import typer
from rich.console import Console
from rich.text import Text

from tqbench import units
from tqbench.engine import Session
from tqbench.errors import ExitCode, TqbenchError

HELP_LINE = "commands: /reset (forget the conversation), /stats, /quit (or Ctrl-D); Ctrl-C stops a reply"


def chat(
    model: Annotated[Optional[Path], typer.Option("--model", "-m", metavar="DIR", help=(
        "Model directory: a tqbench conversion, a TurboQuant-MLX build, an MLX or source checkpoint "
        "(default: the last converted model, else the demo, converted first if needed)."))] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", metavar="TEXT",
                                                  help="Answer this one message and exit.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", help="Most tokens per reply (default: generation_config.json's, else 512).")] = None,
    temp: Annotated[Optional[float], typer.Option("--temp", help="Sampling temperature (0: greedy).")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (0: off).")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Sample among the k likeliest (0: off).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="A system message.")] = None,
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Send turns as plain text (a base model's continuation).")] = False,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Allow the model's own tokenizer code (needed for hub ids and non-K3 models "
                                    "that ship code; a local kimi_k3 directory is trusted).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line: tokens and a summary per reply.")] = False,
    cache_budget_gb: Annotated[Optional[str], typer.Option(
        "--cache-budget-gb", metavar="N|auto",
        help="Stream routed experts from disk with an expert cache of N GB (auto: the GPU working-set limit minus "
             "the resident weights and a 3 GB reserve). Default: resident when the model fits, else auto.")] = None,
    prefetch_workers: Annotated[int, typer.Option("--prefetch-workers", min=1, max=256,
                                                  help="Threads reading experts from disk.")] = 4,
    reads_in_flight: Annotated[int, typer.Option(
        "--reads-in-flight", metavar="N", min=0, max=256,
        help="At most N expert reads at once; the workers' copies into the cache still overlap them (0: one per "
             "worker). Some disks read one request at a time fastest.")] = 0,
    cache_policy: Annotated[str, typer.Option("--cache-policy", metavar="lrfu-next|lrfu|lru",
                                              help="Which cached expert to evict. lrfu-next also predicts each "
                                                   "layer's next routing: more hits than lrfu for 2-3x its "
                                                   "bookkeeping (about 12-16 ms a token at Kimi K3's scale).")
                                              ] = "lrfu-next",
    fanout: Annotated[bool, typer.Option("--fanout", help="Split each expert's read across the workers.")] = False,
    lookahead: Annotated[bool, typer.Option(
        "--lookahead", help="During decode, read the next layer's likely experts (its router applied to this "
                            "layer's input) while this layer computes.")] = False,
    page_cache: Annotated[str, typer.Option(
        "--page-cache", metavar="auto|on|off",
        help="Read experts through the OS page cache (on), around it (off: O_DIRECT / F_NOCACHE), or off when the "
             "model is much larger than memory (auto).")] = "auto",
    max_active_experts: Annotated[int, typer.Option(
        "--max-active-experts", metavar="K", min=0,
        help="Route each token to K experts instead of the model's top-k (0: native). Fewer bytes per token, but it "
             "changes the model's output.")] = 0,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", metavar="FILE", help="Start from this hot-expert profile (tqbench's export, or TurboQuant-MLX's "
                                          "pin list / usage profile) instead of the learned one.")] = None,
    profile_force: Annotated[bool, typer.Option(
        "--profile-force", help="Use a --profile made for another model of the same layers and experts.")] = False,
    no_learn: Annotated[bool, typer.Option("--no-learn", help="Do not learn from this session.")] = False,
    cold: Annotated[bool, typer.Option(
        "--cold", help="Start from no profile, whatever was learned or shipped (a baseline to compare with).")] = False,
    pin_share: Annotated[Optional[float], typer.Option(
        "--pin-share", min=0.0, max=0.9,
        help="Share of the expert cache pinned from the profile (streaming; 0: none, the profile still ranks the "
             "cache). Default 0.5 for a learned or given profile, 0.1 for a shipped one.")] = None,
    stats_json: Annotated[Optional[Path], typer.Option("--stats-json", metavar="FILE",
                                                       help="Write the streaming statistics here at exit.")] = None,
) -> None:
    """Chat with a model: streaming replies, thinking shown apart, the conversation's cache kept between turns.

    Interactive on a terminal (/reset, /stats, /quit; Ctrl-C stops a reply, not the session). With --prompt: one
    answer, then exit. With stdin not a terminal: each line is one user turn. Sampling defaults come from the model's
    generation_config.json.
    """
    if cold and profile:
        print("tqbench: error: --cold starts from no profile: leave out --profile", file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE)
    from tqbench.runtime.session import open_model

    err = Console(stderr=True, highlight=False, soft_wrap=True)  # piped lines never wrap
    session = Session()
    try:
        path = str(model) if model is not None else _default_model(err)
        streaming = _streaming(path, cache_budget_gb, prefetch_workers, cache_policy, fanout, page_cache, err, as_json)
        if streaming is not None and (lookahead or reads_in_flight):
            from dataclasses import replace

            streaming = replace(streaming, lookahead=lookahead, reads_in_flight=reads_in_flight)
        if not as_json:
            err.print(f"loading {path} ...", markup=False)
        from tqbench.runtime.session import ProfileOptions

        popts = ProfileOptions(str(profile) if profile else None, not no_learn, pin_share, profile_force, cold=cold)
        with session.submit(lambda s: open_model(s, path, trust_remote_code, system, not no_chat_template, streaming,
                                                 max_active_experts, popts, max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k,
                                                 seed=seed)) as job:
            loaded = job.result()[-1]
        if not as_json:
            err.print(_loaded_line(loaded), markup=False)
            if loaded.profile is not None:
                err.print(_profile_line(loaded.profile), markup=False)
        if loaded.experts_active and loaded.experts_native > 2 * loaded.experts_active:
            err.print(f"warning: routing to {loaded.experts_active} of the model's {loaded.experts_native} experts per "
                      "token (more than a 2x cut): expect worse answers", markup=False)
        interactive = prompt is None and sys.stdin.isatty()
        if interactive and not as_json:
            err.print(HELP_LINE, markup=False)
        turns = [prompt] if prompt is not None else (_typed(err) if interactive else _lines(sys.stdin))
        _converse(session, loaded, turns, as_json, interactive, err)
    except TqbenchError as e:
        print(f"tqbench: error: {e}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None
    finally:
        if stats_json is not None:
            _write_stats(session, stats_json)
        session.close()


def _streaming(path: str, budget: str | None, workers: int, policy: str, fanout: bool, page_cache: str, err: Console,
               quiet: bool):
    """A StreamConfig when experts should stream (asked for, or the model does not fit), else None."""
    from tqbench.recipe.fit import parse_size
    from tqbench.stream import StreamConfig
    from tqbench.stream.budget import auto_budget, needs_streaming

    from tqbench.stream.cache import POLICIES

    if policy not in POLICIES:
        raise TqbenchError(f"--cache-policy {policy!r}: choose {', '.join(POLICIES)}")
    if page_cache not in ("auto", "on", "off"):
        raise TqbenchError(f"--page-cache {page_cache!r}: choose auto, on or off")
    experts = _experts(path)  # read once for the decisions below
    if budget is None:
        if experts is None or not needs_streaming(path, store=experts):
            return None
        budget = "auto"
        if not quiet:
            err.print("the model does not fit in memory: streaming its experts from disk (--cache-budget-gb auto)",
                      markup=False)
    if experts is None:
        raise TqbenchError("no routed experts to stream (neither tqbench's expert_map.json nor stacked "
                           "switch_mlp tensors); run it resident without --cache-budget-gb", path)
    if budget.strip().lower() == "auto":
        nbytes = auto_budget(path, store=experts)
    else:
        try:
            nbytes = parse_size(budget + ("" if budget.strip()[-1:].isalpha() else "GB"))
        except (ValueError, TqbenchError):
            raise TqbenchError(f"--cache-budget-gb {budget!r}: give a number of GB or auto") from None
    return StreamConfig(nbytes, workers, policy, fanout, page_cache)


def _experts(path: str):
    """The model's expert layout (tqbench.stream.ExpertStore, closed), or None when it has no routed experts."""
    from tqbench.stream.store import ExpertStore, StoreError

    try:
        store = ExpertStore.open(Path(path))
    except (StoreError, TqbenchError, OSError):
        return None
    store.close()
    return store


def _write_stats(session: Session, file: Path) -> None:
    from tqbench.convert.journal import write_atomic
    from tqbench.runtime.session import KEY, stream_stats

    try:
        stats = session.call(lambda s: stream_stats(s) if KEY in s.state else None)
        prof = session.call(lambda s: s.state.get("profile-info"))
    except Exception:  # noqa: BLE001 - nothing loaded: nothing to write
        return
    if stats is not None:
        stats["profile"] = prof
        write_atomic(file, (json.dumps(stats, indent=2) + "\n").encode())

def _default_model(err: Console) -> str:
    from tqbench.cli.convert import _render, _render_plain
    from tqbench.engine import submit
    from tqbench.runtime.models import ModelChosen, choose_model

    with submit(choose_model) as job:
        events = iter(job)
        chosen = None

        def conversion() -> Iterator:
            nonlocal chosen
            for ev in events:
                if isinstance(ev, ModelChosen):
                    chosen = ev
                    return
                yield ev

        first = next(events)
        if isinstance(first, ModelChosen):
            chosen = first
        else:
            err.print("no model given and none converted yet: converting the demo first", markup=False)
            from itertools import chain
            (_render if err.is_terminal else _render_plain)(chain([first], conversion()), err)
            for ev in events:
                if isinstance(ev, ModelChosen):
                    chosen = ev
    if chosen is None:
        raise TqbenchError("could not choose a model")
    err.print(f"model: {chosen.path} ({chosen.why})", markup=False)
    return chosen.path


def _loaded_line(m) -> str:
    tq = f", {m.turboquant_modules} TurboQuant modules" if m.turboquant_modules else ""
    s = m.sampling
    sampling = "greedy" if s.temp == 0 else f"temp {s.temp:g}" + (f", top-p {s.top_p:g}" if s.top_p else "") + (
        f", top-k {s.top_k}" if s.top_k else "")
    template = "" if m.chat_template else ", no chat template (plain text turns)"
    stream = ""
    if m.stream:
        st = m.stream
        n = st.get("reads_in_flight") or 0
        gate = f", {n} read{'s' if n > 1 else ''} in flight" if n else ""
        stream = (f"; streaming experts: cache {units.size(st['budget_bytes'])} ({st['slots']} slots, "
                  f"{st['workers']} read workers, {st['policy']}{', fan-out' if st['fanout'] else ''}"
                  f"{', look-ahead' if st.get('lookahead') else ''}{gate}, page cache {st['page_cache']})")
    routed = (f"; {m.experts_active} of {m.experts_native} experts per token"
              if m.experts_active and m.experts_active != m.experts_native else "")
    return (f"loaded {m.model_type}{tq}: {units.size(m.weight_bytes)} of resident weights in {m.seconds:.1f} s; "
            f"{sampling}, up to {s.max_tokens} tokens per reply{template}{stream}{routed}")


def _profile_line(p: dict) -> str:
    src = {"file": f"from {p['where']}", "learned": f"learned ({p['routings']:,} routings)",
           "shipped": f"shipped ({p['where']})",
           "none": "none (--cold)" if p["where"] == "cold" else "none yet"}[p["source"]]
    pins = f"; pinned {p['pinned']} experts (preloaded in {p['preload_s']:.2f} s)" if p["pinned"] else ""
    learn = "learning from this session" if p["learning"] else "not learning (--no-learn)"
    return f"hot-expert profile: {src}{pins}; {learn}"


def _typed(err: Console) -> Iterator[str]:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # at the prompt, Ctrl-C leaves
            print(file=sys.stderr)
            return
        if line.strip():
            yield line


def _lines(stream: Iterable[str]) -> Iterator[str]:
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def _converse(session: Session, loaded, turns: Iterable[str], as_json: bool, interactive: bool,
              err: Console) -> None:
    from tqbench.runtime.session import last_reply, reset

    out = Console(highlight=False, soft_wrap=True, markup=False)
    for text in turns:
        command = text.strip().lower()
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            session.call(reset)
            err.print("conversation reset", markup=False)
            continue
        if command == "/stats":
            _stats(session, loaded, err)
            continue
        done = _reply(session, text, loaded.sampling, as_json, out, interactive)
        if done is None:  # stopped with Ctrl-C
            done = session.call(last_reply)
            if not as_json:
                out.print()
                err.print("[stopped]", markup=False)
            if not interactive:
                if as_json:
                    print(json.dumps(done.to_dict()), flush=True)
                raise typer.Exit(ExitCode.INTERRUPTED)
        if as_json:
            print(json.dumps(done.to_dict()), flush=True)
        else:
            err.print(_summary(done), markup=False, style="dim")


def _reply(session: Session, text: str, sampling, as_json: bool, out: Console, interactive: bool):
    from tqbench.runtime.chat import ReplyDone, TokenOut
    from tqbench.runtime.session import reply

    done = None
    try:
        with session.submit(lambda s: reply(s, text, sampling)) as job:
            for ev in job:
                if isinstance(ev, TokenOut):
                    if as_json:
                        print(json.dumps({"event": "token", "id": ev.id, "text": ev.text, "thinking": ev.thinking}),
                              flush=True)
                    elif ev.text:
                        out.print(Text(ev.text, style="dim italic" if ev.thinking else ""), end="")
                        out.file.flush()
                elif isinstance(ev, ReplyDone):
                    done = ev
    except KeyboardInterrupt:  # leaving the with block closed the reply on the engine thread
        return None
    if not as_json:
        out.print()
    return done


def _summary(d) -> str:
    cached = f", {d.cached_tokens} reused from the cache" if d.cached_tokens else ""
    stop = {"length": " (max tokens)", "cancelled": " (stopped)"}.get(d.finish_reason, "")
    return (f"[{d.generated_tokens} tokens{stop}, {d.decode_tps:.1f} tok/s; prompt {d.prompt_tokens} tokens at "
            f"{d.prefill_tps:.1f} tok/s{cached}; peak memory {units.size(d.peak_memory_bytes)}]")


def _stats(session: Session, loaded, err: Console) -> None:
    from tqbench.runtime.session import conversation

    tokens, turns, last = session.call(lambda s: (len(conversation(s).tokens),
                                                  conversation(s).turns,
                                                  conversation(s).last))
    err.print(f"model {loaded.path} ({loaded.model_type}), {units.size(loaded.weight_bytes)} of weights; "
              f"conversation: {turns} turns, {tokens} tokens in the cache", markup=False)
    if last is not None:
        err.print("last reply: " + _summary(last), markup=False)
    from tqbench.runtime.session import stream_stats

    st = session.call(stream_stats)
    if st is not None:
        err.print(f"experts: {st['hits']} hits ({st['hits_pinned']} pinned, {st['hits_prefetched']} read ahead in "
                  f"time), {st['misses']} misses, hit rate "
                  f"{st['hit_rate']:.1%}; {units.size(st['critical_bytes'])} read in {st['reads']} reads, "
                  f"{st['evictions']} evictions; cache {units.size(st['cache_bytes'])} of "
                  f"{units.size(st['budget_bytes'])} (max {units.size(st['cache_bytes_max'])}); "
                  f"stalled {st['stall_s']:.2f} s over {st['tokens']} forward passes", markup=False)
        if st.get("disk_bytes_per_s_on_misses") or st.get("disk_bytes_per_s"):
            got = st.get("disk_bytes_per_s_on_misses")
            disk = st.get("disk_bytes_per_s")
            err.print("disk: " + (f"{units.gb(got)}/s while waiting on misses" if got else "no misses yet")
                      + (f", this disk reads {units.gb(disk)}/s ({st['disk_source']})" if disk else ""),
                      markup=False)

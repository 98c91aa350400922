"""`tqbench chat`: talk to a model from the terminal, a script or a pipe. Replies stream to stdout; loading, progress
and the per-reply summary go to stderr; `--json` prints one JSON object per line on stdout."""

from __future__ import annotations

import json
import sys
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterable, Iterator, Optional

import typer
from rich.console import Console
from rich.text import Text

from tqbench.chat import report
from tqbench.chat.events import (KernelsCompiling, MlxWarmedUp, MlxWarmup, ModelChosen, ModelLoaded, PageIn,
                                 PrefillProgress, ReplyDone, ReplyStarted, StreamPlan, TokenOut)
from tqbench.chat.request import ChatRequest, ProfileOptions, SamplingRequest, StreamRequest
from tqbench.cli import options
from tqbench.cli.errors import say_error
from tqbench.distributed.world import env_rank
from tqbench.errors import ExitCode, TqbenchError, UsageError
from tqbench.writable import check_output_file

if TYPE_CHECKING:  # importing them loads MLX: done when a chat starts
    from tqbench.chat.session import ChatSession

HELP_LINE = "commands: /reset (forget the conversation), /stats, /quit (or Ctrl-D); Ctrl-C stops a reply"
# mlx.launch copies its standard input to every rank's but never closes theirs: only /quit ends the chat
LAUNCHED_HELP_LINE = ("each line is a turn; commands: /reset, /stats, /quit (under mlx.launch the end of input does "
                      "not reach the ranks: end with /quit)")


@options.takes(sampling=options.SAMPLING, stream=options.STREAMING, profile=options.PROFILE)
def chat(
    model: options.Model = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", metavar="TEXT",
                                                  help="Answer this one message and exit.")] = None,
    sampling: SamplingRequest = options.FROM_OPTIONS,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", help="A system message.")] = None,
    no_chat_template: options.NoChatTemplate = False,
    trust_remote_code: options.TrustRemoteCode = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line: tokens and a summary per reply.")] = False,
    stream: StreamRequest = options.FROM_OPTIONS,
    max_active_experts: options.MaxActiveExperts = 0,
    profile: ProfileOptions = options.FROM_OPTIONS,
    parallel: options.Parallel = "pipeline",
    no_prompt_cache: options.NoPromptCache = False,
    stats_json: Annotated[Optional[Path], typer.Option("--stats-json", metavar="FILE",
                                                       help="Write the streaming statistics here at exit.")] = None,
) -> None:
    """Chat with a model: streaming replies, thinking shown apart, the conversation's cache kept between turns.

    Interactive on a terminal (/reset, /stats, /quit; Ctrl-C stops a reply, not the session). With --prompt: one
    answer, then exit. With stdin not a terminal: each line is one user turn. Sampling defaults come from the model's
    generation_config.json.
    """
    from tqbench.chat.session import ChatSession

    err = Console(stderr=True, highlight=False, soft_wrap=True)  # piped lines never wrap
    chat_session = ChatSession()
    try:
        request = ChatRequest(model=str(model) if model is not None else None, sampling=sampling, system=system,
                              chat_template=not no_chat_template, trust_remote_code=trust_remote_code, stream=stream,
                              max_active_experts=max_active_experts, profile=profile, parallel=parallel,
                              prompt_store=not no_prompt_cache)
        if prompt is not None and not prompt.strip():
            raise UsageError("--prompt is empty: give the message to answer")
        if parallel == "tensor" and env_rank() is None:
            raise UsageError("--parallel tensor splits every layer across the ranks mlx.launch starts: run it under "
                             "mlx.launch")
        if stats_json is not None:  # it can be written once the chat is over: checked before any work
            check_output_file(stats_json, "--stats-json")
        loaded = open_chat(chat_session, request, err, quiet=as_json, streaming_stats=stats_json is not None)
        if env_rank():  # another rank than 0 of a pipeline: it runs the turns rank 0 shares, and prints nothing
            follow_turns(chat_session)
            return
        if as_json:  # what runs, first: a script can tell a native model from a changed one
            print(json.dumps(loaded.to_dict()), flush=True)
        else:
            err.print(report.loaded_line(loaded), markup=False)
            if loaded.profile is not None:
                err.print(report.profile_line(loaded.profile), markup=False)
        warning = report.fewer_experts_warning(loaded)
        if warning:
            err.print(warning, markup=False)
        interactive = prompt is None and sys.stdin.isatty()
        if interactive and not as_json:
            err.print(HELP_LINE, markup=False)
        elif prompt is None and env_rank() is not None and not as_json:
            err.print(LAUNCHED_HELP_LINE, markup=False)
        turns = [prompt] if prompt is not None else (_typed(err) if interactive else _lines(sys.stdin))
        _converse(chat_session, loaded, turns, as_json=as_json, interactive=interactive, err=err)
    except TqbenchError as e:
        say_error(e)
        raise typer.Exit(e.exit_code) from None
    finally:
        if stats_json is not None and not env_rank():  # rank 0 writes every rank's figures; the others write nothing
            _write_stats(chat_session, stats_json)
        chat_session.close()


def open_chat(chat_session: ChatSession, request, err: Console, quiet: bool, streaming_stats: bool) -> ModelLoaded:
    """Open the chat: the demo's conversion progress when it has to be converted first, then the model's lines.
    `streaming_stats`: --stats-json was given, so a model whose experts stay resident is refused before it loads."""
    from tqbench.cli.convert import render_progress
    from tqbench.cli.warmup import KernelProgress

    loaded, chosen = None, ""
    with chat_session.open(request) as job, KernelProgress(err) as kernels:
        events = iter(job)
        for ev in events:
            match ev:
                case ModelChosen():
                    chosen = ev.path
                    if request.model is None:
                        err.print(f"model: {ev.path} ({ev.why})", markup=False)
                case StreamPlan():  # before the model loads
                    if streaming_stats and ev.config is None:
                        raise UsageError(f"--stats-json writes streaming statistics, and this model's experts run "
                                         f"resident ({ev.reason}): stream them with --cache-budget-gb, or leave out "
                                         "--stats-json")
                    if not quiet:
                        err.print(f"loading {chosen} ...", markup=False)
                    if ev.note and not quiet:
                        err.print(ev.note, markup=False)
                case KernelsCompiling():  # CUDA: after the model loads
                    kernels.show(ev)
                case ModelLoaded():
                    loaded = ev
                case _:  # a ConvertEvent: with no model named and none converted yet, the demo is converted first
                    err.print("no model given and none converted yet: converting the demo first", markup=False)
                    render_progress(chain([ev], events), err)  # up to its ConvertFinished
    if loaded is None:
        raise TqbenchError("could not open a model")
    return loaded


def follow_turns(chat_session: ChatSession) -> None:
    """Another rank than 0: run the turns rank 0 shares until it ends (tqbench.distributed.turns)."""
    with chat_session.follow() as job:
        for _ in job:
            pass


def _write_stats(chat_session: ChatSession, file: Path) -> None:
    from tqbench.atomic import write_json

    try:
        stats = chat_session.stats()
    except Exception:  # noqa: BLE001 - nothing loaded: nothing to write
        return
    if stats is not None:
        write_json(file, stats.to_dict())


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
        except KeyboardInterrupt:  # at the prompt, Ctrl-C leaves (exit 130, as every command interrupted)
            print(file=sys.stderr)
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        if line.strip():
            yield line


def _lines(stream: Iterable[str]) -> Iterator[str]:
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def _converse(chat_session: ChatSession, loaded: ModelLoaded, turns: Iterable[str], as_json: bool,
              interactive: bool, err: Console) -> None:
    out = Console(highlight=False, soft_wrap=True, markup=False)
    for text in turns:
        command = text.strip().lower()
        if command in ("/quit", "/exit"):
            return
        if command == "/reset":
            chat_session.reset()
            err.print("conversation reset", markup=False)
            continue
        if command == "/stats":
            for line in report.stats_lines(loaded, chat_session.status(), chat_session.stats()):
                err.print(line, markup=False)
            continue
        done = _reply(chat_session, text, as_json, out, err)
        if done is None:  # stopped with Ctrl-C
            done = chat_session.last_reply()
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
            err.print(report.reply_line(done), markup=False, style="dim")


def _reply(chat_session: ChatSession, text: str, as_json: bool, out: Console, err: Console) -> ReplyDone | None:
    """Stream one reply to stdout; its summary, or None when Ctrl-C stopped it. MLX's warm-up before the process's
    first token goes to stderr."""
    from tqbench.cli.warmup import MlxWarmupStatus, PrefillStatus

    done = None
    try:
        with chat_session.reply(text) as job, MlxWarmupStatus(err) as warmup, PrefillStatus(err) as prompt:
            for ev in job:
                match ev:
                    case PrefillProgress():
                        prompt.show(ev)
                    case TokenOut() if as_json:
                        print(json.dumps({"event": "token", "id": ev.id, "text": ev.text, "thinking": ev.thinking}),
                              flush=True)
                    case TokenOut():
                        if ev.text:
                            out.print(Text(ev.text, style="dim italic" if ev.thinking else ""), end="")
                            out.file.flush()
                    case ReplyDone():
                        done = ev
                    case MlxWarmup():
                        warmup.started(ev)
                    case MlxWarmedUp():
                        warmup.ended(ev)
                    case ReplyStarted() | PageIn():  # the terminal face shows neither (the TUI does)
                        pass
    except KeyboardInterrupt:  # leaving the with block closed the reply on the engine thread
        return None
    if not as_json:
        out.print()
    return done

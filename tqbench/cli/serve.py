"""`tqbench serve`: the OpenAI API on the engine's chat model (tqbench.serve). Loading goes to stderr as in chat;
then a live status on a terminal, or one line per request when stderr is not one."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from tqbench.chat import report as chat_report
from tqbench.chat.request import ChatRequest, ProfileOptions, SamplingRequest, StreamRequest
from tqbench.cli import options
from tqbench.cli.errors import say_error
from tqbench.cli.chat import follow_turns, open_chat
from tqbench.distributed.world import env_rank
from tqbench.errors import ExitCode, TqbenchError
from tqbench.serve import report

REFRESH_S = 0.5


@options.takes(sampling=options.SAMPLING, stream=options.STREAMING, profile=options.PROFILE)
def serve(
    model: options.Model = None,
    host: Annotated[str, typer.Option("--host", metavar="HOST",
                                      help="Address to listen on (another than 127.0.0.1 prints a warning).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: any free one).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", metavar="KEY", envvar="TQBENCH_API_KEY",
        help="Every request must send `Authorization: Bearer KEY` (401 otherwise). Also $TQBENCH_API_KEY.")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, metavar="N",
                                           help="Requests that may wait behind the running one (more: 429).")] = 16,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", min=0.001, metavar="MB",
                                               help="Largest request body (larger: 413).")] = 4.0,
    prompt_cache_gb: Annotated[float, typer.Option(
        "--prompt-cache-gb", min=0.0, metavar="GB",
        help="Prompt caches kept across requests, least recently used dropped first (0: none).")] = 2.0,
    max_requests: Annotated[int, typer.Option("--max-requests", min=0, metavar="N",
                                              help="Stop after N completions (0: serve until Ctrl-C).")] = 0,
    sampling: SamplingRequest = options.FROM_OPTIONS,
    no_chat_template: options.NoChatTemplate = False,
    trust_remote_code: options.TrustRemoteCode = False,
    stream: StreamRequest = options.FROM_OPTIONS,
    max_active_experts: options.MaxActiveExperts = 0,
    profile: ProfileOptions = options.FROM_OPTIONS,
    no_prompt_cache: options.NoPromptCache = False,
) -> None:
    """Serve a model over the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

    Requests run one at a time on the engine, the rest wait in order. A request that extends an earlier
    conversation reuses its prompt cache. Streamed experts, the learned profile (which keeps learning) and
    --max-active-experts and --cache-routing work as in chat. Sampling options set the defaults a request may override.
    """
    from tqbench.chat.session import ChatSession
    from tqbench.serve.http import Server, warn_if_exposed
    from tqbench.serve.service import ServeOptions, Service

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    session = ChatSession()
    server = None
    try:
        request = ChatRequest(model=str(model) if model is not None else None, sampling=sampling,
                              chat_template=not no_chat_template, trust_remote_code=trust_remote_code, stream=stream,
                              max_active_experts=max_active_experts, profile=profile,
                              prompt_cache_bytes=int(prompt_cache_gb * 1e9), prompt_store=not no_prompt_cache)
        if env_rank():  # another rank than 0 of a pipeline: no socket; it runs each request rank 0 shares
            open_chat(session, request, err, quiet=True, streaming_stats=False)
            follow_turns(session)
            return
        server = Server(host, port)  # a port in use is an error before the model loads
        loaded = open_chat(session, request, err, quiet=False, streaming_stats=False)
        err.print(chat_report.loaded_line(loaded), markup=False)
        if loaded.profile is not None:
            err.print(chat_report.profile_line(loaded.profile), markup=False)
        warning = chat_report.fewer_experts_warning(loaded)
        if warning:
            err.print(warning, markup=False)
        opts = ServeOptions(host=host, port=server.port, api_key=api_key or None, max_queue=max_queue,
                            max_body_bytes=int(max_body_mb * 1e6), max_requests=max_requests)
        service = Service(session, loaded, opts)
        server.start(service)
        exposed = warn_if_exposed(host)
        if exposed:
            err.print(exposed, markup=False)
        err.print(report.serving_line(server.url, service.model_id, bool(api_key)), markup=False)
        _watch(service, err)
    except TqbenchError as e:
        say_error(e)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:  # the running requests stop after their token (`finally`); exit 130 as every command
        err.print("stopped", markup=False)
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    finally:
        if server is not None:
            server.close()
        session.close()  # saves what the profile learned


def _watch(service, err: Console) -> None:
    """Until Ctrl-C or --max-requests: a live status on a terminal, else each request's line."""
    from tqbench.serve.service import RequestDone

    shown: list = []  # MLX's warm-up events already told
    with service.watch() as watcher:
        try:
            if err.is_terminal:
                with Live(Text("\n".join(report.status_lines(service.status()))), console=err,
                          refresh_per_second=1 / REFRESH_S, transient=True) as live:
                    while not service.wait_ended(0):
                        for ev in watcher.get(REFRESH_S):
                            if isinstance(ev, RequestDone):
                                live.console.print(report.request_line(ev), markup=False)
                        for line in _warmup_lines(service, shown):
                            live.console.print(line, markup=False)
                        live.update(Text("\n".join(report.status_lines(service.status()))))
            else:
                while not service.wait_ended(0):
                    for ev in watcher.get(REFRESH_S):
                        if isinstance(ev, RequestDone):
                            err.print(report.request_line(ev), markup=False)
                    for line in _warmup_lines(service, shown):
                        err.print(line, markup=False)
            for ev in watcher.get(0):  # ended by --max-requests: the last request's line, published as it ended
                if isinstance(ev, RequestDone):
                    err.print(report.request_line(ev), markup=False)
        finally:  # the totals, once, however it ends (the live region is gone by now)
            for line in report.status_lines(service.status()):
                err.print(line, markup=False)


def _warmup_lines(service, shown: list) -> list[str]:
    """MLX's warm-up in the first request (CUDA), each step told once: the chat's lines."""
    from tqbench.chat.events import MlxWarmup

    ev = service.warmup
    if ev is None or ev in shown:
        return []
    shown.append(ev)
    if isinstance(ev, MlxWarmup):
        return [chat_report.mlx_warmup_line(ev)]
    return [chat_report.mlx_warmed_line(ev)] if ev.compiled else []

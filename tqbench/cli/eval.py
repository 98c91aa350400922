"""`tqbench eval`: what a model loses, measured. Progress (with ETA) goes to stderr, the tables or `--json` (schema
tqbench.eval/1) to stdout. The numbers are the engine's (tqbench.eval); this module only renders them.

Registered in main.py with `app.command(name="eval")(eval_model)`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from tqbench import units
from tqbench.chat.request import StreamRequest
from tqbench.cli import options
from tqbench.cli.errors import say_error
from tqbench.cli.render import show
from tqbench.errors import TqbenchError

STAGES = {"score": "scoring", "greedy": "generating", "layers": "layers", "tools": "tool calls"}
UNITS = {"tools": "calls"}  # what a stage counts (tokens unless named here)


@options.takes(stream=options.STREAMING)
def eval_model(
    model: Annotated[Path, typer.Argument(metavar="MODEL", help="Model directory to evaluate (converted, MLX or "
                                                                "source checkpoint).")],
    against: Annotated[Optional[Path], typer.Option(
        "--against", metavar="SRC", help="Reference model (usually the source checkpoint): per-token KL(SRC || "
                                         "MODEL), top-1 agreement, top-5 overlap and greedy agreement.")] = None,
    text: Annotated[Optional[list[Path]], typer.Option(
        "--text", metavar="FILE", help="Score this UTF-8 text file (repeat for several; default: the demo's held-out "
                                       "code and chat).")] = None,
    window: Annotated[int, typer.Option("--window", min=2, max=1 << 20,
                                        help="Context window in tokens; each window starts from an empty context.")
                      ] = 256,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Predicted tokens to score, spread over the texts.")
                      ] = 4096,
    prompts: Annotated[int, typer.Option("--prompts", min=0, help="Greedy agreement: prompts (0: skip it).")] = 4,
    generate: Annotated[int, typer.Option("--generate", min=0, help="Greedy agreement: tokens per prompt.")] = 32,
    layers: Annotated[bool, typer.Option(
        "--layers", help="Quick mode: each layer's hidden-state relative error, both models run on SRC's own input "
                         "to that layer.")] = False,
    max_active_experts: options.MaxActiveExperts = 0,
    decode: Annotated[bool, typer.Option(
        "--decode", help="Score token by token through a KV cache, one token per pass as a chat decodes (always with "
                         "--cache-routing): the expert cache sees decode's misses.")] = False,
    tools: Annotated[bool, typer.Option(
        "--tools", help="Score tool calls instead of texts: the demo's held-out tool conversations (valid calls, "
                        "exact calls, agreement with SRC's own call, answers quoting the tool's result).")] = False,
    tools_file: Annotated[Optional[Path], typer.Option(
        "--tools-file", metavar="JSONL", help="Score these tool conversations (one JSON object a line: tools and "
                                              "messages with one reference tool call); implies --tools.")] = None,
    tool_cases: Annotated[int, typer.Option("--tool-cases", min=0, help="Score the first N tool cases (0: all).")
                          ] = 0,
    tool_temp: Annotated[float, typer.Option(
        "--tool-temp", min=0.0, help="Sample MODEL's tool calls and answers at this temperature, seeded per case "
                                     "(0: greedy; SRC's calls stay greedy).")] = 0.0,
    tool_syntax: options.ToolSyntax = None,
    stream: StreamRequest = options.FROM_OPTIONS,
    trust_remote_code: options.TrustRemoteCode = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON (stable schema) on stdout.")] = False,
) -> None:
    """Measure a model's quality: perplexity, and against a reference model KL, agreement and greedy agreement.

    Both models run on the same token windows; their experts stream from disk with the usual budget flags (the same
    for both), so models larger than memory and source checkpoints (mxfp4, bf16) are evaluated as they are.
    --max-active-experts and --cache-routing change MODEL's routing only, so `tqbench eval M --against M
    --max-active-experts 4` measures a routing setting against native routing.
    """
    from tqbench.engine import submit
    from tqbench.eval import EvalProgress, EvalReport, EvalRequest, EvalStarted, evaluate
    from tqbench.eval.report import report_dict

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        request = EvalRequest(
            model=str(model), against=str(against) if against is not None else None,
            texts=tuple(str(t) for t in text or ()), window=window, tokens=tokens, prompts=prompts,
            prompt_tokens=min(32, window), generate=generate, layers=layers, max_active_experts=max_active_experts,
            stream=stream, trust_remote_code=trust_remote_code, decode=decode, tools=tools,
            tools_file=str(tools_file) if tools_file is not None else None, tool_cases=tool_cases,
            tool_temp=tool_temp, tool_syntax=tool_syntax or "sample").check()
        report = None
        with submit(lambda: evaluate(request)) as events:
            progress = _Progress(err)
            for ev in events:
                if isinstance(ev, EvalStarted):
                    err.print(started_line(ev), markup=False)
                elif isinstance(ev, EvalProgress):
                    progress.update(ev)
                elif isinstance(ev, EvalReport):
                    report = ev
            progress.close()
    except TqbenchError as e:
        say_error(e)
        raise typer.Exit(e.exit_code) from None
    if report is None:
        raise TqbenchError("the evaluation ended without a result")
    if as_json:
        print(json.dumps(report_dict(report), indent=1))
    else:
        show(Console(highlight=False), *tables(report))


def started_line(ev) -> str:
    what = f"{ev.model} against {ev.against}" if ev.against else ev.model
    routing = ""
    if ev.native_experts and ev.max_active_experts != ev.native_experts:
        routing = f", {ev.max_active_experts} of {ev.native_experts} experts per token"
    if ev.cache_routing:
        routing += f", routing changed: cache routing margin {ev.cache_routing:g}"
    if ev.tool_cases:
        return f"evaluating {what}: {ev.tool_cases} tool calls ({ev.tool_set}){routing}"
    mode = "layer by layer, " if ev.layers else "token by token, " if ev.decode else ""
    fewer = f" (all the texts hold: fewer than the {ev.asked_tokens:,} asked)" if ev.asked_tokens else ""
    return (f"evaluating {what}: {mode}{ev.tokens:,} tokens in {ev.windows} windows of {ev.window} "
            f"({', '.join(ev.texts)}){routing}{fewer}")


class _Progress:
    """A rich bar with ETA on a terminal; piped, a line at each quarter of each stage."""

    def __init__(self, err: Console) -> None:
        self.err = err
        self.bar = None
        self.tasks: dict[str, int] = {}
        self.said: dict[str, int] = {}
        if err.is_terminal:
            columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.bar = Progress(*columns, console=err)
            self.bar.start()

    def update(self, ev) -> None:
        if self.bar is not None:
            if ev.stage not in self.tasks:
                self.tasks[ev.stage] = self.bar.add_task(STAGES[ev.stage], total=ev.total,
                                                         unit=UNITS.get(ev.stage, "tokens"))
            self.bar.update(self.tasks[ev.stage], completed=ev.done)
            return
        quarter = 4 * ev.done // ev.total
        if quarter > self.said.get(ev.stage, 0):
            self.said[ev.stage] = quarter
            eta = f", {ev.eta_s:.0f} s left" if ev.eta_s else ""
            print(f"{STAGES[ev.stage]} {ev.done:,}/{ev.total:,} {UNITS.get(ev.stage, 'tokens')} "
                  f"({ev.done / ev.total:.0%}), "
                  f"{ev.elapsed_s:.0f} s{eta}", file=self.err.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _f(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def tables(r) -> list:
    out = []
    if r.texts:
        compare = r.against is not None
        t = Table(title=f"quality of {r.model}" + (f" against {r.against}" if compare else ""), title_justify="left")
        for c in ("text", "tokens", "perplexity") + (("SRC perplexity", "KL", "top-1 agree", "top-5 overlap") if compare else ()):
            t.add_column(c, justify="left" if c == "text" else "right")
        for s in (*r.texts, r.total) if len(r.texts) > 1 else r.texts:
            row = [s.name, f"{s.tokens:,}", f"{s.perplexity:.3f}"]
            if compare:
                row += [f"{s.ref_perplexity:.3f}", _f(s.kl), _f(s.top1_agreement), _f(s.top5_overlap)]
            t.add_row(*row)
        notes = [f"window {r.window}", f"model {units.size(r.model_bytes)} resident"]
        if r.recipe:
            notes.append(f"recipe {r.recipe}")
        if r.native_experts:
            notes.append(f"{r.max_active_experts} of {r.native_experts} experts per token")
        if r.cache_routing:
            notes.append(f"routing changed: cache routing margin {r.cache_routing:g}")
        if r.decode:
            notes.append("scored token by token")
        if r.model_misses_per_token is not None:
            notes.append(f"model {r.model_misses_per_token:.2f} misses and {r.model_substitutions_per_token:.2f} "
                         "substitutions a token")
        if r.model_tiers is not None and r.model_tiers.host:
            t = r.model_tiers
            notes.append(f"model experts from gpu {t.gpu:.1%}, host {t.host:.1%}, disk {t.disk:.1%}")
        for who, n in (("model", r.model_read_bytes), ("SRC", r.against_read_bytes)):
            if n is not None:
                notes.append(f"{who} streamed {units.gb(n)} of experts ({units.gb(n // r.total.tokens)} a token)")
        notes.append(f"{r.seconds:.1f} s")
        t.caption = "; ".join(notes)
        out.append(t)
    if r.greedy is not None:
        g = r.greedy
        out.append(f"greedy agreement: {sum(g.alike)} of {g.prompts * g.generated} generated tokens alike before the "
                   f"first difference ({g.share:.0%}; per prompt {', '.join(map(str, g.alike))} of {g.generated})")
    if r.tools is not None:
        out.append(tools_table(r))
    if r.layers:
        t = Table(title=f"layer errors of {r.model} against {r.against} (teacher-forced)", title_justify="left")
        for c in ("layer", "attention", "mlp", "rel. error"):
            t.add_column(c, justify="right" if c in ("layer", "rel. error") else "left")
        for x in r.layers:
            t.add_row(str(x.layer), x.attention, x.mlp, f"{x.rel_error:.4f}")
        t.caption = f"window {r.window}; {r.seconds:.1f} s"
        out.append(t)
    return out


def _share(n: int | None, of: int) -> str:
    return "-" if n is None else f"{n} of {of} ({n / of:.0%})" if of else "-"


def tools_table(r):
    """The tool-call scores: one row per figure, the model's and (with --against) SRC's."""
    s = r.tools
    compare = s.source_valid is not None
    t = Table(title=f"tool calls of {r.model}" + (f" against {r.against}" if compare else ""), title_justify="left")
    for c in ("", "model") + (("SRC",) if compare else ()):
        t.add_column(c, justify="left" if not c else "right")
    rows = [("valid calls", _share(s.valid, s.cases), _share(s.source_valid, s.cases)),
            ("exact (= reference)", _share(s.exact, s.cases), _share(s.source_exact, s.cases)),
            ("answers quoting the result", _share(s.answered, s.answers), "")]
    if compare:
        rows.insert(2, ("same call as SRC's", _share(s.agree, s.cases), ""))
    for row in rows:
        t.add_row(*(row if compare else row[:2]))
    notes = [f"model {units.size(r.model_bytes)} resident"]
    if r.recipe:
        notes.append(f"recipe {r.recipe}")
    if r.native_experts and r.max_active_experts != r.native_experts:
        notes.append(f"{r.max_active_experts} of {r.native_experts} experts per token")
    if r.cache_routing:
        notes.append(f"routing changed: cache routing margin {r.cache_routing:g}")
    if s.wrong_tool or s.wrong_arguments:
        notes.append(f"valid, not the reference: another tool ({s.wrong_tool}), other arguments ({s.wrong_arguments})")
    if s.problems:
        notes.append("invalid: " + ", ".join(f"{k} ({n})" for k, n in s.problems.items()))
    notes.append(f"{r.seconds:.1f} s")
    t.caption = "; ".join(notes)
    return t

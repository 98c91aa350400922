"""`tqbench convert`: the streaming conversion with a rich progress display (stderr) and a summary (stdout)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from tqbench import units
from tqbench.cli import options
from tqbench.cli.plan import recipes_from
from tqbench.cli.render import show
from tqbench.convert.calibration_request import DEFAULT_TOKENS, MAX_TOKENS, MIN_TOKENS, CalibrationRequest
from tqbench.engine import submit
from tqbench.errors import TqbenchError
from tqbench.events import (CalibrationProgress, Calibrated, ConvertFinished, ConvertStarted, ShardWritten,
                            SourceProgress, SourceRemoved, UnitConverted)
from tqbench.recipe.fit import parse_size
from tqbench.recipe.recipe import RecipeFlags
from tqbench.state import remember_model


@options.takes(flags=options.RECIPE_FLAGS)
def convert(
    hf_path: Annotated[Path, typer.Option("--hf-path", help="Source checkpoint directory, or a hub repository "
                                          "(owner/name[@revision]): its shards then download as the conversion "
                                          "reads them and go once converted.")],
    mlx_path: Annotated[Path, typer.Option("--mlx-path", help="Output directory (created; resumed if interrupted).")],
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", metavar="NAME",
                                                  help="Recipe name, e.g. tq3a-tqTe-down4-g64.")] = None,
    flags: RecipeFlags = options.FROM_OPTIONS,
    streaming: Annotated[bool, typer.Option(
        "--streaming", help="Lay experts out for streaming (one read per expert). Always on: the only layout "
                            "tqbench writes; accepted for TurboQuant-MLX's command line.")] = True,
    shard_size: options.ShardSize = "5GiB",
    force: Annotated[bool, typer.Option("--force", help="Replace an output of another recipe or source.")] = False,
    keep_source: Annotated[bool, typer.Option(
        "--keep-source", help="From the hub: keep the downloaded source shards (in the Hugging Face cache) instead "
                              "of removing each once converted.")] = False,
    calibrate_text: Annotated[Optional[list[Path]], typer.Option(
        "--calibrate-text", metavar="FILE", help="With cal / --calibrate: UTF-8 text to calibrate on (repeat for "
                                                 "several; default: the demo's held-out code and chat).")] = None,
    calibrate_tokens: Annotated[int, typer.Option(
        "--calibrate-tokens", metavar="N", min=MIN_TOKENS, max=MAX_TOKENS,
        help="With cal / --calibrate: about N tokens of calibration text.")] = DEFAULT_TOKENS,
    calibrate_one_pass: Annotated[bool, typer.Option(
        "--calibrate-one-pass", help="With cal / --calibrate: measure every module's inputs in the source model "
                                     "alone, instead of in order on the calibrated modules' outputs (half the "
                                     "passes, a smaller gain).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print engine events as JSON lines on stdout.")] = False,
) -> None:
    """Convert a checkpoint with a recipe: flat memory, progress with ETA, resumable.

    Rerunning the same command on an interrupted output continues where it stopped. The output holds safetensors
    shards with each routed expert's tensors back to back, an expert map, config.json with a quantization block,
    the tokenizer files and convert-report.json; model.safetensors.index.json is written last and marks it complete.
    """
    from tqbench.convert import convert as run_convert

    err = Console(stderr=True, highlight=False)
    try:
        recipes = recipes_from([recipe] if recipe else None, flags)
        if len(recipes) != 1:
            raise TqbenchError("give either --recipe NAME or recipe flags, not both")
        size = parse_size(shard_size)
        calibration = CalibrationRequest(texts=tuple(str(t) for t in calibrate_text or ()), tokens=calibrate_tokens,
                                         sequential=not calibrate_one_pass)
        if (calibrate_text or calibrate_one_pass) and not recipes[0].calibrate:
            given = "--calibrate-text" if calibrate_text else "--calibrate-one-pass"
            raise TqbenchError(f"{given} given, but recipe {recipes[0].name} is not calibrated (add cal or "
                               "--calibrate)")
        calibration.read()  # a bad file: one line naming it, before the engine starts
        # On the engine thread; leaving the block (Ctrl-C included) closes the conversion there first, so only
        # whole shards stay and the same command resumes.
        with submit(lambda: run_convert(hf_path, mlx_path, recipes[0], size, force, keep_source=keep_source,
                                        calibration=calibration)) as events:
            if as_json:
                for ev in events:
                    print(json.dumps({"event": type(ev).__name__, **asdict(ev)}), flush=True)
                    if isinstance(ev, ConvertFinished):
                        remember_model(mlx_path)
                return
            finished = render_progress(events, err)
    except TqbenchError as e:
        print(f"tqbench: error: {e}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None
    remember_model(mlx_path)  # `tqbench chat` opens it by default
    _summary(finished)


def _started_line(ev: ConvertStarted) -> str:
    resumed = f" (resuming: {ev.resumed_shards} of {ev.shards} shards done)" if ev.resumed_shards else ""
    return (f"converting {ev.source} -> {ev.dest} with {ev.recipe}: {ev.shards} shard{'s' if ev.shards != 1 else ''}, "
            f"{units.gb(ev.bytes_in)} in, {units.gb(ev.bytes_out)} out "
            f"({units.gb(ev.tensor_bytes)} of tensors as tqbench plan counts, + shard headers){resumed}")


def _calibrated_line(ev: Calibrated) -> str:
    kept = f", kept in {ev.file}" if ev.file else ""
    return (f"calibration: {ev.tokens} tokens through {ev.inputs} module inputs for {ev.modules} modules, "
            f"{ev.seconds:.0f} s{kept}")


def _calibrating(ev: CalibrationProgress) -> str:
    return f"calibrate {ev.fraction:.0%}: {ev.done} of {ev.total} {ev.step}, {ev.at}, {ev.elapsed:.0f} s"


def _sized(done: int, total: int) -> str:
    return f"{units.gb(done)}/{units.gb(total)}"


def _where(ev: UnitConverted) -> str:
    where = f"layer {ev.layer}" if ev.layer is not None else ev.name
    if ev.expert is not None:
        where += f" expert {ev.expert}"
    return where + (f" err {ev.rel_error:.3f}" if ev.rel_error is not None else "")


def _fetching(ev: SourceProgress) -> str:
    return f"source on disk {units.gb(ev.on_disk)}; {ev.now}"


def render_progress(events, err: Console) -> ConvertFinished:
    if not err.is_terminal:
        return _render_plain(events, err)
    # One ETA, the engine's (a conversion from the hub counts the downloads in it), on the conversion's bar.
    # The calibration's bar counts module inputs, the conversion's and download's bytes: `size` says which.
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.fields[size]}"), TextColumn("{task.fields[rate]}"),
               TextColumn("{task.fields[eta]}"), TextColumn("{task.fields[what]}"))
    progress = Progress(*columns, console=err, transient=False)
    task = download = calibrate = None
    with progress:
        for ev in events:
            if isinstance(ev, CalibrationProgress):
                if calibrate is None:
                    calibrate = progress.add_task("calibrate", total=1.0, size="", rate="", eta="", what="")
                progress.update(calibrate, completed=ev.fraction, size=f"{ev.done}/{ev.total} {ev.step}",
                                what=ev.at)  # its steps come among the units': the conversion's ETA is the run's
            elif isinstance(ev, Calibrated):
                err.print(_calibrated_line(ev), highlight=False, markup=False)
            elif isinstance(ev, ConvertStarted):
                err.print(_started_line(ev), highlight=False, markup=False)
                task = progress.add_task("convert", total=ev.bytes_in, completed=ev.resumed_bytes_in,
                                         size=_sized(ev.resumed_bytes_in, ev.bytes_in), rate="", eta="", what="")
            elif isinstance(ev, UnitConverted):
                progress.update(task, completed=ev.done_in, size=_sized(ev.done_in, ev.total_in),
                                rate=f"{units.gb(ev.rate)}/s", eta=units.clock(ev.eta), what=_where(ev))
            elif isinstance(ev, SourceProgress):
                if download is None:
                    download = progress.add_task("download", total=ev.to_download, size="", rate="", eta="", what="")
                progress.update(download, completed=ev.downloaded, size=_sized(ev.downloaded, ev.to_download),
                                rate=f"{units.gb(ev.rate)}/s", what=_fetching(ev))
            elif isinstance(ev, SourceRemoved):
                progress.console.print(f"  removed source {ev.file} ({units.gb(ev.bytes)})", markup=False)
            elif isinstance(ev, ShardWritten):
                progress.console.print(f"  wrote {ev.file} ({units.gb(ev.bytes)})", markup=False)
            elif isinstance(ev, ConvertFinished):
                return ev
    raise TqbenchError("conversion ended without finishing")


PLAIN_STEP = 0.10  # piped progress: one line each time another tenth of the source is done


def _render_plain(events, err: Console) -> ConvertFinished:
    """Piped stderr: whole lines, never redrawn or wrapped: the start, each shard, every tenth of the work."""
    def say(line: str) -> None:
        print(line, file=err.file, flush=True)

    next_step = next_calibrate = PLAIN_STEP
    fetching = ""
    for ev in events:
        if isinstance(ev, CalibrationProgress):
            if ev.fraction >= next_calibrate - 1e-9:
                say(_calibrating(ev))
                while next_calibrate <= ev.fraction + 1e-9:
                    next_calibrate += PLAIN_STEP
        elif isinstance(ev, Calibrated):
            say(_calibrated_line(ev))
        elif isinstance(ev, ConvertStarted):
            say(_started_line(ev))
            next_step = (int(ev.resumed_bytes_in / ev.bytes_in / PLAIN_STEP) + 1) * PLAIN_STEP if ev.bytes_in else 1
        elif isinstance(ev, UnitConverted):
            done = ev.done_in / ev.total_in if ev.total_in else 1.0
            if done >= next_step - 1e-9:
                eta = f", {ev.eta:.0f} s left" if ev.eta is not None else ""
                say(f"convert {done:.0%}: {units.gb(ev.done_in)} of {units.gb(ev.total_in)}, "
                    f"{units.gb(ev.rate)}/s{eta}, {_where(ev)}")
                while next_step <= done + 1e-9:
                    next_step += PLAIN_STEP
        elif isinstance(ev, ShardWritten):
            say(f"  wrote {ev.file} ({units.gb(ev.bytes)})")
        elif isinstance(ev, SourceProgress) and ev.file != fetching:  # a line as each download starts
            fetching = ev.file
            if ev.file:
                eta = f", {ev.eta:.0f} s left" if ev.eta is not None else ""
                say(f"  downloading {ev.file}: {units.gb(ev.downloaded)} of {units.gb(ev.to_download)} so far, "
                    f"{units.gb(ev.rate)}/s{eta}; source on disk {units.gb(ev.on_disk)}")
        elif isinstance(ev, SourceRemoved):
            say(f"  removed source {ev.file} ({units.gb(ev.bytes)})")
        elif isinstance(ev, ConvertFinished):
            return ev
    raise TqbenchError("conversion ended without finishing")


def _summary(ev: ConvertFinished) -> None:
    t = Table(title="converted", title_justify="left")
    t.add_column("output")
    t.add_column("shards", justify="right")
    t.add_column("size", justify="right")
    t.add_column("read", justify="right")
    t.add_column("time", justify="right")
    t.add_column("rel. error mean / max", justify="right")
    err = (f"{ev.mean_rel_error:.4f} / {ev.max_rel_error:.4f}" if ev.mean_rel_error is not None else "-")
    cells = (ev.dest, str(ev.shards), units.size(ev.bytes_out), units.gb(ev.bytes_in), f"{ev.seconds:.1f} s", err)
    t.add_row(*cells)
    show(Console(highlight=False), t)

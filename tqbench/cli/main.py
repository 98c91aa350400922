"""`tqbench`: the command line. With no command it opens the full-screen UI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional, TextIO

import typer
from rich.console import Console

from tqbench import __version__
from tqbench.cli import render
from tqbench.cli.options import App
from tqbench.errors import ExitCode, TqbenchError

app = App(
    name="tqbench",
    help="A workbench for running giant Mixture-of-Experts models on one machine with MLX.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: Typer's rich help labels every flag `<bool>` (even --help), and its boxes wrap when piped.
    rich_markup_mode=None,
)
out = Console(highlight=False, soft_wrap=False)


class By(str, Enum):
    role = "role"
    layer = "layer"
    shard = "shard"


def _version(value: bool) -> None:
    if value:
        print(f"tqbench {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    ctx: typer.Context,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Inspect, plan, convert and chat with giant MoE checkpoints. Without a command: the full-screen UI."""
    if ctx.invoked_subcommand is None:
        _open_ui(None)


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="Checkpoint directory (safetensors shards + config.json).")],
    by: Annotated[By, typer.Option("--by", help="Group the totals by role, layer or shard.")] = By.role,
    tensors: Annotated[Optional[str], typer.Option("--tensors", metavar="GLOB",
                                                   help="List tensors whose name matches GLOB, e.g. '*layers.3.*'.")] = None,
    limit: Annotated[int, typer.Option(min=0, help="Rows of the tensor table (JSON lists all).")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (stable schema) on stdout.")] = False,
) -> None:
    """Read a checkpoint's headers (no tensor data) and report tensors, roles, layers, experts and format.

    Exits 3 when the index names shards that are not on disk (a partial download); the report covers the rest.
    """
    from tqbench.source import open_checkpoint, select_tensors, summarize
    from tqbench.source.summary import tensor_row

    ckpt = open_checkpoint(path)
    summary = summarize(ckpt)
    selected = select_tensors(ckpt, tensors) if tensors else []
    if as_json:
        doc = summary.to_dict()
        doc["missing"] = [{"file": m.file, "tensors": list(m.tensors)} for m in ckpt.missing]
        if tensors:
            doc["tensors_matching"] = tensors
            doc["tensor_list"] = [tensor_row(t) for t in selected]
        print(json.dumps(doc, indent=2))
    else:
        render.show(out, render.summary_header(summary, ckpt))
        if by is By.role:
            render.show(out, render.group_table("by role", summary.by_role, "role"))
        elif by is By.layer:
            render.show(out, render.layer_table(summary))
        else:
            render.show(out, render.group_table("by shard", summary.by_shard, "shard"))
        if ckpt.missing:
            render.show(out, render.missing_table(ckpt))
        if tensors:
            render.show(out, render.tensor_table(selected, limit))
    if ckpt.missing:
        print(
            f"tqbench: {path}: incomplete checkpoint: {len(ckpt.missing)} shard(s) named by the index are missing "
            f"({', '.join(m.file for m in ckpt.missing[:3])}{', ...' if len(ckpt.missing) > 3 else ''})",
            file=sys.stderr)
        raise typer.Exit(ExitCode.INCOMPLETE)


@app.command()
def demo(
    force: Annotated[bool, typer.Option("--force", help="Write the demo checkpoint again.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print {\"path\": ...} as JSON.")] = False,
) -> None:
    """Print where the built-in demo model lives (a small Kimi-K3-architecture checkpoint), creating it if needed."""
    from tqbench.demo import ensure_demo
    from tqbench.demo.install import demo_path
    from tqbench.writable import check_output_dir

    if force or not demo_path().is_dir():  # it is written into the cache directory
        check_output_dir(demo_path())
    path = ensure_demo(force=force)
    print(json.dumps({"path": str(path)}) if as_json else path)


@app.command()
def ui(
    path: Annotated[Optional[Path], typer.Argument(metavar="PATH", help="Checkpoint to open (default: the last one, or the demo).")] = None,
) -> None:
    """Open the full-screen UI."""
    _open_ui(path)


from tqbench.cli.chat import chat  # noqa: E402
from tqbench.cli.serve import serve  # noqa: E402
from tqbench.cli.convert import convert  # noqa: E402
from tqbench.cli.eval import eval_model  # noqa: E402
from tqbench.cli.plan import plan  # noqa: E402
from tqbench.cli.profile import profile_app  # noqa: E402

app.command()(plan)
app.command()(convert)
app.command()(chat)
app.command(name="eval")(eval_model)
app.command()(serve)
app.add_typer(profile_app, name="profile")


def _open_ui(path: Path | None) -> None:
    """The full-screen UI, on a terminal only: without one (piped, redirected, no stdin) Textual would spin forever."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("tqbench: error: the full-screen UI needs a terminal on stdin and stdout; "
              "without one, run a command (tqbench --help)", file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE)
    from tui.app import TqbenchApp

    TqbenchApp(path).run()


def _stopped_by_launcher(signum, frame) -> None:
    """One line, then out at once: the engine thread may be inside a collective that waits for the rank that ended,
    and would keep the process alive."""
    from tqbench.distributed.world import env_rank

    print(f"tqbench: error: rank {env_rank()}: stopped by the launcher (another rank ended; its line, if any, is "
          "above)", file=sys.stderr, flush=True)
    os._exit(ExitCode.BAD_INPUT)


def run() -> None:
    """Console-script entry point: one-line errors and documented exit codes. Under a launcher of several ranks
    (mlx.launch) only rank 0 is a face: the others run headless, printing nothing (rank 0 names a rank that failed)."""
    from tqbench.distributed.world import env_rank

    rank = env_rank()
    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    if rank is not None:  # the launcher stops every rank with SIGTERM once one has ended
        signal.signal(signal.SIGTERM, _stopped_by_launcher)
    if rank:  # a terminal's Ctrl-C reaches every rank: rank 0 alone decides what it stops, and tells the others
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with _readers_may_leave():
        try:
            # Without standalone mode click returns the code of a typer.Exit instead of exiting.
            code = app(standalone_mode=False)
            code = code if isinstance(code, int) else ExitCode.OK
            if code == ExitCode.INTERRUPTED:  # Typer turns Ctrl-C inside a command into Exit(130)
                print("tqbench: interrupted", file=sys.stderr)
            sys.exit(code)
        except TqbenchError as e:
            print(f"tqbench: error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print("tqbench: interrupted", file=sys.stderr)
            sys.exit(ExitCode.INTERRUPTED)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except typer.Abort:  # click's name for Ctrl-C inside a command
            print("tqbench: interrupted", file=sys.stderr)
            sys.exit(ExitCode.INTERRUPTED)
        except typer.TyperException as e:  # usage errors: bad option values, missing arguments
            e.show()
            sys.exit(getattr(e, "exit_code", ExitCode.USAGE))


@contextlib.contextmanager
def _readers_may_leave() -> Iterator[None]:
    """Run with stdout and stderr that go quiet when their reader goes away (`tqbench inspect ... | head -1`), as Unix
    tools do: the command carries on and exits with its own code, and what it still writes to the other stream (a
    reply's summary on stderr after the reply on stdout) gets there."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _QuietWhenClosed(sys.stdout), _QuietWhenClosed(sys.stderr)
    try:
        yield
    finally:
        sys.stdout.flush()  # what is still buffered, while a closed pipe is quiet
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


class _QuietWhenClosed:
    """A text stream that, once a write finds no reader (EPIPE), points its file descriptor at /dev/null (the Python
    docs' "Note on SIGPIPE") and writes there without an error from then on."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

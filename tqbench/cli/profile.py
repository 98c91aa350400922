"""`tqbench profile`: look at, share and reset the hot-expert profiles chat sessions learn (tqbench.profile).

Registered in main.py with `app.add_typer(profile_app, name="profile")`. Everything computed here comes from the
engine (tqbench.profile: overview, merge, diff; counts and the coverage table as text from tqbench.profile.report, as
the TUI shows them); this module only renders it: rich tables on a terminal, plain lines when piped, `--json` on
stdout, one-line errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tqbench.cli.options import App
from tqbench.cli.render import show
from tqbench.errors import TqbenchError
from tqbench.writable import check_output_file

if TYPE_CHECKING:
    from tqbench.profile import Overview, ProfileDiff

profile_app = App(
    name="profile",
    help="Hot-expert profiles: what chat sessions learned about which experts a model needs (show, export, import, "
         "merge, diff, reset).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
_out = Console(highlight=False, soft_wrap=False)

ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", "-m", metavar="DIR",
    help="Model directory (default: the last converted model, else the demo's tq4 conversion).")]


@contextlib.contextmanager
def _one_line_errors(output: Path | None = None) -> Iterator[None]:
    """TqbenchError and OSError as one line. An OSError comes from writing `output`, which it names as the user gave it
    (the error's own file name is the temporary file beside it, tqbench.atomic, or none at all)."""
    try:
        yield
    except TqbenchError as e:
        print(f"tqbench: error: {e}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None
    except OSError as e:
        print(f"tqbench: error: {output if output is not None else e.filename}: {e.strerror or e}", file=sys.stderr)
        raise typer.Exit(1) from None


def _model(model: Path | None) -> Path:
    """The given model, else the last converted one, else the demo's tq4 conversion if it exists."""
    from tqbench.chat.choose import default_model

    if model is not None:
        if not model.is_dir():
            raise TqbenchError("no such model directory", model)
        return model
    found = default_model()
    if found is not None:
        return found
    raise TqbenchError("no model given and none converted yet: give --model DIR (or run `tqbench chat` once, which "
                       "converts the demo)")


@profile_app.command("show")
def show_cmd(
    model: ModelOpt = None,
    file: Annotated[Optional[Path], typer.Option(
        "--file", metavar="FILE", help="Show this profile file (checked against the model) instead.")] = None,
    force: Annotated[bool, typer.Option("--force", help="With --file: one made for another model of the same "
                                                        "layers and experts.")] = False,
    top: Annotated[int, typer.Option("--top", min=0, help="Hottest experts listed per layer.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print the overview as JSON on stdout.")] = False,
) -> None:
    """Show a model's profile: its source, hottest experts and coverage per layer.

    Where the profile comes from, its routings and sessions, the hottest experts of each layer and how many experts
    cover 50/80/90% of each layer's routings; and which profile a chat starts from."""
    from tqbench.profile import overview

    with _one_line_errors():
        ov = overview(_model(model), None, file, force, top)
    if as_json:
        print(json.dumps(ov.to_dict(), indent=2))
        return
    show(_out, *overview_renderables(ov))


def overview_renderables(ov: Overview) -> list:
    from tqbench.profile.report import count, number, shape

    s = ov.summary
    head = [Text.assemble(("model    ", "bold"), f"{ov.model} ({shape(s.geometry)}; fingerprint {s.fingerprint})")]
    if ov.source == "none":
        head.append(Text.assemble(("profile  ", "bold"), "none yet: chat sessions learn one (unless --no-learn)"))
    else:
        where = {"learned": f"learned ({ov.where})", "shipped": f"shipped ({ov.where})",
                 "file": f"file {ov.where}"}[ov.source]
        sessions = f", {count(s.sessions)} session{'s' if s.sessions != 1 else ''}" if ov.source == "learned" else ""
        head.append(Text.assemble(("profile  ", "bold"), f"{where}: {number(s.routings)} routings (decode "
                                                         f"{number(s.decode)}, prefill {number(s.prefill)}){sessions}"))
    head.append(Text.assemble(("chat     ", "bold"), _chat_line(ov)))
    if ov.source == "none":
        return head
    return head + [coverage_table(ov)]


def _chat_line(ov: Overview) -> str:
    from tqbench.profile.report import CHAT_STARTS, number

    chat = ov.chat
    first = CHAT_STARTS[chat.source] + (f" ({chat.where})" if chat.source == "shipped" else "")
    if chat.source != "learned" and ov.source == "learned":
        first += (f"; the learned profile takes over at {ov.mature_at:,} routings ({number(ov.summary.routings)} so "
                  "far)")
    return first


def coverage_table(ov: Overview) -> Table:
    from tqbench.profile.report import coverage_report

    report = coverage_report(ov.summary)
    t = Table(title=f"per layer: experts needed to cover {'/'.join(report.shares)}% of the routings (decode + "
                    f"prefill), and the hottest experts with their share", title_justify="left")
    for c in report.columns:
        t.add_column(c, justify="right")
    t.add_column("hottest experts (share)", overflow="fold")
    for r in report.rows:
        t.add_row(*r.cells(), r.hottest, end_section=r.section_end)
    return t


@profile_app.command("export")
def export_cmd(
    model: ModelOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE",
                                                   help="Write here (default: stdout).")] = None,
) -> None:
    """Write the learned profile as a file to share.

    JSON, schema tqbench.profile/1: the model's fingerprint and geometry, routings, per-layer decode and prefill
    counts and a ranked pin list. `import` and `chat --profile` read it."""
    from tqbench.profile import export_learned
    from tqbench.profile.report import count, number

    with _one_line_errors(output):
        if output is not None:
            check_output_file(output)
        path = _model(model)
        p = export_learned(path, None, output)
        if output is None:
            sys.stdout.write(p.to_text())
            return
    print(f"wrote {os.path.abspath(output)}: the learned profile of {path} ({number(p.routings)} routings, "
          f"{count(p.sessions)} session{'s' if p.sessions != 1 else ''}, {count(len(p.ranked()))} ranked pins)",
          file=sys.stderr)


@profile_app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A profile: tqbench's export, or TurboQuant-MLX's pin "
                                                              "list / usage profile.")],
    model: ModelOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Accept a profile made for another model of the same layers "
                                                        "and experts.")] = False,
) -> None:
    """Replace the model's learned profile with a file.

    FILE is validated against the model first: another schema, another geometry, or another model's fingerprint is
    refused with one line (--force accepts the last when the layers and experts match)."""
    from tqbench.profile import MATURE, import_file
    from tqbench.profile.report import number

    with _one_line_errors():
        path = _model(model)
        p, old = import_file(path, file, None, force)
    fp = p.fingerprint  # the model's (read_file keys a profile to the model it is imported into)
    made_for = _fingerprint_in(file)
    forced = f" (made for fingerprint {made_for}; --force)" if made_for not in (None, fp) else ""
    when = ("chat starts from it" if p.routings >= MATURE else
            f"chat starts from it once it has {MATURE:,} routings (until then `chat --profile {file}` does)")
    print(f"imported {file} as the learned profile of {path} (fingerprint {fp}){forced}: {number(p.routings)} "
          f"routings, replacing {number(old.routings)}; {when}", file=sys.stderr)


def _fingerprint_in(file: Path) -> str | None:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("fingerprint") if isinstance(doc, dict) else None


@profile_app.command("merge")
def merge_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="A profile file (tqbench's schema).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Another, of the same layers and experts.")],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="C", help="The merged profile.")],
    weight_a: Annotated[float, typer.Option("--weight-a", metavar="W", min=0.0, help="A's weight.")] = 1.0,
    weight_b: Annotated[float, typer.Option("--weight-b", metavar="W", min=0.0, help="B's weight.")] = 1.0,
    force: Annotated[bool, typer.Option("--force", help="Merge profiles of two models of the same geometry (keyed to "
                                                        "A's).")] = False,
) -> None:
    """Merge two profiles: C = W_A x A + W_B x B.

    Counts and routings are weighted and summed, pins ranked again; both must have the same layers and experts."""
    from tqbench.atomic import write_bytes
    from tqbench.profile import merge, read_profile
    from tqbench.profile.report import number

    with _one_line_errors(output):
        check_output_file(output)
        pa, pb = read_profile(a), read_profile(b)
        c = merge(pa, pb, weight_a, weight_b=weight_b, force=force, names=(str(a), str(b)))
        write_bytes(output, c.to_text().encode())
    print(f"wrote {os.path.abspath(output)}: {weight_a:g} x {a} ({number(pa.routings)} routings) + {weight_b:g} x "
          f"{b} ({number(pb.routings)}) = {number(c.routings)} routings", file=sys.stderr)


@profile_app.command("diff")
def diff_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="A profile file (tqbench's schema).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Another, of the same layers and experts.")],
    share: Annotated[float, typer.Option("--share", min=0.01, max=1.0,
                                         help="A layer's hot set: the fewest experts covering this share.")] = 0.8,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON on stdout.")] = False,
) -> None:
    """Compare two profiles' hot sets, per layer and overall.

    A layer's hot set is the fewest experts covering --share of its routings; per layer: common experts, the
    Jaccard index, and how much of each profile's routings the other's hot set serves."""
    from tqbench.profile import diff, read_profile

    with _one_line_errors():
        pa, pb = read_profile(a), read_profile(b)
        comparison = diff(pa, pb, share, (str(a), str(b)))
    if as_json:
        print(json.dumps(comparison.to_dict(), indent=2))
        return
    show(_out, *diff_renderables(comparison))


def diff_renderables(comparison: ProfileDiff) -> list:
    from tqbench.profile.report import count, number

    sides = (("A", comparison.a), ("B", comparison.b))
    head = [Text.assemble((f"{k}  ", "bold"), f"{side.name} ({number(side.routings)} routings, fingerprint "
                                               f"{side.fingerprint})") for k, side in sides]
    if not comparison.same_model:
        head.append(Text("the profiles were made for different models (of the same geometry)", style="yellow"))
    t = Table(title=f"per layer: hot sets (experts covering {comparison.share:.0%} of the routings)",
              title_justify="left")
    for c in ("layer", "hot A", "hot B", "common", "Jaccard", "A serves B", "B serves A"):
        t.add_column(c, justify="right")

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    def cells(x, name: str) -> list[str]:
        return [name, count(x.hot_a), count(x.hot_b), count(x.common), f(x.jaccard, ".2f"), f(x.a_covers_b, ".1%"),
                f(x.b_covers_a, ".1%")]

    for x in comparison.layers:
        t.add_row(*cells(x, str(x.layer)), end_section=x is comparison.layers[-1])
    o = comparison.overall
    t.add_row(*cells(o, "all"))
    t.caption = (f"Jaccard: common / either, per layer and over all (layer, expert) pairs (mean of the layers' "
                 f"{f(o.mean_jaccard, '.2f')}); A serves B: the share of B's routings on A's hot experts")
    return head + [t]


@profile_app.command("reset")
def reset_cmd(model: ModelOpt = None) -> None:
    """Forget a model's learned profile.

    Shipped profiles and exported files are untouched."""
    from tqbench.profile import forget_learned
    from tqbench.profile.report import number

    with _one_line_errors():
        path = _model(model)
        f = forget_learned(path)
    if f.gone:
        print(f"forgot the learned profile of {path} (fingerprint {f.fingerprint}, {number(f.routings)} routings)",
              file=sys.stderr)
    else:
        print(f"no learned profile for {path} (fingerprint {f.fingerprint}): nothing to forget", file=sys.stderr)

"""Command-line options shared by several commands (the recipe flags: a second spelling of a recipe name), and the
Typer app every command is registered on, whose usage lines read as Unix ones."""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Optional

import click
import typer
from typer.core import TyperCommand


class UnixUsage(TyperCommand):
    """A command whose usage line names a required argument bare (`plan [OPTIONS] SRC`), as Unix tools do, where
    Typer writes `{SRC}`."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class App(typer.Typer):
    """A Typer app whose commands are UnixUsage ones."""

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = UnixUsage,
                **kwargs: Any) -> Callable:
        return super().command(name, cls=cls, **kwargs)


def positive(value: float | None) -> float | None:
    """A float option that must be above 0 (Typer's `min` admits it)."""
    if value is not None and value <= 0:
        raise typer.BadParameter("Input should be greater than 0")
    return value


Bits = Annotated[Optional[int], typer.Option(min=1, help="Base bits for non-expert Linears (TurboQuant 2-4).")]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", "-g", min=1, help="Group size: 32, 64 or 128.")]
AttnBits = Annotated[Optional[int], typer.Option(min=1, help="Attention bits (default: --bits).")]
MlpBits = Annotated[Optional[int], typer.Option(min=1, help="Routed-expert bits (default: --bits).")]
TernaryExperts = Annotated[bool, typer.Option("--ternary-experts", help="Ternary routed experts.")]
ExpertDownBits = Annotated[Optional[int], typer.Option(min=1, help="Routed experts' down_proj bits.")]
MlpGroupSize = Annotated[Optional[int], typer.Option(min=1, help="Routed experts' group size.")]
NoRotation = Annotated[bool, typer.Option("--no-rotation", help="No Hadamard rotation.")]
Seed = Annotated[Optional[int], typer.Option(min=0, max=2**31 - 1, help="Rotation seed (default 42).")]
BaseFormat = Annotated[Optional[str], typer.Option("--format", metavar="FORMAT",
                                                   help="Base tier format: turboquant, affine or source.")]
ExpertFormat = Annotated[Optional[str], typer.Option(
    metavar="FORMAT", help="Routed-expert format: turboquant, affine, mxfp4 or source.")]
ShardSize = Annotated[str, typer.Option(metavar="SIZE", help="Output shard size.")]

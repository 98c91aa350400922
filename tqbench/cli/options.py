"""Command-line options shared by several commands: the recipe flags (a second spelling of a recipe name)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Bits = Annotated[Optional[int], typer.Option(help="Base bits for non-expert Linears (TurboQuant 2-4).")]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", "-g", help="Group size: 32, 64 or 128.")]
AttnBits = Annotated[Optional[int], typer.Option(help="Attention bits (default: --bits).")]
MlpBits = Annotated[Optional[int], typer.Option(help="Routed-expert bits (default: --bits).")]
TernaryExperts = Annotated[bool, typer.Option("--ternary-experts", help="Ternary routed experts.")]
ExpertDownBits = Annotated[Optional[int], typer.Option(help="Routed experts' down_proj bits.")]
MlpGroupSize = Annotated[Optional[int], typer.Option(help="Routed experts' group size.")]
NoRotation = Annotated[bool, typer.Option("--no-rotation", help="No Hadamard rotation.")]
Seed = Annotated[Optional[int], typer.Option(help="Rotation seed (default 42).")]
BaseFormat = Annotated[Optional[str], typer.Option("--format", metavar="FORMAT",
                                                   help="Base tier format: turboquant, affine or source.")]
ExpertFormat = Annotated[Optional[str], typer.Option(
    metavar="FORMAT", help="Routed-expert format: turboquant, affine, mxfp4 or source.")]
ShardSize = Annotated[str, typer.Option(metavar="SIZE", help="Output shard size.")]

"""Rich renderings of engine results for the terminal."""

from __future__ import annotations

from rich.console import Group as RichGroup
from rich.table import Table
from rich.text import Text

from tqbench import units
from tqbench.source.checkpoint import Checkpoint, Tensor
from tqbench.source.summary import Summary


def summary_header(s: Summary, ckpt: Checkpoint) -> RichGroup:
    lines = [
        Text.assemble(("model   ", "bold"), s.model_type, ("   format  ", "bold"), s.format),
        Text.assemble(("tensors ", "bold"), f"{s.tensors:,} in {len(ckpt.shards)} shard{'s' if len(ckpt.shards) != 1 else ''}",
                      ("   size  ", "bold"), units.size(s.bytes)),
        Text.assemble(("params  ", "bold"), units.count(s.params), ("   active/token  ", "bold"),
                      units.count(s.active_params)),
    ]
    if e := s.experts:
        proj = ", ".join(f"{p} {units.gb(b)}" for p, b in e.bytes_by_projection.items())
        lines.append(Text.assemble(
            ("experts ", "bold"),
            f"{e.experts_per_layer} per layer x {e.moe_layers} MoE layers = {e.expert_layers:,}, top-{e.top_k}; "
            f"one expert {units.count(e.params_per_expert)} params, page {units.gb(e.bytes_per_expert)} ({proj})"))
    if ckpt.missing:
        have = units.size(s.bytes)
        total = f" of {units.size(s.index_total_size)}" if s.index_total_size else ""
        lines.append(Text(f"INCOMPLETE: {len(ckpt.missing)} shard(s) missing; {have}{total} present", "bold red"))
    return RichGroup(*lines)


def group_table(title: str, groups, first: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column(first)
    for c in ("tensors", "params", "size", "GiB", "formats"):
        t.add_column(c, justify="right" if c != "formats" else "left")
    for g in groups:
        t.add_row(str(g.key), f"{g.tensors:,}", units.count(g.params), units.gb(g.bytes), units.gib(g.bytes),
                  ", ".join(g.formats))
    return t


def layer_table(s: Summary) -> Table:
    t = Table(title="by layer", title_justify="left")
    for c in ("layer", "attention", "mlp", "tensors", "params", "size", "experts", "expert size"):
        t.add_column(c, justify="left" if c in ("attention", "mlp") else "right")
    for row in s.by_layer:
        t.add_row(str(row.layer), row.attention or "-", row.mlp or "-", f"{row.tensors:,}", units.count(row.params),
                  units.gb(row.bytes), str(row.experts or "-"), units.gb(row.expert_bytes) if row.experts else "-")
    return t


def missing_table(ckpt: Checkpoint) -> Table:
    t = Table(title="missing shards", title_justify="left", title_style="bold red")
    t.add_column("shard", style="red")
    t.add_column("tensors", justify="right")
    t.add_column("first tensor")
    for m in ckpt.missing:
        t.add_row(m.file, f"{len(m.tensors):,}", m.tensors[0] if m.tensors else "-")
    return t


def tensor_table(tensors: list[Tensor], limit: int) -> Table:
    t = Table(title=f"tensors ({len(tensors):,} match)", title_justify="left")
    for c in ("name", "role", "layer", "expert", "dtype", "shape", "size", "format", "shard"):
        t.add_column(c, justify="right" if c in ("layer", "expert", "size") else "left")
    for x in tensors[:limit]:
        n = x.name
        role = n.role.value + (f" ({n.attention})" if n.attention else "")
        t.add_row(x.entry.name, role, "-" if n.layer is None else str(n.layer), "-" if n.expert is None else str(n.expert),
                  x.entry.dtype, "x".join(map(str, x.entry.shape)), units.gb(x.nbytes), x.format, x.entry.shard)
    if len(tensors) > limit:
        t.caption = f"{len(tensors) - limit:,} more (raise --limit, or use --json)"
    return t

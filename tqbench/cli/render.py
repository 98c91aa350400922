"""Renderings of engine results: rich on a terminal, plain lines that never wrap when piped.

`show(console, ...)` prints rich renderables as rich does on a terminal. When the console is not a terminal (a file,
a pipe, a test's capture) it prints each renderable as plain lines instead: text as it is, tables as columns aligned
with two spaces and no borders, multi-line cells joined with " / ", however long the lines get. A long tensor name or
path is never broken across lines, and `grep`, `cut` and scripts see one row per line.
"""

from __future__ import annotations

from rich.console import Console, Group as RichGroup
from rich.table import Table
from rich.text import Text

from tqbench import units
from tqbench.source.checkpoint import Checkpoint, HubOrigin, Tensor
from tqbench.source.summary import Summary


def hub_line(o: HubOrigin) -> Text:
    """Where a hub checkpoint comes from and what reading its headers fetched."""
    read = f"fetched {units.size(o.fetched_bytes)}"
    if o.headers_cached or o.shards_local:
        read += f" ({o.headers_cached} headers from tqbench's cache, {o.shards_local} shards on disk)"
    return Text.assemble(("hub     ", "bold"), o.label, ("   read  ", "bold"), read)


def summary_header(s: Summary, ckpt: Checkpoint) -> RichGroup:
    lines = [hub_line(ckpt.origin)] if ckpt.origin else []
    lines += [
        Text.assemble(("model   ", "bold"), s.model_type, ("   format  ", "bold"), s.format),
        Text.assemble(("tensors ", "bold"), f"{s.tensors:,} in {len(ckpt.shards)} shard" + "s" * (len(ckpt.shards) != 1),
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
    for c in ("tensors", "params", "size", "binary", "formats"):
        t.add_column(c, justify="right" if c != "formats" else "left")
    for g in groups:
        cells = (str(g.key), f"{g.tensors:,}", units.count(g.params), units.gb(g.bytes), units.gib(g.bytes),
                 ", ".join(g.formats))
        t.add_row(*cells)
    return t


def layer_table(s: Summary) -> Table:
    t = Table(title="by layer", title_justify="left")
    for c in ("layer", "attention", "mlp", "tensors", "params", "size", "experts", "expert size"):
        t.add_column(c, justify="left" if c in ("attention", "mlp") else "right")
    for row in s.by_layer:
        cells = (str(row.layer), row.attention or "-", row.mlp or "-", f"{row.tensors:,}", units.count(row.params),
                 units.gb(row.bytes), str(row.experts or "-"), units.gb(row.expert_bytes) if row.experts else "-")
        t.add_row(*cells)
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
        layer, expert = ("-" if v is None else str(v) for v in (n.layer, n.expert))
        shape = "x".join(map(str, x.entry.shape))
        cells = (x.entry.name, role, layer, expert, x.entry.dtype, shape, units.gb(x.nbytes), x.format, x.entry.shard)
        t.add_row(*cells)
    if len(tensors) > limit:
        t.caption = f"{len(tensors) - limit:,} more (raise --limit, or use --json)"
    return t


# --- plain output -----------------------------------------------------------------------------------------------------

def show(console: Console, *items) -> None:
    """Print renderables: rich on a terminal; otherwise plain lines that never wrap (see the module docstring)."""
    for item in items:
        if console.is_terminal:
            console.print(item)
        else:
            for line in plain_lines(item):
                print(line, file=console.file)


def plain_lines(item) -> list[str]:
    """A str, Text, Group or Table as plain lines."""
    if isinstance(item, Table):
        return table_lines(item)
    if isinstance(item, RichGroup):
        return [line for r in item.renderables for line in plain_lines(r)]
    return _plain(item).split("\n")


def _plain(x) -> str:
    if isinstance(x, Text):
        return x.plain
    return str(x)


def _one_line(x) -> str:
    return " / ".join(line for line in _plain(x).split("\n"))


def table_lines(t: Table) -> list[str]:
    """The title, a header row, one line per row and the caption; columns aligned with two spaces, never wrapped."""
    columns = [[_one_line(c.header)] + [_one_line(x) for x in c.cells] for c in t.columns]
    widths = [max(map(len, col)) for col in columns]
    lines = [_one_line(t.title)] if t.title else []
    for i in range(len(columns[0]) if columns else 0):
        parts = [col[i].rjust(w) if c.justify == "right" else col[i].ljust(w)
                 for col, w, c in zip(columns, widths, t.columns)]
        lines.append("  ".join(parts).rstrip())
    if t.caption:
        lines.append(_one_line(t.caption))
    return lines

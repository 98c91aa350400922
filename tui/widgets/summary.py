"""The header panel of the Source screen: what the checkpoint is, how big, its experts, and whether it is complete."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from tqbench import units

KEY = 9  # width of the key column
VALUE = 27  # width of the first value column on two-pair lines


def _pair(key: str, value: str, key2: str = "", value2: str = "") -> Content:
    line = Content.assemble((f"{key:<{KEY}}", "bold"), value)
    if key2:
        line = line.pad_right(max(1, KEY + VALUE - line.cell_length))
        line = line + Content.assemble((f"{key2:<7}", "bold"), value2)
    return line


def summary_content(summary, ckpt) -> Content:
    """The panel's lines for a tqbench Summary and its Checkpoint (numbers formatted by tqbench.units)."""
    cfg = ckpt.config
    facts = [f"{cfg.num_layers} layers" if cfg.num_layers else "",
             f"hidden {cfg.hidden_size:,}" if cfg.hidden_size else "",
             f"vocab {cfg.vocab_size:,}" if cfg.vocab_size else ""]
    lines = [
        Content.assemble((summary.model_type, "bold $text-accent"), "  ",
                         (", ".join(f for f in facts if f), "$text-muted")),
        _pair("format", summary.format),
        _pair("tensors", f"{summary.tensors:,} in {len(ckpt.shards)} shard{'' if len(ckpt.shards) == 1 else 's'}", "size", units.size(summary.bytes)),
        _pair("params", units.count(summary.params), "active", f"{units.count(summary.active_params)} per token"),
    ]
    if o := summary.hub:
        lines.append(_pair("hub", o.label, "read", f"{units.size(o.fetched_bytes)} fetched"))
    if e := summary.experts:
        lines.append(_pair("experts", f"{e.experts_per_layer:,} per layer x {e.moe_layers} MoE layers = "
                                      f"{e.expert_layers:,}, top-{e.top_k}"))
        proj = ", ".join(f"{p} {units.gb(b)}" for p, b in e.bytes_by_projection.items())
        lines.append(_pair("1 expert", f"{units.count(e.params_per_expert)} params, {units.gb(e.bytes_per_expert)}"
                                       f" ({proj})"))
    if ckpt.missing:
        total = f" of {units.gb(summary.index_total_size)}" if summary.index_total_size else ""
        n_shards = len(ckpt.shards) + len(ckpt.missing)
        lines.append(Content.styled(
            f"INCOMPLETE: {len(ckpt.missing)} of {n_shards} shards missing; {units.gb(summary.bytes)}{total} present",
            "bold $text-error"))
    return Content("\n").join(lines)


class SummaryPanel(Static):
    """Model type, format, tensor count, size (GB and GiB), params, active params, experts, missing shards."""

    def show(self, summary, ckpt) -> None:
        self.set_class(bool(ckpt.missing), "incomplete")
        self.update(summary_content(summary, ckpt))

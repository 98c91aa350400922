"""The Convert screen's progress display: a bar over the source bytes, a line with the engine's rate and ETA, the shards
written and the unit being converted, and the per-layer table (units done, bytes, errors). A calibrated recipe's run
shows its calibration pass, which runs as the units need it, on a line of its own (module inputs calibrated, the
engine's ETA). Before a run the table lists the layout's layers; after a finished run the line becomes the run's
summary."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Label, ProgressBar, Static

from tqbench import units
from tqbench.events import (CalibrationProgress, Calibrated, ConvertFinished, ConvertStarted, SourceProgress,
                            SourceRemoved, UnitConverted)
from tui.state import display_path
from tui.tally import LayerStats
from tui.widgets.convert_form import KEY, plural
from tui.widgets.layer_table import LayerTable, error_text


def where(unit: UnitConverted) -> str:
    """The unit being converted: `layer 3 expert 17`, `layer 3`, or the tensor name outside the layers."""
    if unit.layer is None:
        return unit.name.rsplit(".", 2)[-2] if unit.name.count(".") >= 2 else unit.name
    return f"layer {unit.layer}" + (f" expert {unit.expert}" if unit.expert is not None else "")


def module_at(path: str) -> str:
    """A module path as the layer table names layers: `layers.3.mlp.switch_mlp.gate_proj`, `lm_head`."""
    for prefix in ("language_model.", "model."):
        path = path.removeprefix(prefix)
    return path


def calibration_text(ev: Calibrated) -> str:
    inputs, modules = plural(ev.inputs, "input"), plural(ev.modules, "module")
    return f"{ev.tokens:,} tokens, {inputs} for {modules} in {ev.seconds:.0f} s"


class RunProgress(Vertical):
    """The bar and the rate line are shown during a run (the line alone, as the summary, after it)."""

    @property
    def table(self) -> LayerTable:
        return self.query_one(LayerTable)

    def compose(self) -> ComposeResult:
        with Horizontal(id="convert-bar-row"):
            yield ProgressBar(total=None, show_eta=False, id="convert-bar")
            yield Label("", id="convert-bytes")
        yield Static("", id="convert-rate")
        yield Static("", id="convert-calibration")
        yield Static("", id="convert-download")
        yield LayerTable(id="layers")

    def _show_lines(self, shown: bool) -> None:
        self.query_one("#convert-bar-row").display = shown
        self.query_one("#convert-rate").display = shown
        if not shown:
            self.query_one("#convert-download").display = False
            self.query_one("#convert-calibration").display = False

    def show_source(self, ev: SourceProgress | SourceRemoved) -> None:
        """A run streaming its source from the hub: what is downloading, how fast, what the source holds on disk."""
        line = self.query_one("#convert-download", Static)
        line.display = True
        if isinstance(ev, SourceRemoved):
            line.update(Content.assemble(("source  ", "bold"), f"removed {ev.file} ({units.gb(ev.bytes)}); ",
                                         f"{units.gb(ev.on_disk)} on disk"))
            return
        line.update(Content.assemble(
            ("source  ", "bold"), f"{units.gb(ev.downloaded)} of {units.gb(ev.to_download)} downloaded, ",
            (f"{units.gb(ev.rate)}/s", "bold"), f"; {units.gb(ev.on_disk)} on disk  ", (ev.now, "$text-muted")))

    def _show_bytes(self, done: int, total: int) -> None:
        self.query_one("#convert-bar", ProgressBar).update(total=total, progress=done)
        self.query_one("#convert-bytes", Label).update(f"{units.gb(done)} of {units.gb(total)}")

    def show_layout(self, layers: Sequence[LayerStats]) -> None:
        """No run: the layout's layers, those of shards an earlier run finished done."""
        self._show_lines(False)
        self.table.reset(layers)

    def hide_lines(self) -> None:
        self._show_lines(False)

    def prepare(self, unit_count: int, layers: Sequence[LayerStats]) -> None:
        """A run was asked for; the engine has not started it yet."""
        self.table.reset(layers)
        self._show_lines(True)
        self.query_one("#convert-bar", ProgressBar).update(total=None, progress=0)
        self.query_one("#convert-bytes", Label).update("")
        self.query_one("#convert-rate", Static).update(Content.styled(
            f"preparing: {unit_count:,} units to convert...", "$text-muted"))

    def calibrating(self, ev: CalibrationProgress) -> None:
        """A calibrated recipe's pass, as far as the units need it (the fraction weighs each input by its modules'
        weights)."""
        line = self.query_one("#convert-calibration", Static)
        line.display = True
        done = Content.assemble((f"{'calibrate':<{KEY}}", "bold"), (f"{ev.fraction:.0%}", "bold"),
                                f" {ev.done} of {ev.total} {ev.step}")
        line.update(done + Content.styled(f"  {module_at(ev.at)}", "$text-muted"))  # the ETA is the run's, above

    def calibrated(self, ev: Calibrated) -> None:
        line = self.query_one("#convert-calibration", Static)
        line.display = True
        line.update(Content.assemble((f"{'calibrated':<{KEY}}", "bold"), calibration_text(ev)))

    def began(self, ev: ConvertStarted, layers: Sequence[LayerStats]) -> None:
        self._show_bytes(ev.resumed_bytes_in, ev.bytes_in)
        if layers:
            self.table.show(layers)
        resumed = f"resuming: {ev.resumed_shards} of {ev.shards} shards done earlier · " if ev.resumed_shards else ""
        self.query_one("#convert-rate", Static).update(Content.styled(
            f"{resumed}{ev.units:,} units, {units.gb(ev.bytes_in)} -> {units.gb(ev.bytes_out)}", "$text-muted"))

    def progressed(self, unit: UnitConverted, layers: Sequence[LayerStats]) -> None:
        """The bar and the table after `unit` (the screen shows the rate line, which counts shards too)."""
        self._show_bytes(unit.done_in, unit.total_in)
        self.table.show(layers, unit.layer)

    def show_rate(self, unit: UnitConverted, shards_done: int, shards: int) -> None:
        """The engine's rate and ETA after `unit`, the shards written and where the run is."""
        err = f" · err {error_text(unit.rel_error)}" if unit.rel_error is not None else ""
        self.query_one("#convert-rate", Static).update(Content.assemble(
            (f"{units.gb(unit.rate)}/s", "bold"), "  ETA ", (units.clock(unit.eta), "bold"),
            f"  shards {shards_done}/{shards}  ", (f"{where(unit)}{err}", "$text-muted")))

    def show_summary(self, ev: ConvertFinished, began: ConvertStarted | None, calibrated: Calibrated | None) -> None:
        """The finished run's figures where the progress lines were, keys aligned with the form's; a calibrated
        recipe's calibration on a line of its own."""
        self.query_one("#convert-bar-row").display = False
        self.query_one("#convert-calibration").display = False
        self.query_one("#convert-rate").display = True
        err = (f"{error_text(ev.mean_rel_error)}, max {error_text(ev.max_rel_error)}" if ev.mean_rel_error is not None
               else "- (nothing quantized)")
        resumed = (Content.styled(f"  (resumed: {began.resumed_shards} of {began.shards} shards were done before)",
                                  "$text-muted") if began is not None and began.resumed_shards else "")
        parts = [(f"{'done':<{KEY}}", "bold $text-success"),
                 f"in {ev.seconds:.1f} s: read {units.gb(ev.bytes_in)}, wrote ", (units.size(ev.bytes_out), "bold"),
                 f" in {plural(ev.shards, 'shard')}\n",
                 (f"{'rel. error':<{KEY}}", "bold"), f"mean {err}", resumed, "\n",
                 *([(f"{'calibrated':<{KEY}}", "bold"), calibration_text(calibrated), "\n"] if calibrated else []),
                 (f"{'written to':<{KEY}}", "bold"), display_path(Path(ev.dest))]
        self.query_one("#convert-rate", Static).update(Content.assemble(*parts))

"""The Convert screen: convert the loaded checkpoint with the Recipe screen's current recipe into a destination.

It composes the form (tui.widgets.convert_form) and the progress display (tui.widgets.run_progress), drives two
controllers next to it, and routes their messages: the check of the output before a run (convert_check: the layout
and what converting into the destination would do) and the run (convert_run: the engine's convert job and the worker
relaying its events). It keeps what they said: the last check's status, layout and destination, and the last run's
ConvertStarted, latest UnitConverted, shards written and ConvertFinished.

What the destination allows is the engine's (tqbench.destination): a new output or a resumable one starts with `r`;
a conflict (another recipe or source) or a complete output only with `f`, after a confirmation; files that are no
conversion never. `r` pressed while the output is being checked starts the run when the check ends, if the
destination allows it (`x` drops it). Cancel (`x` / escape) stops a run after the unit in progress: the output keeps
only whole shards and resumes later. Reopening the screen or coming back to it checks the destination again and
offers to resume (`r`).
"""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Header, Input, Static
from textual.worker import Worker, WorkerState

from tqbench.destination import OutputError, can_replace, can_start, kept_shards, read_output, source_base
from tqbench.errors import TqbenchError
from tqbench.events import Calibrated
from tqbench.state import remember_model
from tui.messages import (ConvertBegan, ConvertCalibrating, ConvertDone, ConvertFailed, ConvertProgress,
                          ConvertShardWritten, ConvertSource, ConvertStopped, DestinationChecked,
                          DestinationCheckFailed)
from tui.screens import convert_check, convert_run
from tui.screens.confirm import ConfirmScreen
from tui.screens.convert_check import OutputCheck, check_line, checking_line, same_key
from tui.screens.convert_run import ConvertRun, failed_note, run_line, stopped_note
from tui.state import display_path, remember_conversion, source_name
from tui.tally import Tally
from tui.widgets.convert_form import ConvertForm
from tui.widgets.footer import FittingFooter
from tui.widgets.layer_table import LayerTable
from tui.widgets.run_progress import RunProgress

CHECK_DELAY = 0.25  # seconds of quiet typing before the destination is checked again


class ConvertScreen(Screen):
    """Source (app.checkpoint), recipe (app.recipe, set on the Recipe screen), destination and shard size; then a
    run with overall and per-layer progress, and a summary."""

    AUTO_FOCUS = "#layers"
    BINDINGS = [
        Binding("r", "start", "Start"),
        Binding("enter", "start", "Start", show=False),
        Binding("x", "cancel", "Cancel"),
        Binding("escape", "cancel", "Cancel", show=False),
        Binding("f", "force", "Force"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.check = OutputCheck(self)
        self.run = ConvertRun(self)
        self.checkpoint = None
        self.recipe = None
        # the last check (its layout: self.check.layout)
        self.dest: Path | None = None
        self.status = None  # tqbench.convert.DestinationStatus
        self._input_error: str | None = None
        self._check_timer = None
        self._start_queued = False  # r was pressed while the output was being checked
        # the last run
        self.started = None  # tqbench.events.ConvertStarted
        self.finished_event = None  # tqbench.events.ConvertFinished
        self.last_unit = None  # tqbench.events.UnitConverted
        self.calibrated = None  # tqbench.events.Calibrated (a calibrated recipe)
        self.shards_done = 0
        self._done_key = None  # (layout key, destination) of the run that finished
        self._note: Content | None = None  # what the last run ended with (cancelled, failed), above the check

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="convert-empty")
        with Vertical(id="convert-body"):
            yield ConvertForm(id="convert-form")
            yield RunProgress()
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "Convert"
        self.progress.hide_lines()
        self.watch(self.app, "checkpoint", self._inputs_changed, init=False)
        self.watch(self.app, "recipe", self._inputs_changed, init=False)
        self._inputs_changed()

    def on_screen_resume(self) -> None:
        """Coming back to the screen: the destination may have changed meanwhile (another run, a crash)."""
        if self.is_mounted and not self.running:
            self._recheck()

    @property
    def running(self) -> bool:
        return self.run.running

    @property
    def checking(self) -> bool:
        """The output is being checked, or was typed and is checked once typing pauses."""
        return self.check.busy or self._check_timer is not None

    @property
    def form(self) -> ConvertForm:
        return self.query_one(ConvertForm)

    @property
    def progress(self) -> RunProgress:
        return self.query_one(RunProgress)

    @property
    def table(self) -> LayerTable:
        return self.progress.table

    # ---- the form -------------------------------------------------------------------------------------------------

    def _inputs_changed(self, _=None) -> None:
        """The checkpoint or the recipe changed (or the screen opened): refill the form. While a run goes on, the
        form keeps showing the run's; the new ones are taken when it ends."""
        if self.running:
            return
        ckpt = getattr(self.app, "checkpoint", None)
        recipe = getattr(self.app, "recipe", None)
        empty = self.query_one("#convert-empty", Static)
        if ckpt is None or recipe is None:
            empty.update(Content("No checkpoint loaded yet. Press s for the Source screen and open one (o)."))
            empty.display = True
            self.query_one("#convert-body").display = False
            self.checkpoint = None
            self.refresh_bindings()
            return
        empty.display = False
        self.query_one("#convert-body").display = True
        changed = ckpt is not self.checkpoint or recipe != self.recipe
        self.checkpoint, self.recipe = ckpt, recipe
        if changed:
            self._note = None
            self._start_queued = False
        self.sub_title = f"Convert: {source_name(ckpt)}"
        if changed:
            self.form.show_source(ckpt)
        self.form.show_recipe(recipe)
        if changed:
            self.form.fill_defaults(source_base(ckpt), recipe.name)
        self._recheck()

    @on(Input.Changed, "#dest")
    @on(Input.Changed, "#shard-size")
    @on(Input.Changed, "#cal-text")
    @on(Input.Changed, "#cal-tokens")
    def _field_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._note = None  # it was about the destination or shard size before
        self._start_queued = False  # it was for the output typed before
        if self._check_timer is not None:
            self._check_timer.stop()
        self._check_timer = self.set_timer(CHECK_DELAY, self._recheck)

    @on(Input.Submitted)
    def _field_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._recheck()
        self.table.focus()

    def action_leave_input(self) -> None:
        self.table.focus()

    # ---- checking the destination ---------------------------------------------------------------------------------

    def _recheck(self) -> None:
        """Check the destination again (and compute the layout first when the recipe or shard size changed)."""
        if self._check_timer is not None:
            self._check_timer.stop()
            self._check_timer = None
        if self.checkpoint is None or self.running:
            return
        try:
            output = read_output(source_base(self.checkpoint), self.form.dest_text, self.form.size_text)
        except OutputError as e:
            self._input_error = str(e)
            self.status = None
            self._start_queued = False
            self.check.cancel()
            self._show_status()
            return
        self._input_error = None
        self.check.request(self.checkpoint, self.recipe, output, self.form.calibration_texts)
        self._show_status()

    def on_destination_checked(self, message: DestinationChecked) -> None:
        if self.running or not self.check.checked(message):
            return
        self.dest, self.status = message.dest, message.status
        if self._result_shown():
            self.progress.show_summary(self.finished_event, self.started, self.calibrated)  # its table stays
        else:
            self.progress.show_layout(Tally(message.layout.layer_units, message.status.finished).snapshot())
        if self._start_queued:
            self._start_queued = False
            if can_start(self.status):
                self._start(replace=False)
                return
        self._show_status()

    def _result_shown(self) -> bool:
        """The last run finished with the checkpoint, recipe, shard size and destination of the form now, and the
        output is still complete."""
        return (self.finished_event is not None and self.status is not None and self.status.state == "complete"
                and same_key(self._done_key[0], self.check.key) and self._done_key[1] == self.dest)

    def on_destination_check_failed(self, message: DestinationCheckFailed) -> None:
        if self.check.failed(message.request_id):
            self.status = None
            self._input_error = message.message
            self._start_queued = False
            self._show_status()

    # ---- the status line ------------------------------------------------------------------------------------------

    def _show_status(self) -> None:
        line = self._status_line()
        if self._note is not None:
            line = self._note + Content("\n") + line
        self.form.show_status(line)
        self.refresh_bindings()

    def _status_line(self) -> Content:
        if self.running:
            return run_line(self.run.stopping)
        if self._input_error:
            return Content.styled(f"error: {self._input_error}", "bold $text-error")
        if self.check.busy or self.status is None:
            return checking_line(len(self.checkpoint.tensors), self._start_queued)
        return check_line(self.status, self.check.layout)

    # ---- starting, cancelling -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        ready = self.checkpoint is not None and not self.check.busy and self.status is not None \
            and not self._input_error
        if action == "start":
            if self.running:
                return False
            if self.checkpoint is not None and not self._input_error and self.checking:
                return True  # starts when the check ends (action_start queues it)
            return True if ready and can_start(self.status) else None
        if action == "force":
            return not self.running and ready and can_replace(self.status)
        if action == "cancel":
            return self.running or self._start_queued
        return True

    def action_start(self) -> None:
        if not self.check_action("start", ()):
            return
        if self.checking:
            self._start_queued = True
            if self._check_timer is not None:  # typed, not checked yet: check now
                self._recheck()
            self._show_status()
            return
        self._start(replace=False)

    def action_force(self) -> None:
        if not self.check_action("force", ()):
            return
        dest = display_path(self.dest)
        if self.status.state == "complete":
            question = f"Delete {dest} and convert again?"
            detail = f"It holds a complete conversion with {self.recipe.name}."
        else:
            question = f"Delete everything in {dest} and convert into it?"
            detail = f"It {self.status.detail}."

        def answered(yes: bool | None) -> None:
            if yes and self.check_action("force", ()):
                self._start(replace=True)

        self.app.push_screen(ConfirmScreen(question, detail), answered)

    def _start(self, replace: bool) -> None:
        lay, (_, recipe, size) = self.check.layout, self.check.key
        kept = kept_shards(self.status, replace)
        tally = Tally(lay.layer_units, kept)
        self._note = None
        self.started = self.finished_event = self.last_unit = self.calibrated = None
        self.shards_done = sum(kept)
        remember_conversion(source_base(lay.ckpt), recipe.name, self.dest, self.form.size_text.strip())
        self.run.start(lay, self.dest, recipe=recipe, shard_size=size, replace=replace, tally=tally,
                       calibration=self.check.calibration)
        self.form.disable_fields(True)
        self.progress.prepare(lay.units, tally.snapshot())
        self.table.focus()
        self._show_status()

    def action_cancel(self) -> None:
        if self._start_queued:
            self._start_queued = False
            self._show_status()
        elif self.running and not self.run.stopping:
            self.run.stop()
            self._show_status()

    # ---- the run --------------------------------------------------------------------------------------------------

    def on_convert_began(self, message: ConvertBegan) -> None:
        if not self.run.current(message.run_id):
            return
        ev = self.started = message.event
        self.shards_done = ev.resumed_shards
        self.progress.began(ev, message.layers)

    def on_convert_progress(self, message: ConvertProgress) -> None:
        if not self.run.current(message.run_id):
            return
        self.last_unit = message.unit
        self.progress.progressed(message.unit, message.layers)
        self._show_rate()

    def on_convert_calibrating(self, message: ConvertCalibrating) -> None:
        if not self.run.current(message.run_id):
            return
        if isinstance(message.event, Calibrated):
            self.calibrated = message.event
            self.progress.calibrated(message.event)
        else:
            self.progress.calibrating(message.event)

    def on_convert_source(self, message: ConvertSource) -> None:
        if self.run.current(message.run_id):
            self.progress.show_source(message.event)

    def on_convert_shard_written(self, message: ConvertShardWritten) -> None:
        if not self.run.current(message.run_id):
            return
        self.shards_done += 1
        self._show_rate()

    def _show_rate(self) -> None:
        if self.last_unit is not None and self.started is not None:
            self.progress.show_rate(self.last_unit, self.shards_done, self.started.shards)

    def on_convert_done(self, message: ConvertDone) -> None:
        if not self.run.current(message.run_id):
            return
        self.finished_event = message.event
        self._done_key = (self.check.key, self.dest)
        remember_model(Path(message.event.dest))  # the Chat screen (and `tqbench chat`) opens it next
        self._ended()

    def on_convert_stopped(self, message: ConvertStopped) -> None:
        if not self.run.current(message.run_id):
            return
        self._note = stopped_note(self.started, self.last_unit)
        self._ended()

    def on_convert_failed(self, message: ConvertFailed) -> None:
        if not self.run.current(message.run_id):
            return
        self._note = failed_note(message.message)
        self._ended()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that ended with an exception it did not turn into a message still ends as one line."""
        if event.state is not WorkerState.ERROR:
            return
        error = event.worker.error
        text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
        if event.worker.group == convert_check.GROUP:
            self.post_message(DestinationCheckFailed(request_id=self.check.request_id, message=text))
        elif event.worker.group == convert_run.GROUP and self.running:
            self.post_message(ConvertFailed(run_id=self.run.run_id, message=text))

    def _ended(self) -> None:
        """The run is over (finished, stopped or failed): the form comes back and the destination is checked."""
        self.run.ended()
        self.form.disable_fields(False)
        if self.finished_event is not None:
            self.progress.show_summary(self.finished_event, self.started, self.calibrated)
        else:
            self.progress.hide_lines()
        self._inputs_changed()  # takes a checkpoint or recipe chosen meanwhile, and checks the destination again
        self._show_status()

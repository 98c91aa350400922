"""The Convert screen: convert the loaded checkpoint with the Recipe screen's current recipe into a destination.

Before a run, a worker computes the conversion's layout (tqbench.convert.layout: a few seconds on Kimi K3, cached per
checkpoint, recipe and shard size) and what converting into the destination would do (destination_status): a new
output, a resumable one (how many shards are done), a complete one, or a conflict (another recipe or source, or
files that are no conversion) that only `f` replaces, after a confirmation.

A run is the engine's `convert()` generator on the process's one MLX thread (tqbench.engine): created,
iterated and closed there. A thread worker relays its events: it seeds per-layer totals (tui.tally) with the errors
earlier runs recorded (ConvertStarted.resumed_errors), counts every UnitConverted into them and posts them at most
~10 times a second (ConvertProgress merges when queued), while rate and ETA are the engine's. Cancel (`x` /
escape) asks the engine thread to stop after the unit in progress: it closes the generator, which drops the shard
being written, so the output keeps only whole shards and resumes later. Reopening the screen or coming back to it
checks the destination again and offers to resume (`r`).
"""

from __future__ import annotations

import time
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ProgressBar, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench import units
from tqbench.engine import Job, iterate_in_daemon, submit
from tqbench.errors import TqbenchError
from tqbench.events import ConvertFinished, ConvertStarted, ShardWritten, UnitConverted
from tqbench.recipe import parse_size
from tqbench.state import remember_model
from tui.messages import (ConvertBegan, ConvertDone, ConvertFailed, ConvertProgress, ConvertShardWritten,
                          ConvertStopped, DestinationChecked, DestinationCheckFailed)
from tui.screens.confirm import ConfirmScreen
from tui.state import display_path, last_conversion, remember_conversion
from tui.tally import Tally
from tui.widgets.inputs import OrderedInput
from tui.widgets.layer_table import LayerTable, error_text

DEFAULT_SHARD_SIZE = "5GiB"
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of a run
CHECK_DELAY = 0.25  # seconds of quiet typing before the destination is checked again
KEY = 11  # width of the form's labels


def default_dest(ckpt_path: Path, recipe_name: str) -> Path:
    """`<source dir>-<recipe name>` next to the source."""
    return ckpt_path.parent / f"{ckpt_path.name}-{recipe_name}"


def clock(seconds: float | None) -> str:
    """h:mm:ss, as rich's TimeRemainingColumn (the CLI's progress) shows an ETA."""
    if seconds is None:
        return "-:--:--"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def where(unit: UnitConverted) -> str:
    """The unit being converted: `layer 3 expert 17`, `layer 3`, or the tensor name outside the layers."""
    if unit.layer is None:
        return unit.name.rsplit(".", 2)[-2] if unit.name.count(".") >= 2 else unit.name
    return f"layer {unit.layer}" + (f" expert {unit.expert}" if unit.expert is not None else "")


def same_key(a, b) -> bool:
    """Two layout keys (checkpoint, recipe, shard size) are the same: the checkpoint by identity (comparing
    500k tensors would be slow)."""
    return a is not None and b is not None and a[0] is b[0] and a[1:] == b[1:]


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _pair(key: str, value: Content | str, hint: str = "") -> Content:
    line = Content.assemble((f"{key:<{KEY}}", "bold"), value)
    return line + Content.styled(f"  {hint}", "$text-muted") if hint else line


class ConvertInput(OrderedInput):
    """A one-line field; escape and enter hand the keys back to the screen (the table). Its key bindings (ctrl+u,
    ...) run in order with the characters typed around them (tui.widgets.inputs)."""

    BINDINGS = [
        Binding("enter", "submit", "Check"),  # checks the output at once and goes back to the table
        Binding("escape", "screen.leave_input", "Table", key_display="esc"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(compact=True, select_on_focus=False, **kwargs)


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
        self.checkpoint = None
        self.recipe = None
        self.dest: Path | None = None
        self.shard_size: int | None = None
        self.status = None  # tqbench.convert.DestinationStatus of the last check
        self.plan_layout = None  # tqbench.convert.Layout of the last check
        self.finished: tuple[bool, ...] = ()
        self._layout_key = None
        self._input_error: str | None = None
        self._check_id = 0
        self._checking = False
        self._check_timer = None
        self._default_dest: str | None = None  # the destination field's text when it was set by default
        self._default_size = DEFAULT_SHARD_SIZE  # the shard size field's, likewise
        # the run
        self._run_id = 0
        self._job: Job | None = None
        self._stopping = False
        self.started: ConvertStarted | None = None
        self.finished_event: ConvertFinished | None = None
        self.last_unit: UnitConverted | None = None
        self._done_key = None  # (layout key, destination) of the run that finished
        self.shards_done = 0
        self._note: Content | None = None  # what the last run ended with (cancelled, failed), above the check

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="convert-empty")
        with Vertical(id="convert-body"):
            with Vertical(id="convert-form"):
                yield Static("", id="convert-source")
                yield Static("", id="convert-recipe")
                with Horizontal(classes="form-row"):
                    yield Label("output", classes="convert-label")
                    yield ConvertInput(placeholder="output directory", id="dest")
                    yield Label("shard size", id="shard-label")
                    yield ConvertInput(value=DEFAULT_SHARD_SIZE, id="shard-size")
                yield Static("", id="convert-status")
            with Horizontal(id="convert-bar-row"):
                yield ProgressBar(total=None, show_eta=False, id="convert-bar")
                yield Label("", id="convert-bytes")
            yield Static("", id="convert-rate")
            yield LayerTable(id="layers")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Convert"
        self._show_progress(False)
        self.watch(self.app, "checkpoint", self._inputs_changed, init=False)
        self.watch(self.app, "recipe", self._inputs_changed, init=False)
        self._inputs_changed()

    def on_screen_resume(self) -> None:
        """Coming back to the screen: the destination may have changed meanwhile (another run, a crash)."""
        if self.is_mounted and not self.running:
            self._recheck()

    @property
    def running(self) -> bool:
        return self._job is not None

    @property
    def table(self) -> LayerTable:
        return self.query_one(LayerTable)

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
        self.sub_title = f"Convert: {display_path(ckpt.path)}"
        if changed:  # present_bytes sums every tensor (500k on K3): once per checkpoint
            self.query_one("#convert-source", Static).update(_pair(
                "source", display_path(ckpt.path),
                f"{units.gb(ckpt.present_bytes)} in {plural(len(ckpt.shards), 'shard')} (s: open another)"))
        self.query_one("#convert-recipe", Static).update(_pair(
            "recipe", Content.styled(recipe.name, "bold $text-accent"), "(p: change it on the Recipe screen)"))
        if changed:
            self._fill_defaults()
        self._recheck()

    def _fill_defaults(self) -> None:
        """Unless the user typed them: the destination and shard size of the last conversion of this checkpoint with
        this recipe (to resume it), else `<source>-<recipe>` and 5GiB."""
        dest_input, size_input = self.query_one("#dest", Input), self.query_one("#shard-size", Input)
        if dest_input.value and dest_input.value != self._default_dest:
            return
        remembered = last_conversion(self.checkpoint.path, self.recipe.name)
        if remembered is not None:
            dest, size = display_path(remembered[0]), remembered[1]
        else:
            dest = display_path(default_dest(self.checkpoint.path, self.recipe.name))
            size = DEFAULT_SHARD_SIZE if size_input.value == self._default_size else size_input.value
        self._default_dest, self._default_size = dest, size
        with self.prevent(Input.Changed):
            dest_input.value = dest
            size_input.value = size

    @on(Input.Changed, "#dest")
    @on(Input.Changed, "#shard-size")
    def _field_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._note = None  # it was about the destination or shard size before
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

    def _read_fields(self) -> tuple[Path | None, int | None]:
        """The destination and shard size typed, or (None, None) with `_input_error` set."""
        self._input_error = None
        text = self.query_one("#dest", Input).value.strip()
        if not text:
            self._input_error = "type an output directory"
            return None, None
        dest = Path(text).expanduser()
        try:
            size = parse_size(self.query_one("#shard-size", Input).value.strip())
        except TqbenchError as e:
            self._input_error = f"shard size: {e}"
            return None, None
        if size <= 0:
            self._input_error = "shard size: must be positive"
            return None, None
        src = self.checkpoint.path.resolve()
        target = dest.resolve()
        if target == src or src in target.parents:
            self._input_error = "the output directory must not be the source or inside it"
            return None, None
        return dest, size

    # ---- checking the destination ---------------------------------------------------------------------------------

    def _recheck(self) -> None:
        """Check the destination again (and compute the layout first when the recipe or shard size changed)."""
        if self._check_timer is not None:
            self._check_timer.stop()
            self._check_timer = None
        if self.checkpoint is None or self.running:
            return
        dest, size = self._read_fields()
        self._check_id += 1
        if dest is None:
            self.status = None
            self._checking = False
            self.workers.cancel_group(self, "check")
            self._show_status()
            return
        key = (self.checkpoint, self.recipe, size)
        cached = self.plan_layout if same_key(self._layout_key, key) else None
        self._checking = True
        self._show_status()
        self._check(self._check_id, key, cached, dest)

    @work(thread=True, exclusive=True, group="check", exit_on_error=False, description="check destination")
    def _check(self, check_id: int, key, cached, dest: Path) -> None:
        from tqbench.convert import destination_status, layout

        worker = get_current_worker()
        ckpt, recipe, size = key

        def engine():
            lay = cached if cached is not None else layout(ckpt, recipe, size)
            yield lay, destination_status(lay, dest)

        try:
            # On a daemon thread: quitting never waits for a K3 layout (pure Python: no MLX).
            result = next(iter(iterate_in_daemon(engine, lambda: worker.is_cancelled)), None)
        except TqbenchError as e:
            self.post_message(DestinationCheckFailed(check_id, str(e)))
            return
        except OSError as e:
            self.post_message(DestinationCheckFailed(check_id, f"{e.strerror or e}: {e.filename or dest}"))
            return
        if result is not None and not worker.is_cancelled:
            self.post_message(DestinationChecked(check_id, key, *result, dest=dest))

    def on_destination_checked(self, message: DestinationChecked) -> None:
        if message.request_id != self._check_id or self.running:
            return
        self._checking = False
        self._layout_key, self.plan_layout = message.key, message.layout
        self.dest, self.shard_size = message.dest, message.key[2]
        self.status, self.finished = message.status, message.status.finished
        if self._result_shown():
            self._show_summary()  # the finished run's table stays
        else:
            self._show_progress(False)
            self.table.reset(Tally(message.layout.layer_units, message.status.finished).snapshot())
        self._show_status()

    def _result_shown(self) -> bool:
        """The last run finished with the checkpoint, recipe, shard size and destination of the form now, and the
        output is still complete."""
        return (self.finished_event is not None and self.status is not None and self.status.state == "complete"
                and same_key(self._done_key[0], self._layout_key) and self._done_key[1] == self.dest)

    def on_destination_check_failed(self, message: DestinationCheckFailed) -> None:
        if message.request_id == self._check_id:
            self._checking = False
            self.status = None
            self._input_error = message.message
            self._show_status()

    # ---- the status line ------------------------------------------------------------------------------------------

    def _show_status(self) -> None:
        line = self.query_one("#convert-status", Static)
        text, style = self._status_text()
        content = Content.styled(text, style)
        if self._note is not None:
            content = self._note + Content("\n") + content
        line.update(content)
        self.refresh_bindings()

    def _status_text(self) -> tuple[str, str]:
        if self.running:
            if self._stopping:
                return "stopping after the unit in progress...", "bold $text-warning"
            return "converting: x to cancel (the output stays resumable)", "$text-accent"
        if self._input_error:
            return f"error: {self._input_error}", "bold $text-error"
        if self._checking or self.status is None:
            return f"checking the output (planning {len(self.checkpoint.tensors):,} tensors)...", "$text-muted"
        s, lay = self.status, self.plan_layout
        # What the files will hold (as the run's "wrote"), and of it the tensors (the Recipe screen's total).
        sizes = (f"{units.gb(lay.plan.source_bytes)} -> {units.gb(lay.file_bytes)} "
                 f"({units.gb(lay.plan.total_bytes)} of tensors)")
        if s.state == "new":
            return f"new output: {plural(s.total_shards, 'shard')}, {sizes}.  r: start", "bold $text-success"
        if s.state == "resumable":
            return (f"resumable: {s.done_shards} of {s.total_shards} shards done.  r: resume",
                    "bold $text-warning")
        if s.state == "complete":
            return f"complete: {s.detail}.  f: convert again", "bold $text-success"
        if s.state == "foreign":
            return f"not an output: the directory {s.detail}; choose another", "bold $text-error"
        return f"conflict: the output {s.detail}.  f: replace it", "bold $text-error"

    # ---- starting, cancelling -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        ready = self.checkpoint is not None and not self._checking and self.status is not None \
            and not self._input_error
        if action == "start":
            if self.running:
                return False
            return True if ready and self.status.state in ("new", "resumable") else None
        if action == "force":
            return not self.running and ready and self.status.state in ("conflict", "complete")
        if action == "cancel":
            return self.running
        return True

    def action_start(self) -> None:
        if self.check_action("start", ()):
            self._start(force=False)

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
                self._start(force=True)

        self.app.push_screen(ConfirmScreen(question, detail), answered)

    def _start(self, force: bool) -> None:
        lay, dest, recipe, size = self.plan_layout, self.dest, self.recipe, self.shard_size

        def conversion():  # on the engine thread: MLX is imported, used and released there
            from tqbench.convert import convert

            return convert(lay, dest, recipe, size, force)

        finished = tuple(False for _ in self.finished) if force else self.finished
        tally = Tally(self.plan_layout.layer_units, finished)
        self._run_id += 1
        self._note = None
        self._stopping = False
        self.started = self.finished_event = self.last_unit = None
        self.shards_done = sum(finished)
        remember_conversion(lay.ckpt.path, recipe.name, dest, self.query_one("#shard-size", Input).value.strip())
        self._job = submit(conversion)
        for widget in self.query(ConvertInput):
            widget.disabled = True
        self.table.reset(tally.snapshot())
        self.table.focus()
        self._show_progress(True)
        self.query_one("#convert-bar", ProgressBar).update(total=None, progress=0)
        self.query_one("#convert-bytes", Label).update("")
        self.query_one("#convert-rate", Static).update(Content.styled(
            f"preparing: {lay.units:,} units to convert...", "$text-muted"))
        self._show_status()
        self._relay(self._run_id, self._job, tally)

    def action_cancel(self) -> None:
        if self.running and not self._stopping:
            self._stopping = True
            self._job.stop()  # the engine thread stops after the unit in progress
            self._show_status()

    # ---- the run --------------------------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="convert", exit_on_error=False, description="convert")
    def _relay(self, run_id: int, job: Job, tally: Tally) -> None:
        worker = get_current_worker()
        unit: UnitConverted | None = None
        posted = 0.0
        pending = False

        def flush() -> None:
            nonlocal pending, posted
            if pending and unit is not None:
                self.post_message(ConvertProgress(run_id, unit, tally.snapshot()))
                posted = time.monotonic()
                pending = False

        finished = False
        try:
            for event in job.items(lambda: worker.is_cancelled):
                if isinstance(event, UnitConverted):
                    tally.add(event)
                    unit, pending = event, True
                    if time.monotonic() - posted >= PROGRESS_INTERVAL:
                        flush()
                    continue
                flush()
                if isinstance(event, ConvertStarted):
                    tally.seed(event.resumed_errors)  # the errors of units earlier runs converted
                    self.post_message(ConvertBegan(run_id, event, tally.snapshot()))
                elif isinstance(event, ShardWritten):
                    self.post_message(ConvertShardWritten(run_id, event))
                elif isinstance(event, ConvertFinished):
                    finished = True
                    self.post_message(ConvertDone(run_id, event))
        except TqbenchError as e:
            flush()
            self.post_message(ConvertFailed(run_id, str(e)))
            return
        except Exception as e:  # a bug or an OSError: still one line, and the run ends
            flush()
            self.post_message(ConvertFailed(run_id, f"{type(e).__name__}: {e}"))
            return
        finally:
            job.stop()
            job.wait()  # the generator is closed on the engine thread: no shard is half-written any more
        flush()
        if not finished:
            self.post_message(ConvertStopped(run_id))

    def on_convert_began(self, message: ConvertBegan) -> None:
        if message.run_id != self._run_id:
            return
        ev = self.started = message.event
        self.shards_done = ev.resumed_shards
        self.query_one("#convert-bar", ProgressBar).update(total=ev.bytes_in, progress=ev.resumed_bytes_in)
        self._show_bytes(ev.resumed_bytes_in, ev.bytes_in)
        if message.layers:
            self.table.show(message.layers)
        resumed = f"resuming: {ev.resumed_shards} of {ev.shards} shards done earlier · " if ev.resumed_shards else ""
        self.query_one("#convert-rate", Static).update(Content.styled(
            f"{resumed}{ev.units:,} units, {units.gb(ev.bytes_in)} -> {units.gb(ev.bytes_out)}", "$text-muted"))

    def on_convert_progress(self, message: ConvertProgress) -> None:
        if message.run_id != self._run_id:
            return
        u = self.last_unit = message.unit
        self.query_one("#convert-bar", ProgressBar).update(total=u.total_in, progress=u.done_in)
        self._show_bytes(u.done_in, u.total_in)
        self._show_rate()
        self.table.show(message.layers, u.layer)

    def on_convert_shard_written(self, message: ConvertShardWritten) -> None:
        if message.run_id != self._run_id:
            return
        self.shards_done += 1
        self._show_rate()

    def on_convert_done(self, message: ConvertDone) -> None:
        if message.run_id != self._run_id:
            return
        self.finished_event = message.event
        self._done_key = (self._layout_key, self.dest)
        remember_model(Path(message.event.dest))  # the Chat screen (and `tqbench chat`) opens it next
        self._ended()

    def _show_summary(self) -> None:
        """The finished run's figures (tqbench.events.ConvertFinished), where the progress lines were."""
        ev = self.finished_event
        self.query_one("#convert-bar-row").display = False
        self.query_one("#convert-rate").display = True
        err = (f"{error_text(ev.mean_rel_error)}, max {error_text(ev.max_rel_error)}" if ev.mean_rel_error is not None
               else "- (nothing quantized)")
        began = self.started
        resumed = (Content.styled(f"  (resumed: {began.resumed_shards} of {began.shards} shards were done before)",
                                  "$text-muted") if began is not None and began.resumed_shards else "")
        self.query_one("#convert-rate", Static).update(Content.assemble(  # keys aligned with the form's
            (f"{'done':<{KEY}}", "bold $text-success"), f"in {ev.seconds:.1f} s: read {units.gb(ev.bytes_in)}, wrote ",
            (units.size(ev.bytes_out), "bold"), f" in {plural(ev.shards, 'shard')}\n",
            (f"{'rel. error':<{KEY}}", "bold"), f"mean {err}", resumed, "\n",
            (f"{'written to':<{KEY}}", "bold"), display_path(Path(ev.dest))))

    def on_convert_stopped(self, message: ConvertStopped) -> None:
        if message.run_id != self._run_id:
            return
        got = ""
        if self.started is not None and self.last_unit is not None:
            got = f" at {self.last_unit.done_in / max(self.last_unit.total_in, 1):.1%} ({where(self.last_unit)})"
        self._note = Content.styled(f"cancelled{got}: only whole shards were kept.", "bold $text-warning")
        self._ended()

    def on_convert_failed(self, message: ConvertFailed) -> None:
        if message.run_id != self._run_id:
            return
        self._note = Content.styled(f"failed: {message.message}", "bold $text-error")
        self._ended()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that ended with an exception it did not turn into a message still ends as one line."""
        if event.state is not WorkerState.ERROR:
            return
        error = event.worker.error
        text = str(error) if isinstance(error, TqbenchError) else f"{type(error).__name__}: {error}"
        if event.worker.group == "check":
            self.post_message(DestinationCheckFailed(self._check_id, text))
        elif event.worker.group == "convert" and self.running:
            self.post_message(ConvertFailed(self._run_id, text))

    def _ended(self) -> None:
        """The run is over (finished, stopped or failed): the form comes back and the destination is checked."""
        self._job = None
        self._stopping = False
        for widget in self.query(ConvertInput):
            widget.disabled = False
        if self.finished_event is not None:
            self._show_summary()
        else:
            self._show_progress(False)
        self._inputs_changed()  # takes a checkpoint or recipe chosen meanwhile, and checks the destination again
        self._show_status()

    # ---- progress lines -------------------------------------------------------------------------------------------

    def _show_progress(self, shown: bool) -> None:
        self.query_one("#convert-bar-row").display = shown
        self.query_one("#convert-rate").display = shown

    def _show_bytes(self, done: int, total: int) -> None:
        self.query_one("#convert-bytes", Label).update(f"{units.gb(done)} of {units.gb(total)}")

    def _show_rate(self) -> None:
        u, started = self.last_unit, self.started
        if u is None or started is None:
            return
        err = f" · err {error_text(u.rel_error)}" if u.rel_error is not None else ""
        self.query_one("#convert-rate", Static).update(Content.assemble(
            (f"{units.gb(u.rate)}/s", "bold"), "  ETA ", (clock(u.eta), "bold"),
            f"  shards {self.shards_done}/{started.shards}  ", (f"{where(u)}{err}", "$text-muted")))

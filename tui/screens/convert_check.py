"""The Convert screen's check of its output, before a run: a thread worker reads a calibrated recipe's calibration
fields (their digest is part of the plan fingerprint, so an output converted with other texts is another
conversion), computes the conversion's layout (tqbench.convert.layout: a few seconds on Kimi K3; the last one is reused
while the checkpoint, recipe, shard size and calibration digest stay) and what converting into the destination would
do (destination_status). It posts DestinationChecked or
DestinationCheckFailed with its request id: a newer request supersedes it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from textual.content import Content
from textual.screen import Screen
from textual.worker import get_current_worker

from tqbench import units
from tqbench.convert.calibration_request import read_calibration
from tqbench.destination import Output
from tqbench.engine import iterate_in_daemon
from tqbench.errors import TqbenchError
from tui.messages import DestinationChecked, DestinationCheckFailed
from tui.widgets.convert_form import plural

GROUP = "check"  # the workers' group


def same_key(a, b) -> bool:
    """Two layout keys (checkpoint, recipe, shard size) are the same: the checkpoint by identity (comparing
    500k tensors would be slow)."""
    return a is not None and b is not None and a[0] is b[0] and a[1:] == b[1:]


def check_line(s, lay) -> Content:
    """What a check found (tqbench.convert.DestinationStatus, Layout), with the key that acts on it."""
    # What the files will hold (as the run's "wrote"), and of it the tensors (the Recipe screen's total).
    sizes = (f"{units.gb(lay.plan.source_bytes)} -> {units.gb(lay.file_bytes)} "
             f"({units.gb(lay.plan.total_bytes)} of tensors)")
    if s.state == "new":
        return Content.styled(f"new output: {plural(s.total_shards, 'shard')}, {sizes}.  r: start",
                              "bold $text-success")
    if s.state == "resumable":
        return Content.styled(f"resumable: {s.done_shards} of {s.total_shards} shards done.  r: resume",
                              "bold $text-warning")
    if s.state == "complete":
        return Content.styled(f"complete: {s.detail}.  f: convert again", "bold $text-success")
    if s.state == "foreign":
        return Content.styled(f"not an output: the directory {s.detail}; choose another", "bold $text-error")
    return Content.styled(f"conflict: the output {s.detail}.  f: replace it", "bold $text-error")


def checking_line(tensors: int, start_queued: bool) -> Content:
    """While a check runs; `start_queued`: r was pressed meanwhile, and the run starts when the check allows it."""
    then = "  r: starts when checked (x: don't)" if start_queued else ""
    return Content.styled(f"checking the output (planning {tensors:,} tensors)...{then}", "$text-muted")


class OutputCheck:
    """Runs the screen's checks, one at a time: a new request cancels the one before (and its message is dropped)."""

    def __init__(self, screen: Screen) -> None:
        self._screen = screen
        self.request_id = 0
        self.busy = False
        # the newest check's layout (tqbench.convert.Layout) and what it is for: (checkpoint, recipe, shard size)
        self.key = None
        self.layout = None
        self.calibration = None  # its CalibrationRequest (a calibrated recipe)

    def request(self, checkpoint, recipe, output: Output, calibration: tuple[str, str]) -> None:
        """Check `output` for converting `checkpoint` with `recipe`; `calibration`: the calibration fields (texts,
        tokens) as typed, read when the recipe calibrates."""
        self.request_id += 1
        self.busy = True
        key = (checkpoint, recipe, output.shard_size)
        cached = self.layout if same_key(self.key, key) else None
        fields = calibration if recipe.calibrate else None
        check = partial(self._check, self.request_id, key, cached=cached, dest=output.dest, fields=fields)
        self._screen.run_worker(check, thread=True, exclusive=True, group=GROUP, exit_on_error=False,
                                description="check destination")

    def cancel(self) -> None:
        """No check is wanted (the fields cannot be checked): the one running is dropped."""
        self.request_id += 1
        self.busy = False
        self._screen.workers.cancel_group(self._screen, GROUP)

    def checked(self, message: DestinationChecked) -> bool:
        """Whether the result answers the newest request (it is then the one to show)."""
        if message.request_id != self.request_id:
            return False
        self.busy = False
        self.key, self.layout, self.calibration = message.key, message.layout, message.calibration
        return True

    def failed(self, request_id: int) -> bool:
        """Whether the failure is the newest request's."""
        if request_id != self.request_id:
            return False
        self.busy = False
        return True

    def _check(self, request_id: int, key, *, cached, dest: Path, fields: tuple[str, str] | None) -> None:
        from tqbench.convert import destination_status, layout

        worker = get_current_worker()
        ckpt, recipe, size = key

        def engine():
            calibration = read_calibration(texts=fields[0], tokens=fields[1]) if fields is not None else None
            digest = calibration.digest() if calibration is not None else ""
            lay = cached if cached is not None and cached.calibration == digest else layout(ckpt, recipe, size, digest)
            yield lay, destination_status(lay, dest), calibration

        screen = self._screen
        try:
            # On a daemon thread: quitting never waits for a K3 layout (pure Python: no MLX).
            result = next(iter(iterate_in_daemon(engine, lambda: worker.is_cancelled)), None)
        except TqbenchError as e:
            screen.post_message(DestinationCheckFailed(request_id=request_id, message=str(e)))
            return
        except OSError as e:
            screen.post_message(DestinationCheckFailed(request_id=request_id,
                                                       message=f"{e.strerror or e}: {e.filename or dest}"))
            return
        if result is not None and not worker.is_cancelled:
            lay, status, calibration = result
            screen.post_message(DestinationChecked(request_id=request_id, key=key, layout=lay, status=status,
                                                   dest=dest, calibration=calibration))

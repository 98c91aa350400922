"""The Convert screen's run: the engine's `convert()` generator on the process's one MLX thread (tqbench.engine),
created, iterated and closed there, and a thread worker that relays its events to the screen as messages.

The worker seeds per-layer totals (tui.tally) with the errors earlier runs recorded (ConvertStarted.resumed_errors),
counts every UnitConverted into them and posts them at most ~10 times a second (ConvertProgress merges when queued),
while rate and ETA are the engine's. Stopping asks the engine thread to stop after the unit in progress: it closes the
generator, which drops the shard being written, so the output keeps only whole shards and resumes later.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from textual.content import Content
from textual.screen import Screen
from textual.worker import get_current_worker

from tqbench.engine import Job, submit
from tqbench.errors import TqbenchError
from tqbench.events import (CalibrationProgress, Calibrated, ConvertFinished, ConvertStarted, ShardWritten,
                            SourceProgress, SourceRemoved, UnitConverted)
from tui.messages import (ConvertBegan, ConvertCalibrating, ConvertDone, ConvertFailed, ConvertProgress,
                          ConvertShardWritten, ConvertSource, ConvertStopped)
from tui.tally import Tally
from tui.widgets.run_progress import where

GROUP = "convert"  # the relay workers' group
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of a run


def run_line(stopping: bool) -> Content:
    """The status line while a run goes on."""
    if stopping:
        return Content.styled("stopping after the unit in progress...", "bold $text-warning")
    return Content.styled("converting: x to cancel (the output stays resumable)", "$text-accent")


def stopped_note(started: ConvertStarted | None, last: UnitConverted | None) -> Content:
    """What a cancelled run ended with: how far it got, if it got going."""
    got = ""
    if started is not None and last is not None:
        got = f" at {last.done_in / max(last.total_in, 1):.1%} ({where(last)})"
    return Content.styled(f"cancelled{got}: only whole shards were kept.", "bold $text-warning")


def failed_note(message: str) -> Content:
    return Content.styled(f"failed: {message}", "bold $text-error")


class ConvertRun:
    """One conversion at a time for the screen; its messages carry `run_id`, and those of an older run are stale."""

    def __init__(self, screen: Screen) -> None:
        self._screen = screen
        self.run_id = 0
        self._job: Job | None = None
        self.stopping = False  # the user cancelled the run going on

    @property
    def running(self) -> bool:
        return self._job is not None

    def current(self, run_id: int) -> bool:
        """A message of the run going on (or of the last one, until another starts)."""
        return run_id == self.run_id

    def start(self, lay, dest: Path, *, recipe, shard_size: int, replace: bool, tally: Tally,
              calibration=None) -> None:
        """Convert with `lay` (tqbench.convert.Layout) into `dest`; `replace`: delete the conversion there first.
        `tally` counts the layout's units, those of shards an earlier run finished done; `calibration`: a calibrated
        recipe's texts and tokens (tqbench.convert.calibration_request.CalibrationRequest)."""
        def conversion():  # on the engine thread: MLX is imported, used and released there
            from tqbench.convert import convert

            return convert(lay, dest, recipe, shard_size, replace, calibration=calibration)

        self.run_id += 1
        self.stopping = False
        self._job = submit(conversion)
        self._screen.run_worker(partial(self._relay, self.run_id, self._job, tally), thread=True, exclusive=True,
                                group=GROUP, exit_on_error=False, description="convert")

    def stop(self) -> None:
        """The engine thread stops after the unit in progress; ConvertStopped follows."""
        if self._job is not None and not self.stopping:
            self.stopping = True
            self._job.stop()

    def ended(self) -> None:
        """The screen took the run's last message (done, stopped or failed)."""
        self._job = None
        self.stopping = False

    def _relay(self, run_id: int, job: Job, tally: Tally) -> None:
        worker = get_current_worker()
        post = self._screen.post_message
        unit: UnitConverted | None = None
        posted = 0.0
        pending = False

        def flush() -> None:
            nonlocal pending, posted
            if pending and unit is not None:
                post(ConvertProgress(run_id=run_id, unit=unit, layers=tally.snapshot()))
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
                    post(ConvertBegan(run_id=run_id, event=event, layers=tally.snapshot()))
                elif isinstance(event, ShardWritten):
                    post(ConvertShardWritten(run_id=run_id, event=event))
                elif isinstance(event, (CalibrationProgress, Calibrated)):
                    post(ConvertCalibrating(run_id=run_id, event=event))
                elif isinstance(event, (SourceProgress, SourceRemoved)):
                    post(ConvertSource(run_id=run_id, event=event))
                elif isinstance(event, ConvertFinished):
                    finished = True
                    post(ConvertDone(run_id=run_id, event=event))
        except TqbenchError as e:
            flush()
            post(ConvertFailed(run_id=run_id, message=str(e)))
            return
        except Exception as e:  # a bug or an OSError: still one line, and the run ends
            flush()
            post(ConvertFailed(run_id=run_id, message=f"{type(e).__name__}: {e}"))
            return
        finally:
            job.stop()
            job.wait()  # the generator is closed on the engine thread: no shard is half-written any more
        flush()
        if not finished:
            post(ConvertStopped(run_id=run_id))

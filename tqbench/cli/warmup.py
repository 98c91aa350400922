"""What the first token waits for, on stderr (tqbench.runtime.warmup's events): tqbench's CUDA kernels being built
while the model opens, and MLX compiling its own in the first forward pass. A rich progress line on a terminal
(gone once done), whole lines when piped; nothing at all where nothing is compiled (a CPU, every kernel cached)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tqbench.chat import report

PLAIN_STEP = 0.10  # piped: a line each time another tenth of the kernels is built


class KernelProgress:
    """Renders KernelsCompiling events: `show` each; leaving the `with` block ends the progress line however the load
    ended."""

    def __init__(self, err: Console) -> None:
        self.err = err
        self._progress: Progress | None = None
        self._task = None
        self._next_step = PLAIN_STEP
        self._announced = False

    def show(self, ev) -> None:
        if self.err.is_terminal:
            if self._progress is None:
                self._progress = Progress(SpinnerColumn(), TextColumn("building tqbench's CUDA kernels"), BarColumn(),
                                          MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[what]}"),
                                          console=self.err, transient=True)
                self._progress.start()
                self._task = self._progress.add_task("kernels", total=ev.total, what="")
            what = "from the cache" if ev.cached else f"compiled {ev.name}"
            self._progress.update(self._task, completed=ev.done, what=what)
        elif ev.compiled:  # piped: lines only once something is compiled (cached kernels load in moments)
            if not self._announced or ev.done / ev.total >= self._next_step - 1e-9 or ev.done == ev.total:
                self._say(report.kernels_line(ev))
                self._announced = True
                while self._next_step <= ev.done / ev.total + 1e-9:
                    self._next_step += PLAIN_STEP
        if ev.done == ev.total:
            self.close()
            if ev.compiled:
                self._say(report.kernels_done_line(ev))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> KernelProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _say(self, line: str) -> None:
        print(line, file=self.err.file, flush=True)


class MlxWarmupStatus:
    """Renders MlxWarmup / MlxWarmedUp around the first forward pass: a spinner with the elapsed time on a terminal,
    lines when piped (the warning only on the first run on this machine); the compiled count after, when MLX
    compiled any. Leaving the `with` block ends the spinner however the reply ended."""

    def __init__(self, err: Console) -> None:
        self.err = err
        self._progress: Progress | None = None

    def started(self, ev) -> None:
        if self.err.is_terminal:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=self.err, transient=True)
            self._progress.start()
            self._progress.add_task(report.mlx_warmup_line(ev), total=None)
        elif ev.first_run:
            print(report.mlx_warmup_line(ev), file=self.err.file, flush=True)

    def ended(self, ev) -> None:
        self.close()
        if ev.compiled:
            print(report.mlx_warmed_line(ev), file=self.err.file, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> MlxWarmupStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

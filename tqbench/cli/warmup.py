"""What the first token waits for, on stderr: tqbench's CUDA kernels being built while the model opens, MLX compiling
its own in the first forward pass (tqbench.runtime.warmup's events; nothing at all where nothing is compiled: a CPU,
every kernel cached), and a long prompt's processing (PrefillProgress). A rich progress line on a terminal (gone once
done), whole lines when piped."""

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
                columns = (SpinnerColumn(), TextColumn("building tqbench's CUDA kernels"), BarColumn(),
                           MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[what]}"))
                self._progress = Progress(*columns, console=self.err, transient=True)
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


class PrefillStatus:
    """Renders PrefillProgress: a bar with the experts read on a terminal (gone once the prompt is processed), a line
    each tenth of the work when piped; a prompt of one chunk (tqbench.runtime.prefill.PREFILL_STEP tokens or fewer)
    shows nothing when piped, its figures being in the reply's summary."""

    def __init__(self, err: Console) -> None:
        self.err = err
        self._progress: Progress | None = None
        self._task = None
        self._chunks = False  # the prompt runs in several chunks or layer by layer (not in one chunk)
        self._said = 0.0  # piped: the share of the prompt's work the last line told

    def show(self, ev) -> None:
        if self.err.is_terminal:
            if self._progress is None and ev.done < ev.total:
                self._progress = Progress(TextColumn(f"processing the prompt ({ev.total:,} tokens)"), BarColumn(),
                                          TextColumn("{task.percentage:>3.0f}% {task.fields[what]}"),
                                          TimeElapsedColumn(), console=self.err, transient=True)
                self._progress.start()
                self._task = self._progress.add_task("prompt", total=1.0, what="")
            if self._progress is not None:
                read = f"· {ev.experts_read:,} experts read" if ev.experts_read else ""
                self._progress.update(self._task, completed=ev.fraction, what=read)
        else:
            self._chunks = self._chunks or ev.done < ev.total - 1 or bool(ev.layers)
            if self._chunks and (ev.fraction >= self._said + PLAIN_STEP or ev.done >= ev.total):
                self._said = ev.fraction
                print(report.prefill_line(ev), file=self.err.file, flush=True)
        if ev.done >= ev.total:
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> PrefillStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

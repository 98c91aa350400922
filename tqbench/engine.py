"""The engine thread: all MLX work of a process runs on one long-lived thread, whichever face asked for it.

Why one thread:
- a lazy MLX array cannot be evaluated on another thread than the one that built it, so a job's generator is created,
  iterated and closed on one thread, and every event it yields holds evaluated values only;
- MLX 0.32 aborts the process at exit ("terminate called without an active exception") when a compiled function ran
  on a thread that has since ended, or when a thread is inside MLX while the interpreter exits. So the thread never
  ends, and `stop_all()` (also registered with atexit) stops the running job before the process leaves.

A *job* is a generator function run there; its items reach the caller's thread through a queue. Closing a job
(`stop()`, leaving its `with` block, Ctrl-C in the CLI) makes the engine thread close the generator after the item in
progress, so a conversion drops the shard it was writing and stays resumable. State kept between jobs (a chat's loaded
model, its KV cache, its expert cache: tqbench.chat.session.ChatSession) is only ever touched on the engine thread.
Helper threads may read bytes (os.pread releases the GIL) but never touch MLX.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")
_DONE = object()
THREAD_NAME = "tqbench-mlx"


class Job(Generic[T]):
    """One generator run on the engine thread. Iterate it (or `items(cancelled)`) on any other thread."""

    def __init__(self, make: Callable[[], Iterable[T]]) -> None:
        self._make = make
        self._items: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._done = threading.Event()

    def stop(self) -> None:
        """Ask the engine thread to close the generator after the item in progress (returns at once)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def done(self) -> bool:
        """The generator is closed (finished, failed or stopped): nothing of this job runs any more."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop and wait until the generator is closed on the engine thread."""
        self.stop()
        self.wait(timeout)

    def items(self, cancelled: Callable[[], bool] = lambda: False, poll: float = 0.05) -> Iterator[T]:
        """The generator's items, on the calling thread, until it ends; an exception it raised is raised here.
        Once `cancelled()` is true, asks the job to stop and returns without waiting for it."""
        while True:
            if cancelled():
                self.stop()
                return
            try:
                ok, item = self._items.get(timeout=poll)
            except queue.Empty:
                continue
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item

    def __iter__(self) -> Iterator[T]:
        return self.items()

    def result(self) -> list[T]:
        """Every item, once the job has ended."""
        return list(self.items())

    def __enter__(self) -> Job[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            if self._stop.is_set():
                return  # stopped before it started
            gen = self._make()
            try:
                for item in gen:
                    self._items.put((True, item))
                    if self._stop.is_set():
                        break
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()  # here, on the engine thread
        except BaseException as e:  # handed to the consumer
            self._items.put((False, e))
        finally:
            self._items.put((True, _DONE))
            self._done.set()


class Engine:
    """The thread and its queue of jobs. One per process: `engine()`."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: list[Job] = []  # submitted and not done (for stop_all)

    def submit(self, make: Callable[[], Iterable[T]]) -> Job[T]:
        """Queue `make()` (a generator function) on the engine thread: created, iterated and closed there."""
        job = Job(make)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
                self._thread.start()
                atexit.register(self.stop_all)
            self._pending = [j for j in self._pending if not j.done] + [job]
        self._jobs.put(job)
        return job

    def call(self, fn: Callable[[], R]) -> R:
        """Run `fn()` on the engine thread and return its result (its exception is raised here)."""
        if self.on_thread():
            return fn()
        with self.submit(lambda: iter((fn(),))) as job:
            return next(iter(job))

    @property
    def busy(self) -> bool:
        """A job is queued or running."""
        with self._lock:
            return any(not j.done for j in self._pending)

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def _loop(self) -> None:
        while True:
            self._jobs.get()._run()

    def stop_all(self, timeout: float = 120.0) -> None:
        """Stop every job and wait (up to `timeout` each) until the thread is out of MLX, so the process can exit.
        Any face calls it when it quits; atexit calls it too."""
        with self._lock:
            jobs = list(self._pending)
        for job in jobs:
            job.stop()
        if self.on_thread():
            return  # called from a job: the caller is the thread
        for job in jobs:
            job.wait(timeout)


_engine = Engine()


def engine() -> Engine:
    return _engine


def submit(make: Callable[[], Iterable[T]]) -> Job[T]:
    """Queue a generator function on the process's engine thread."""
    return _engine.submit(make)


def stop_all(timeout: float = 120.0) -> None:
    _engine.stop_all(timeout)


def iterate_in_daemon(make: Callable[[], Iterable[T]], cancelled: Callable[[], bool],
                      poll: float = 0.05) -> Iterator[T]:
    """Yield what `make()` yields, produced on a throwaway daemon thread; stop early once `cancelled()` is true.

    For pure-Python work that must not hold up a face's exit (reading 500k shard headers takes seconds with nothing
    to check a cancellation in between): the caller only waits on a queue, and a cancelled producer is abandoned.
    Never for MLX work (that goes to `submit`). An exception raised by the producer is raised here."""
    items: queue.Queue = queue.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in make():
                if stop.is_set():
                    return
                items.put((True, item))
            items.put((True, _DONE))
        except BaseException as e:  # handed to the consumer
            items.put((False, e))

    threading.Thread(target=produce, name="tqbench-daemon", daemon=True).start()
    try:
        while True:
            try:
                ok, item = items.get(timeout=poll)
            except queue.Empty:
                if cancelled():
                    return
                continue
            if not ok:
                raise item
            if item is _DONE or cancelled():
                return
            yield item
    finally:
        stop.set()

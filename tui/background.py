"""Run an engine generator on a daemon thread, so a cancelled worker (or quitting the app) never waits for it.

A Textual thread worker runs in asyncio's default executor, which the interpreter joins at exit: a worker blocked
inside a long engine step (classifying 500k tensors takes seconds with no event in between) would hold up `q`.
Here the worker only waits on a queue and polls its cancellation; the daemon thread is abandoned when cancelled.
For header reading and other pure-Python work; MLX work goes to the one long-lived engine thread below
(`run_on_engine`).
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


def iterate_in_daemon(make: Callable[[], Iterable[T]], cancelled: Callable[[], bool],
                      poll: float = 0.05) -> Iterator[T]:
    """Yield what `make()` yields, produced on a daemon thread; stop early once `cancelled()` is true.
    An exception raised by the producer is raised here."""
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

    threading.Thread(target=produce, name="tqbench-engine", daemon=True).start()
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


# ---- the MLX engine thread ------------------------------------------------------------------------------------------
#
# MLX work (a conversion) runs on one long-lived daemon thread for the whole process, never on a Textual worker:
# - a lazy MLX array cannot cross threads, so a generator must be created, iterated and closed on one thread;
# - MLX 0.32 aborts the process at exit ("terminate called without an active exception") when a compiled function
#   (turboquant's fused quantizer) ran on a thread that has since ended, or when a thread is inside MLX while the
#   interpreter exits. So the thread never ends, and exit first stops the running job (see `shutdown`).
# A Textual worker relays a job's items with `EngineJob.items_until(cancelled)`: it returns at once when cancelled;
# the job stops after the item in progress, closing its generator on the engine thread.


class EngineJob:
    """One generator run on the engine thread. `stop()` makes it close the generator after the current item."""

    def __init__(self, make: Callable[[], Iterable[T]]) -> None:
        self._make = make
        self._items: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._done = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def done(self) -> bool:
        """The generator is closed (finished, failed or stopped): nothing of this job runs any more."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def items_until(self, cancelled: Callable[[], bool], poll: float = 0.05) -> Iterator:
        """Yield the generator's items on the calling thread until it ends; an exception it raised is raised here.
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
                    close()  # here, on the engine thread (a conversion drops the shard it was writing)
        except BaseException as e:  # handed to the consumer
            self._items.put((False, e))
        finally:
            self._items.put((True, _DONE))
            self._done.set()


class _EngineThread:
    def __init__(self) -> None:
        self._jobs: queue.Queue[EngineJob] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: list[EngineJob] = []  # submitted and not done (for shutdown)

    def submit(self, job: EngineJob) -> EngineJob:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tqbench-mlx", daemon=True)
                self._thread.start()
                atexit.register(self.shutdown)
            self._pending = [j for j in self._pending if not j.done] + [job]
        self._jobs.put(job)
        return job

    def _loop(self) -> None:
        while True:
            self._jobs.get()._run()

    def shutdown(self, timeout: float = 120.0) -> None:
        """Stop every job and wait (up to `timeout`) until the thread is out of MLX, so the process can exit."""
        with self._lock:
            jobs = list(self._pending)
        for job in jobs:
            job.stop()
        for job in jobs:
            job.wait(timeout)


_engine = _EngineThread()


def run_on_engine(make: Callable[[], Iterable[T]]) -> EngineJob:
    """Queue `make()` (a generator function) on the engine thread: created, iterated and closed there."""
    return _engine.submit(EngineJob(make))

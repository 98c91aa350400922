"""Run an engine generator on a daemon thread, so a cancelled worker (or quitting the app) never waits for it.

A Textual thread worker runs in asyncio's default executor, which the interpreter joins at exit: a worker blocked
inside a long engine step (classifying 500k tensors takes seconds with no event in between) would hold up `q`.
Here the worker only waits on a queue and polls its cancellation; the daemon thread is abandoned when cancelled.
For header reading and other pure-Python work; MLX work needs one long-lived engine thread instead.
"""

from __future__ import annotations

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

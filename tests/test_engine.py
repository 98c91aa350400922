"""The engine thread: jobs run on one long-lived thread, are closed there, keep session state between jobs."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from tqbench.engine import THREAD_NAME, Engine, iterate_in_daemon


@pytest.fixture
def eng():
    e = Engine()
    yield e
    e.stop_all()


def test_jobs_run_on_one_thread_that_outlives_them(eng):
    seen = []

    def job():
        seen.append(threading.current_thread())
        yield threading.current_thread().name

    assert eng.submit(job).result() == [THREAD_NAME]
    assert eng.submit(job).result() == [THREAD_NAME]
    assert seen[0] is seen[1] and seen[0] is not threading.current_thread() and seen[0].is_alive()


def test_lazy_mlx_work_is_evaluated_on_the_engine_thread(eng):
    def job():
        a = mx.arange(10)
        for i in range(3):
            a = a * 2  # lazy until evaluated, on this thread
            mx.eval(a)
            yield a.tolist()

    assert eng.submit(job).result() == [[x * 2 ** (i + 1) for x in range(10)] for i in range(3)]


@pytest.mark.slow
def test_stop_closes_the_generator_on_the_engine_thread(eng):
    gate = threading.Event()
    closed_on = []

    def job():
        try:
            for i in range(1000):
                yield i
                gate.wait(5)
        finally:
            closed_on.append(threading.current_thread().name)

    with eng.submit(job) as j:
        assert next(iter(j)) == 0
    # leaving the block stopped the job and waited for it
    gate.set()
    assert j.done and closed_on == [THREAD_NAME]


def test_an_exception_in_a_job_is_raised_to_the_consumer(eng):
    def job():
        yield 1
        raise ValueError("bad tensor")

    j = eng.submit(job)
    it = iter(j)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad tensor"):
        next(it)
    assert eng.submit(lambda: iter([2])).result() == [2]  # the thread survives


def test_call_returns_a_value_and_raises_errors(eng):
    assert eng.call(lambda: threading.current_thread().name) == THREAD_NAME
    with pytest.raises(KeyError):
        eng.call(lambda: {}["x"])


def test_stop_all_stops_running_and_queued_jobs(eng):
    started = threading.Event()

    def forever():
        started.set()
        while True:
            yield None
            time.sleep(0.01)

    running = eng.submit(forever)
    queued = eng.submit(forever)
    assert started.wait(5) and eng.busy
    eng.stop_all(timeout=5)
    assert running.done and queued.done and not eng.busy


def test_cancelled_consumer_returns_without_waiting(eng):
    gate = threading.Event()

    def slow():
        yield 1
        gate.wait(5)
        yield 2

    j = eng.submit(slow)
    got: list[int] = []
    for x in j.items(cancelled=lambda: bool(got), poll=0.01):
        got.append(x)
    assert got == [1] and j.stopping and not j.done  # returned while the job still waits inside its step
    gate.set()
    assert j.wait(5)


def test_iterate_in_daemon_abandons_a_cancelled_producer():
    gate = threading.Event()
    cancel = threading.Event()

    def slow():
        yield 1
        gate.wait(5)
        yield 2

    out = []
    for x in iterate_in_daemon(slow, cancel.is_set, poll=0.01):
        out.append(x)
        cancel.set()
    gate.set()
    assert out == [1]

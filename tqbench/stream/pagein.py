"""Page-ins: missing experts brought into their pool slots, from the host tier where it holds them (a copy), else
read from disk. Worker threads read into staging buffers and copy into the slots; they only move bytes, and every MLX
call (the GPU prefetch of a written slot included) stays on the engine thread, which decides what goes where.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

import numpy as np

from tqbench.stream.host import HostTier
from tqbench.stream.pool import Pool
from tqbench.stream.stats import StreamStats
from tqbench.stream.store import ExpertStore, aligned_buffer


def read_buffers(workers: int) -> int:
    """Staging buffers for `workers` read threads: two each, so a worker starts its next read while its last one is
    still being copied into a slot (with one each, a layer's fifth miss on four workers waited for a read and a copy).
    The budget counts them: `staging_bytes(...)`."""
    return 2 * max(1, workers)


def staging_bytes(buffer_bytes: int, workers: int) -> int:
    """The budget's staging share: read_buffers(workers) buffers of `buffer_bytes` (ExpertStore.buffer_bytes of the
    largest expert: its bytes, plus 2 * ALIGN for O_DIRECT reads)."""
    return read_buffers(workers) * buffer_bytes


class Pager:
    """The read path's workers and staging buffers: `workers` read threads (at most `reads_in_flight` reads at once,
    0: one per worker), read_buffers(workers) buffers of `buffer_bytes`, and, with a host tier, as many threads for
    its copies. `fanout`: one expert's read is split into several parallel reads. Counts into `stats`."""

    def __init__(self, store: ExpertStore, stats: StreamStats, host: HostTier | None, workers: int,
                 buffer_bytes: int, fanout: bool = False, reads_in_flight: int = 0):
        self.store = store
        self.stats = stats
        self.host = host
        self.workers = workers
        self.fanout = fanout
        self.buffers = [aligned_buffer(buffer_bytes) for _ in range(read_buffers(workers))]
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tqbench-read")
        self._copier = ThreadPoolExecutor(workers, thread_name_prefix="tqbench-host") if host is not None else None
        self._gate = threading.BoundedSemaphore(reads_in_flight) if 0 < reads_in_flight < workers else None

    def page_in(self, layer: int, pool: Pool, missing: list[int], slots: dict[int, int], locked: set, now: int,
                cold: bool = False, timed: bool = True, served: dict[int, str] | None = None) -> int:
        """Bring `missing` experts into slots: from the host tier where it holds them (a copy), else read (in
        parallel, into the staging buffers) and written into the slot as each arrives. The slots are chosen first, in
        expert order (so evictions do not depend on which read finishes first); the experts they held go to the host
        tier, if any. On CUDA the slots' pages start moving to the host once the reads are submitted (asking costs
        ~0.4 ms an expert on the H200: asked before the reads, it delayed them), so the copies land in host memory.
        Fills `slots` (and `served` with "host" for the host tier's); returns the bytes read from disk. `now` and
        `cold`: the cache's clock and SlotCache.place's `cold` (a prefill's experts). `timed`: add where the reads'
        time went to the stats' `miss_*` totals (a preload's page-ins are not misses)."""
        if not missing:
            return 0
        placed = sorted(missing)
        keys = [(layer, e) for e in placed]
        evicted: list = []
        slots.update(zip(placed, pool.cache.place_many(keys, now, locked, cold=cold, evicted=evicted)))
        locked.update(keys)
        host = self.host
        from_host = {e: host.cache.slots[(layer, e)] for e in placed if host is not None and (layer, e) in host}
        out = self.to_host({v: slots[e] for e, v in zip(placed, evicted) if v is not None},
                           {(layer, e) for e in from_host})
        reads = [e for e in placed if e not in from_host]
        clock = _MissClock(time.perf_counter()) if timed and reads else None
        if served is not None:
            served.update((e, "host") for e in from_host)

        def to_host() -> None:  # engine thread, before its first to_gpu: the two prefetches of a slot stay in order
            t = time.perf_counter()
            for e in placed:
                pool.to_host(slots[e])
            if clock is not None:
                clock.to_host += time.perf_counter() - t

        try:
            total = self._read_into(layer, pool, reads, slots=slots, clock=clock, submitted=to_host,
                                    from_host={e: host.slot(i, pool.nbytes) for e, i in from_host.items()},
                                    out={slot: view for slot, (_, view) in out.items()})
            if clock is not None:
                clock.add_to(self.stats, len(reads), time.perf_counter())
        except BaseException:
            for e in placed:  # their data never arrived (or only partly): not resident
                pool.cache.drop((layer, e))
                slots.pop(e, None)
            if host is not None:  # a victim's copy may not have been made: gone, as without a host tier
                host.release([key for key, _ in out.values()])
            raise
        if host is not None:
            host.release([(layer, e) for e in from_host])  # back in a GPU slot: one tier holds an expert
        return total

    def to_host(self, victims: dict, locked: set) -> dict[int, tuple[tuple[int, int], np.ndarray]]:
        """Host slots for experts evicted from GPU slots ({key: the GPU slot it leaves}), none evicting a key in
        `locked`. Returns {GPU slot: (the key, the host slot's bytes to copy it into)}; empty without a host tier."""
        if self.host is None or not victims:
            return {}
        taken = self.host.take(list(victims), locked)
        return {victims[k]: (k, self.host.slot(i, self.store.layers[k[0]].nbytes)) for k, i in taken.items()}

    def _read_into(self, layer: int, pool: Pool, missing: list[int], slots: dict[int, int],
                   clock: _MissClock | None = None, submitted: Callable[[], None] | None = None,
                   from_host: dict[int, np.ndarray] | None = None, out: dict[int, np.ndarray] | None = None) -> int:
        """Reads on the workers into free staging buffers; the worker that ends an expert's last read copies it into
        its slot (so copies run in parallel and overlap the other reads, and no thread hand-off comes between a read
        and its copy). Here, on the engine thread, once an expert's reads and copy are done: the slot's GPU prefetch,
        and its buffer is free again. Returns once every copy is done, so no computation reads the pool while a slot
        is written; when a read fails, the error is re-raised once every read and copy still running has ended
        (nothing writes a buffer or a slot after it), and the expert is never copied. `submitted` is called once,
        after the first reads are submitted. `from_host` ({expert: its host slot's bytes}): experts copied from the
        host tier instead of read, once `submitted` has been called; `out` ({slot: host bytes}): a slot's expert is
        copied there before its new one is copied in."""
        out = out or {}
        host_jobs: list[tuple[int, Future]] = []
        if from_host and not missing:  # else once the first reads are submitted (below)
            host_jobs = self._host_copies(pool, from_host, slots, out, submitted)
            submitted = None
        pending = deque(sorted(missing))
        free = list(self.buffers)
        # Stacked layouts (several ranges per expert, buffered reads): adjacent experts are read as runs, one scatter
        # read per tensor; runs are kept short enough that every worker gets one.
        coalesce = (len(self.store.layers[layer].extents[0]) > 1 and not self.store.direct and not self.fanout)
        longest = max(1, -(-len(missing) // self.workers)) if coalesce else 1
        inflight: dict[tuple[int, ...], tuple[list[np.ndarray], list[Future], list | None]] = {}
        total = 0
        n = self.store.layers[layer].nbytes
        try:
            while pending or inflight:
                while pending and free:
                    run = [pending.popleft()]
                    while pending and len(run) < min(longest, len(free)) and pending[0] == run[-1] + 1:
                        run.append(pending.popleft())
                    bufs = [free.pop() for _ in run]
                    times = None if clock is None else clock.submitted(len(run))
                    copy = _Copy(pool, [(slots[e], buf[self.store.shift(layer, e):], out.get(slots[e]))
                                        for e, buf in zip(run, bufs)])
                    if len(run) > 1:
                        futures = self._go([(self.store.read_run, layer, run, bufs)], times, copy)
                    else:
                        futures = self.submit(layer, run[0], bufs[0], times, copy)
                    inflight[tuple(run)] = (bufs, futures, times)
                if submitted is not None:
                    submitted()
                    submitted = None
                    if from_host:
                        host_jobs = self._host_copies(pool, from_host, slots, out, None)
                # only reads still running: a finished piece of a fanned-out expert must not make this spin
                running = [f for _, fs, _ in inflight.values() for f in fs if not f.done()]
                if running:
                    wait(running, return_when=FIRST_COMPLETED)
                for run in [r for r, (_, fs, _) in inflight.items() if all(f.done() for f in fs)]:
                    bufs, fs, times = inflight.pop(run)
                    done = [f.result() for f in fs]  # re-raises a StoreError from the worker
                    self.stats.reads += sum(reads for reads, _ in done)
                    gpu = sum(pool.to_gpu(slots[e]) for e in run)
                    if clock is not None:
                        clock.finished(times)
                        clock.copy += sum(copied for _, copied in done)
                        clock.to_gpu += gpu
                    total += n * len(run)
                    free.extend(bufs)
            for slot, f in host_jobs:
                self.stats.host_copy_s += f.result()
                self.stats.host_to_gpu_s += pool.to_gpu(slot)
        except BaseException:
            wait([f for _, fs, _ in inflight.values() for f in fs] + [f for _, f in host_jobs])
            raise
        return total

    def _host_copies(self, pool: Pool, from_host: dict[int, np.ndarray], slots: dict[int, int],
                     out: dict[int, np.ndarray], submitted: Callable[[], None] | None) -> list[tuple[int, Future]]:
        """Copy experts from the host tier into their slots (each slot's old expert saved first where `out` says),
        on the host tier's own threads, so they do not queue behind disk reads. Calls `submitted` first."""
        if submitted is not None:
            submitted()
        return [(slots[e], self._copier.submit(pool.move, slots[e], src, out.get(slots[e])))
                for e, src in from_host.items()]

    def submit(self, layer: int, expert: int, buf: np.ndarray, times: list | None = None,
               copy: _Copy | None = None) -> list[Future]:
        """The reads of one expert, on the workers, then `copy` (by the worker that ends the last of them); `times`
        (timing only): each read's [submitted, started, finished] perf_counter times are appended to it (see
        _MissClock)."""
        store = self.store
        if store.direct:
            pieces = store.direct_pieces(layer, expert, self.workers if self.fanout else 1)
            return self._go([(store.read_direct, layer, expert, buf, [piece]) for piece in pieces], times, copy)
        if not self.fanout:
            return self._go([(store.read, layer, expert, buf)], times, copy)
        pieces = store.split(layer, expert, self.workers)
        return self._go([(read_pieces, store, piece, buf) for piece in pieces], times, copy)

    def _go(self, reads: list[tuple], times: list | None, copy: _Copy | None = None) -> list[Future]:
        """Submit `reads` ((fn, *args) each); each future gives (reads made, seconds spent copying)."""
        if copy is not None:
            copy.left = len(reads)
        out = []
        for fn, *args in reads:
            t = None
            if times is not None:
                t = [time.perf_counter()]
                times.append(t)
            out.append(self._executor.submit(_work, t, copy, self._gate, fn, *args))
        return out

    def submit_move(self, pool: Pool, slot: int, source: np.ndarray, out: np.ndarray | None) -> Future:
        """Pool.move on a read worker."""
        return self._executor.submit(pool.move, slot, source, out)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)


class _Copy:
    """The copy of a read expert (or of a run's experts) from its staging buffer(s) into its slot(s), made by the
    worker that ends the last of its `left` reads (numpy only: Pool.copy_in). A read that fails does not count down,
    so an expert with a failed read is never copied."""

    __slots__ = ("pool", "into", "left", "lock")

    def __init__(self, pool: Pool, into: list[tuple[int, np.ndarray, np.ndarray | None]]):
        self.pool = pool
        self.into = into  # (slot, the expert's bytes in its staging buffer, where the slot's old expert goes or None)
        self.left = 0
        self.lock = threading.Lock()

    def after_read(self) -> float:
        with self.lock:
            self.left -= 1
            if self.left:
                return 0.0
        return sum(self.pool.move(slot, buf, out) for slot, buf, out in self.into)


def _work(t: list | None, copy: _Copy | None, gate: threading.BoundedSemaphore | None, fn, *args) -> tuple[int, float]:
    """A worker's read (once `gate`, if any, lets it: StreamConfig.reads_in_flight), then, if it ended the expert's
    last read, its copy into the slot. `t` (timing only): the read's start and end are appended to it (waiting at the
    gate counts as queueing; the engine thread reads them once the future is done; only bytes and clocks here).
    Returns (reads made, seconds spent copying)."""
    if gate is not None:
        gate.acquire()
    try:
        if t is not None:
            t.append(time.perf_counter())
        reads = fn(*args)
        if t is not None:
            t.append(time.perf_counter())
    finally:
        if gate is not None:
            gate.release()
    return reads, (copy.after_read() if copy is not None else 0.0)


class _MissClock:
    """Where one demand page-in's time went (engine thread only; the workers only fill their reads' time lists and
    return their copies' seconds). Per read: `queue` (submitted to started on a worker), `read` (the read itself),
    `buffer_wait` (the page-in's first submission to this one: an expert waits for a free staging buffer). Per expert:
    `copy` (into its slot, by the worker that ended its last read: copies run in parallel with each other and with
    the other reads), `to_gpu` and `to_host` (the prefetch calls, on the engine thread; to_host right after the first
    submissions). The page-in's wall time: `before` (entry to the first submission: slot choice), `reading` (first
    submission to the last read's end), `after` (the last read's end to the return: the copies still running,
    to_gpu)."""

    __slots__ = ("start", "first", "last_end", "queue", "read", "buffer_wait", "copy", "to_gpu", "to_host")

    def __init__(self, start: float):
        self.start = start
        self.first = self.last_end = None
        self.queue = self.read = self.buffer_wait = self.copy = self.to_gpu = self.to_host = 0.0

    def submitted(self, experts: int) -> list:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.buffer_wait += (now - self.first) * experts
        return []

    def finished(self, times: list) -> None:
        for submitted, started, ended in times:
            self.queue += started - submitted
            self.read += ended - started
            self.last_end = ended if self.last_end is None else max(self.last_end, ended)

    def add_to(self, s: StreamStats, experts: int, end: float) -> None:
        first = self.first if self.first is not None else end
        last = self.last_end if self.last_end is not None else first
        s.miss_timed += experts
        s.miss_queue_s += self.queue
        s.miss_read_s += self.read
        s.miss_buffer_wait_s += self.buffer_wait
        s.miss_copy_s += self.copy
        s.miss_to_gpu_s += self.to_gpu
        s.miss_to_host_s += self.to_host
        s.miss_before_reads_s += first - self.start
        s.miss_reading_s += last - first
        s.miss_after_reads_s += end - last


def read_pieces(store: ExpertStore, piece: list[tuple[int, int, int, int]], buf: np.ndarray) -> int:
    for file, offset, into, length in piece:
        store.read_range(file, offset, buf, into, length)
    return len(piece)

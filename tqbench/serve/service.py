"""Serving one opened chat to many clients: what a server does beside HTTP, as plain Python any face drives.

- Admission: one request runs on the engine thread; up to `max_queue` more wait, in arrival order (the engine's job
  queue is FIFO); one more is refused (`QueueFull`, HTTP 429 with a Retry-After from the recent request times).
- Each request is a `ChatSession.complete` job. The caller says how to tell that its client left (`gone`); the job
  is then stopped after the token in progress, and the next request starts at once.
- Counting: requests by outcome, tokens, time to first token, decode rate, and the expert cache's totals from the
  engine's StreamReport after each request, all read as one frozen `ServeStatus`.
- Watching: `watch()` hands a face (the TUI, the server's /tqbench/events) every page-in, request and status as they
  happen, through a bounded queue per watcher (a slow watcher loses events, never slows a request).
"""

from __future__ import annotations

import hmac
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from tqbench.chat.events import (CompletionDelta, CompletionDone, MlxWarmedUp, MlxWarmup, ModelLoaded, PageIn,
                                 PrefillProgress, ReplyStarted, StreamReport)
from tqbench.serve.openai import ApiError, ApiRequest

MAX_QUEUE = 16  # requests waiting behind the running one
MAX_BODY_BYTES = 4 << 20
WATCH_QUEUE = 4096  # events a watcher may fall behind by before it loses some
RECENT = 32  # requests the rates and Retry-After are taken over


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = MAX_QUEUE
    max_body_bytes: int = MAX_BODY_BYTES
    max_requests: int = 0  # stop after this many completions (0: serve until stopped)


@dataclass(frozen=True, kw_only=True)
class RequestDone:
    """One completion request's end, as the server answered it."""

    id: str
    kind: str  # "chat" or "text"
    outcome: str  # "ok", "cancelled" (the client left) or "error"
    finish_reason: str
    prompt_tokens: int  # processed
    cached_tokens: int  # reused from the prompt cache
    completion_tokens: int
    queued_s: float  # waiting for the engine
    ttft_s: float  # from arrival to the first token (queue and prefill included)
    decode_tps: float
    seconds: float  # from arrival to the end
    prefill_s: float = 0.0  # processing the prompt, to the first token


@dataclass(frozen=True, kw_only=True)
class ServeStatus:
    """Everything a face shows about a server, at one moment."""

    model: str
    url: str
    uptime_s: float
    requests: int  # completions ended (ok, cancelled or error)
    ok: int
    cancelled: int
    failed: int  # errors during a completion
    rejected: int  # 429: the queue was full
    refused: int  # other 4xx: bad requests, auth, unknown model, too large
    running: int  # 0 or 1
    queued: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decode_tps: float  # over the recent requests' decode time
    ttft_s: float  # the last request's
    stream: StreamReport | None  # the expert cache's totals after the last request (None: resident experts)
    layers: tuple[tuple[int, int], ...] = ()  # (MoE layer, routed experts) of every streamed layer: the map's shape
    prefill_s: float = 0.0  # seconds spent processing prompts, all requests
    prefilling: PrefillProgress | None = None  # the running request's prompt, while it is processed
    tool_syntax: str = "sample"  # the guard every request's tool calls get (`--tool-syntax`: sample, greedy, schema)

    @property
    def hit_rate(self) -> float | None:
        return self.stream.hit_rate if self.stream is not None else None


class QueueFull(ApiError):
    def __init__(self, retry_after: int) -> None:
        super().__init__(429, f"the server is busy: {retry_after} s until a place in its queue is likely",
                         type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after)})


@dataclass(kw_only=True)
class _Counts:
    ok: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # RequestDone


class Service:
    """Requests for one opened ChatSession. Every method may be called from any thread."""

    def __init__(self, session, loaded: ModelLoaded, options: ServeOptions = ServeOptions()) -> None:
        self.session = session
        self.loaded = loaded
        self.options = options
        self.model_id = Path(loaded.path).name
        self.url = ""  # set by the HTTP server once it listens
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._admitted = 0  # running or waiting
        self._stream: StreamReport | None = None
        self._t0 = time.monotonic()
        self._watchers: list[queue.Queue] = []
        self._ended = threading.Event()  # max_requests reached
        self._stop = threading.Event()  # the server is closing: running requests stop
        self.warmup = None  # MLX's warm-up in the first request (tqbench.events.MlxWarmup, then MlxWarmedUp)
        self._prefill: PrefillProgress | None = None  # the running request's prompt, while it is processed

    # ---- requests -------------------------------------------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        """An `Authorization: Bearer KEY` header against --api-key (always true without one)."""
        key = self.options.api_key
        if not key:
            return True
        given = (header or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), key.encode())

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model_id, str(self.loaded.path)):
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_id}`", "model",
                           code="model_not_found")

    def refused(self) -> None:
        """Count a request answered with a 4xx before it ran."""
        with self._lock:
            self._counts.refused += 1

    def run(self, request: ApiRequest, rid: str, gone: Callable[[], bool]) -> Iterator:
        """The request's events (ReplyStarted, PageIn..., CompletionDelta..., CompletionDone, StreamReport), iterated
        on the caller's thread. Raises QueueFull before anything runs when the queue is full. Once `gone()` is true
        the job stops after the token in progress and the iteration ends (a RequestDone is still counted)."""
        self.check_model(request.model)
        arrived = time.monotonic()
        with self._lock:
            if self._admitted > self.options.max_queue:
                self._counts.rejected += 1
                raise QueueFull(self._retry_after())
            self._admitted += 1
        started = first = None
        done: CompletionDone | None = None
        ended: list = []  # the engine's summary of the reply, also of one stopped early
        outcome = "error"
        try:
            with self.session.complete(request.completion, ended.append) as job:
                for ev in job.items(cancelled=lambda: self._stop.is_set() or gone()):
                    if started is None:
                        started = time.monotonic()
                    match ev:
                        case CompletionDelta():
                            first = first or time.monotonic()
                        case CompletionDone():
                            done = ev
                        case StreamReport():
                            self._stream = ev
                        case MlxWarmup() | MlxWarmedUp():
                            self.warmup = ev
                        case PrefillProgress():
                            self._prefill = ev if ev.done < ev.total else None
                        case ReplyStarted() | PageIn():
                            pass
                    self._publish(ev)
                    yield ev
            outcome = "ok" if done is not None and done.finish_reason != "cancelled" else "cancelled"
        finally:
            end = time.monotonic()
            self._prefill = None
            with self._lock:
                self._admitted -= 1
            rec = self._count(request, rid, outcome, r=done.reply if done else (ended[0] if ended else None),
                              finish=done.finish_reason if done else "cancelled", arrived=arrived,
                              started=started or end, first=first or end, end=end)
            status = self.status()
            self._publish(rec)
            self._publish(status)
            if self.options.max_requests and status.requests >= self.options.max_requests:
                self._ended.set()

    def _count(self, request: ApiRequest, rid: str, outcome: str, r, finish: str, arrived: float, started: float,
               first: float, end: float) -> RequestDone:
        rec = RequestDone(id=rid, kind=request.kind, outcome=outcome, finish_reason=finish,
                          prompt_tokens=r.prompt_tokens if r else 0, cached_tokens=r.cached_tokens if r else 0,
                          completion_tokens=r.generated_tokens if r else 0, queued_s=started - arrived,
                          ttft_s=first - arrived, decode_tps=r.decode_tps if r else 0.0, seconds=end - arrived,
                          prefill_s=r.prefill_s if r else 0.0)
        with self._lock:
            c = self._counts
            name = {"ok": "ok", "cancelled": "cancelled", "error": "failed"}[outcome]
            setattr(c, name, getattr(c, name) + 1)
            c.prompt_tokens += rec.prompt_tokens
            c.cached_tokens += rec.cached_tokens
            c.completion_tokens += rec.completion_tokens
            c.prefill_s += rec.prefill_s
            if rec.completion_tokens:
                c.ttft_s = rec.ttft_s
            c.recent.append(rec)
        return rec

    def _retry_after(self) -> int:
        """Seconds until the queue likely has room: the recent mean request time, times the requests ahead."""
        recent = [r.seconds - r.queued_s for r in self._counts.recent] or [1.0]
        return max(1, math.ceil(sum(recent) / len(recent) * max(1, self._admitted - self.options.max_queue)))

    # ---- what faces read ------------------------------------------------------------------------------------------

    def status(self) -> ServeStatus:
        with self._lock:
            c = self._counts
            tokens = sum(max(0, r.completion_tokens - 1) for r in c.recent)
            decode_s = sum((r.completion_tokens - 1) / r.decode_tps for r in c.recent
                           if r.decode_tps > 0 and r.completion_tokens > 1)
            running = min(1, self._admitted)
            return ServeStatus(model=self.model_id, url=self.url, uptime_s=time.monotonic() - self._t0,
                               requests=c.ok + c.cancelled + c.failed, ok=c.ok, cancelled=c.cancelled, failed=c.failed,
                               rejected=c.rejected, refused=c.refused, running=running, queued=self._admitted - running,
                               prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
                               completion_tokens=c.completion_tokens,
                               decode_tps=tokens / decode_s if decode_s > 0 else 0.0, ttft_s=c.ttft_s,
                               stream=self._stream,
                               layers=self.loaded.stream.layers if self.loaded.stream is not None else (),
                               prefill_s=c.prefill_s, prefilling=self._prefill,
                               tool_syntax=self.loaded.sampling.tool_syntax)

    def watch(self) -> Watcher:
        """A live feed of this server's events (PageIn, RequestDone, ServeStatus); close it when done."""
        w = Watcher(self)
        with self._lock:
            self._watchers.append(w.queue)
        return w

    def stop(self) -> None:
        """Stop every running and waiting request after its current token (the server is closing)."""
        self._stop.set()

    @property
    def warming_up(self) -> bool:
        """MLX is compiling its kernels in the first request (its first token has not come yet)."""
        return isinstance(self.warmup, MlxWarmup)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """True once max_requests completions have ended."""
        return self._ended.wait(timeout)

    def _publish(self, ev) -> None:
        if not isinstance(ev, (PageIn, RequestDone, ServeStatus)):
            return
        with self._lock:
            watchers = list(self._watchers)
        for q in watchers:
            try:
                q.put_nowait(ev)
            except queue.Full:  # a watcher this far behind loses events rather than slow a request
                pass

    def _unwatch(self, q: queue.Queue) -> None:
        with self._lock:
            if q in self._watchers:
                self._watchers.remove(q)


class Watcher:
    def __init__(self, service: Service) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=WATCH_QUEUE)
        self._service = service

    def get(self, timeout: float) -> list:
        """The events since the last call (waits up to `timeout` for the first)."""
        try:
            out = [self.queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._service._unwatch(self.queue)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

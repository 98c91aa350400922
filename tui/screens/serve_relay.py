"""What the Serve screen's thread workers do: read a server's live feed and post it as ServeFeed batches (at most every
FEED_INTERVAL, never one message per page-in), from the screen's own Service (its watcher) or from a server another
process runs (tqbench.serve.client.watch). Plain functions of (post, source, feed_id, cancelled), run off the UI
thread; they never touch a widget and never run MLX (the Service's requests run on the engine thread)."""

from __future__ import annotations

import time
from typing import Callable

from tqbench.serve import report
from tui.messages import ServeFeed, ServeFeedEnded
from tui.screens.chat_relay import Post, one_line

FEED_INTERVAL = 0.1  # seconds between batches while events come
STATUS_INTERVAL = 0.5  # an idle server's status (running, queued) is posted this often


def batch(feed_id: int, events: list, status=None) -> ServeFeed:
    """The events (PageIn, RequestDone, ServeStatus) as one message; the status given, else the newest among them."""
    from tqbench.chat.events import PageIn
    from tqbench.serve.service import RequestDone, ServeStatus

    statuses = [ev for ev in events if isinstance(ev, ServeStatus)]
    return ServeFeed(feed_id=feed_id, page_ins=tuple(ev for ev in events if isinstance(ev, PageIn)),
                     requests=tuple(ev for ev in events if isinstance(ev, RequestDone)),
                     status=status if status is not None else (statuses[-1] if statuses else None))


def relay_service(post: Post, service, feed_id: int, cancelled: Callable[[], bool]) -> None:
    """The screen's own server (tqbench.serve.service.Service): its watcher's events with its status, until
    cancelled."""
    with service.watch() as watcher:
        post(batch(feed_id, [], service.status()))
        pending: list = []
        posted = time.monotonic()
        while not cancelled():
            pending += watcher.get(FEED_INTERVAL)
            waited = time.monotonic() - posted
            if pending and waited >= FEED_INTERVAL or waited >= STATUS_INTERVAL:
                post(batch(feed_id, pending, service.status()))
                pending, posted = [], time.monotonic()


def relay_attach(post: Post, url: str, api_key: str | None, feed_id: int, cancelled: Callable[[], bool]) -> None:
    """A server another process runs, at `url`: its feed's events until cancelled, then ServeFeedEnded (one line)
    when the server is unreachable, refuses the key, or stops."""
    from tqbench.serve import client
    from tqbench.serve.service import RequestDone, ServeStatus

    pending: list = []
    posted = 0.0
    try:
        for ev in client.watch(url, api_key, cancelled):
            pending.append(ev)
            # a request or a status ends a burst: shown at once; page-ins wait for the interval
            if isinstance(ev, (RequestDone, ServeStatus)) or time.monotonic() - posted >= FEED_INTERVAL:
                post(batch(feed_id, pending))
                pending, posted = [], time.monotonic()
    except Exception as e:  # TqbenchError (unreachable, 401, the feed broke) or a bug: one line either way
        ended = one_line(e)
    else:
        ended = None if cancelled() else report.feed_ended_line(url)
    if pending:
        post(batch(feed_id, pending))
    if ended is not None:
        post(ServeFeedEnded(feed_id=feed_id, message=ended))

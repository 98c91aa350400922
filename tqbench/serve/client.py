"""Attaching to a running `tqbench serve` from another process: its live feed (GET /tqbench/events, server-sent
events) read with the standard library and turned back into the Service's records, for a face that shows a server it
did not start (the TUI's Serve screen)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Callable, Iterator

from tqbench.chat.events import PageIn
from tqbench.errors import TqbenchError
from tqbench.serve.service import RequestDone, ServeStatus
from tqbench.serve.wire import decode_event, decode_status

TIMEOUT_S = 5.0


def _open(url: str, path: str, api_key: str | None, timeout: float):
    base = url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = ""
        try:
            detail = json.loads(e.read()).get("error", {}).get("message", "")
        except (ValueError, AttributeError, OSError):
            pass
        raise TqbenchError(f"{base}: HTTP {e.code}{': ' + detail if detail else ''}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TqbenchError(f"{base}: cannot reach a tqbench server ({reason})") from None


def status(url: str, api_key: str | None = None) -> ServeStatus:
    """A running server's status (GET /tqbench/status)."""
    with _open(url, "/tqbench/status", api_key, TIMEOUT_S) as r:
        try:
            return decode_status(json.loads(r.read()))
        except (ValueError, KeyError, TypeError) as e:
            raise TqbenchError(f"{url}: not a tqbench server's status ({e})") from None


def watch(url: str, api_key: str | None = None, cancelled: Callable[[], bool] = lambda: False
          ) -> Iterator[PageIn | RequestDone | ServeStatus]:
    """A running server's events as they happen, until `cancelled()` (checked at each event and at least every
    second: the server sends its status that often while idle) or the server goes away (TqbenchError)."""
    with _open(url, "/tqbench/events", api_key, TIMEOUT_S) as r:
        try:
            for raw in r:
                if cancelled():
                    return
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                ev = decode_event(json.loads(line[6:]))
                if ev is not None:
                    yield ev
        except (OSError, ValueError) as e:
            raise TqbenchError(f"{url}: the server's feed ended ({e})") from None

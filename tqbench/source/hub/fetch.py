"""Source shards for a conversion that streams its source from the hub: downloaded in the order the conversion first
reads them, one after another on a helper thread (bytes only, no MLX), while the conversion works on what is there.

At most `window` downloaded shards are on disk at once (the one being converted and the next): a download starts
only when that leaves room, or when the conversion is already waiting for it. A shard the conversion is done with is
removed by the caller (`remove`), after it has made the converted bytes durable. Shards that were in the Hugging
Face cache before tqbench asked for them are read in place and never removed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tqbench.events import SourceProgress, SourceRemoved
from tqbench.source.hub.client import Snapshot, download

from tqbench.source.hub.disk import WINDOW
from tqbench.testhooks import kill_point


class _Closed(Exception):
    """Raised from the download's progress hook to stop it when the conversion stops (the partial blob stays and a
    later run resumes it)."""


class ShardFetcher:
    def __init__(self, snap: Snapshot, order: list[str], ours: set[str], on_disk: set[str], window: int = WINDOW):
        """`order`: the shards still to be read, in the order the conversion first needs them. `ours`: the shards
        tqbench downloads (or downloaded in an earlier run); the others are on disk already. `on_disk`: those of ours
        already complete in the cache (an interrupted run's)."""
        self.snap, self.window = snap, window
        self.ours = set(ours)
        self.ready: set[str] = {f for f in order if f not in ours or f in on_disk}
        self.queue = [f for f in order if f not in self.ready]
        self.live = {f for f in order if f in ours and f in on_disk}  # ours, on disk or arriving
        self.to_download = sum(snap.size(f) or 0 for f in self.queue)
        self.downloaded = 0
        self.current = ""
        self.wanted: set[str] = set()
        self.error: BaseException | None = None
        self.closed = False
        self.t0 = time.monotonic()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="tqbench-hub-download", daemon=True)
        self.thread.start()

    # --- the conversion's side ---------------------------------------------------------------------------------

    def wait(self, files: set[str], seconds: float = 0.25) -> SourceProgress | None:
        """None when every file is on disk; else waits up to `seconds` for them and returns the progress to show."""
        with self.cond:
            if files <= self.ready:
                return None
            if self.error is not None:
                raise self.error
            self.wanted |= files - self.ready
            self.cond.notify_all()
            self.cond.wait(seconds)
            if self.error is not None:
                raise self.error
            return None if files <= self.ready else self._progress(True)

    def on_disk(self, files: set[str]) -> bool:
        """Whether every file is downloaded (or was there), without asking for any."""
        with self.cond:
            return files <= self.ready

    def progress(self) -> SourceProgress:
        with self.cond:
            return self._progress(False)

    def remove(self, file: str, local: Path) -> SourceRemoved | None:
        """Delete a shard the conversion is done with, when tqbench downloaded it (the cache's link and blob)."""
        if file not in self.ours:
            return None
        size = self.snap.size(file) or 0
        blob = local.resolve() if local.is_symlink() else None
        local.unlink(missing_ok=True)
        if blob is not None:
            blob.unlink(missing_ok=True)
        with self.cond:
            self.live.discard(file)
            self.ready.discard(file)
            self.cond.notify_all()
            return SourceRemoved(file=file, bytes=size, on_disk=self._on_disk())

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()

    # --- the download thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for file in self.queue:
                with self.cond:
                    while not self.closed and len(self.live) >= self.window and file not in self.wanted:
                        self.cond.wait()
                    if self.closed:
                        return
                    self.live.add(file)
                    self.current = file
                download(self.snap, file, self._count)
                with self.cond:
                    self.ready.add(file)
                    self.current = ""
                    self.cond.notify_all()
        except _Closed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the conversion's thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _count(self, n: int) -> None:
        with self.cond:
            if self.closed:
                raise _Closed
            self.downloaded += n
        kill_point("download")

    def _on_disk(self) -> int:
        return sum(self.snap.size(f) or 0 for f in self.live)

    def _progress(self, waiting: bool) -> SourceProgress:
        elapsed = time.monotonic() - self.t0
        return SourceProgress(file=self.current, downloaded=self.downloaded, to_download=self.to_download,
                              rate=self.downloaded / elapsed if elapsed > 0 else 0.0, on_disk=self._on_disk(),
                              waiting=waiting)

"""Learned profiles in a diskcache store under the user cache directory (`$TQBENCH_CACHE_DIR/profiles`, or a given
directory), one entry per model fingerprint, stored as JSON text (never pickles: a store entry is data, not code).

Every update is one read-modify-write inside a diskcache transaction (SQLite, locked across processes), so two
sessions on one model lose no counts. A read takes no lock (SQLite gives it the entry as of one save), except when it
finds no entry: diskcache keeps a large entry (over 32 KB: any real model's) in a file of its own and deletes the old
file once a save has replaced it, so a read between the two finds the entry gone; that read is made again under the
lock, which no save holds then. A corrupt or foreign entry reads as empty, with one warning line."""

from __future__ import annotations

import json
import sqlite3
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tqbench.paths import cache_dir
from tqbench.profile.fingerprint import Geometry
from tqbench.profile.profile import DECAY, Profile, ProfileError, check_fits, from_dict


def default_directory() -> Path:
    return cache_dir() / "profiles"


class ProfileStore:
    def __init__(self, directory: str | Path | None = None):
        import diskcache

        self.directory = Path(directory) if directory is not None else default_directory()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._cache = diskcache.Cache(str(self.directory))
        except (OSError, sqlite3.Error) as e:  # not a directory, not writable, not a SQLite database
            raise ProfileError(f"the profile store cannot be opened ({e})", self.directory) from None
        self.warnings: list[str] = []

    def load(self, fp: str, geo: Geometry) -> Profile:
        from diskcache import Timeout

        where = f"{self.directory} [{fp}]"
        try:
            raw = self._cache.get(fp)
            if raw is None:  # no entry, or a save replaced its file under this read
                with self._cache.transact():
                    raw = self._cache.get(fp)
            if raw is None:
                return Profile.empty(fp, geo)
            p = from_dict(json.loads(raw) if isinstance(raw, (str, bytes)) else raw, where)
            check_fits(p, fp, geo, where)
            return p
        except (sqlite3.Error, Timeout):
            raise  # the database itself (locked past its timeout, unreadable): never mistaken for an empty entry
        except Exception as e:  # noqa: BLE001 - bad JSON, another schema, a pickle of a class that is gone: all empty
            line = f"tqbench: warning: the learned profile is unreadable and is ignored ({e})"
            if line not in self.warnings:  # once, though a session reads the entry again at its first save
                self.warnings.append(line)
                print(line, file=sys.stderr)
            return Profile.empty(fp, geo)

    def commit(self, delta: Profile, first: bool) -> Profile:
        """Add a session's new counts; its first commit decays what earlier sessions stored (DECAY)."""
        with self._cache.transact():
            cur = self.load(delta.fingerprint, delta.geometry)
            if first:
                cur = cur.scaled(DECAY)
                cur.sessions += 1
            cur.add(delta)
            self._cache.set(delta.fingerprint, cur.to_json())
        return cur

    def put(self, p: Profile) -> None:
        """Replace the entry (import)."""
        self._cache.set(p.fingerprint, p.to_json())

    def reset(self, fp: str) -> bool:
        return bool(self._cache.delete(fp))

    def close(self) -> None:
        self._cache.close()


@contextmanager
def opened(store: ProfileStore | None) -> Iterator[ProfileStore]:
    """`store` as it is, or the user's store opened for the call and closed after it: the faces never open one."""
    if store is not None:
        yield store
        return
    own = ProfileStore()
    try:
        yield own
    finally:
        own.close()

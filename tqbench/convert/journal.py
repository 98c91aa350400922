"""The conversion journal: which output shards are finished (size and checksum), so an interrupted run resumes.

It lives in `<dest>/.tqbench-convert.json` and is replaced atomically after every shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqbench.atomic import write_json

JOURNAL = ".tqbench-convert.json"


@dataclass(kw_only=True)
class Journal:
    path: Path
    source: str  # source fingerprint
    plan: str  # plan fingerprint (recipe + every output tensor + shard split)
    recipe: str
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)  # file -> {"bytes", "sha256", errors}
    copied: list[str] = field(default_factory=list)  # files copied from the source (tokenizer, chat template)
    # A source streamed from the hub: {"repo", "revision", "commit"}; the source shards tqbench downloaded (removed
    # once converted); and the output shard being written when its source went away: {"file", "mark", "units",
    # "errors", "layers"}, so a rerun continues that shard instead of needing the removed source again.
    origin: dict[str, str] | None = None
    downloaded: list[str] = field(default_factory=list)
    partial: dict[str, Any] | None = None

    @classmethod
    def load(cls, dest: Path) -> Journal | None:
        path = Path(dest) / JOURNAL
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            return cls(path=path, source=d["source"], plan=d["plan"], recipe=d["recipe"], shards=dict(d["shards"]),
                       copied=list(d.get("copied", [])), origin=d.get("origin"),
                       downloaded=list(d.get("downloaded", [])), partial=d.get("partial"))
        except (ValueError, KeyError, TypeError):
            return None  # a journal we cannot read is no journal: the shards are redone

    def save(self) -> None:
        doc = {"source": self.source, "plan": self.plan, "recipe": self.recipe, "shards": self.shards,
               "copied": self.copied}
        if self.origin is not None:
            doc |= {"origin": self.origin, "downloaded": self.downloaded, "partial": self.partial}
        write_json(self.path, doc)

    def finished(self, dest: Path, file: str) -> bool:
        """The shard is recorded and on disk with its recorded size."""
        rec = self.shards.get(file)
        p = Path(dest) / file
        return rec is not None and p.is_file() and p.stat().st_size == rec["bytes"]

    def record(self, file: str, nbytes: int, sha256: str, errors: dict[str, list[float]],
               layers: dict[str, list[float]] | None = None) -> None:
        """A finished shard with its size, checksum, per-module error aggregates [count, sum, max] and per-layer
        aggregates of its units' errors (key: the layer number, or "" outside the layers)."""
        self.shards[file] = {"bytes": nbytes, "sha256": sha256, "errors": errors, "layers": layers or {}}
        self.partial = None
        self.save()

"""Naming a hub checkpoint: `owner/name`, optionally `@revision` (a branch, tag or commit)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.][\w./-]*))?")


@dataclass(frozen=True, kw_only=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the repository's default branch

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def hub_ref(source: str | Path) -> HubRef | None:
    """The hub repository `source` names, or None when it is a local path (one that exists, or one that cannot be a
    repo id: absolute, `./x`, `~/x`, more than one slash)."""
    text = str(source)
    if Path(text).expanduser().exists():
        return None
    m = _REF.fullmatch(text)
    return HubRef(repo_id=m["repo"], revision=m["rev"]) if m else None

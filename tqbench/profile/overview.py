"""What `tqbench profile show` (and the TUI's Profile screen) reports about a model's profiles: the profile shown, where
it comes from, its summary, and what a chat without --profile starts from; and a stamp of what it was read from, which
`profile_stamp` reads again cheaply, so a face that keeps an overview on screen knows when it is out of date."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from tqbench.profile.choose import choose, identify, read_file, read_profile
from tqbench.profile.profile import MATURE, Profile
from tqbench.errors import TqbenchError
from tqbench.profile.profile import ProfileError
from tqbench.profile.store import ProfileStore, opened
from tqbench.profile.summary import ProfileSummary, summary


@dataclass(frozen=True, kw_only=True)
class ChatStart:
    """The profile a chat without --profile starts from."""

    source: str  # "learned", "shipped", "none"
    where: str | None  # the store or file it comes from

    def to_dict(self) -> dict:
        return {"source": self.source, "where": self.where}


@dataclass(frozen=True, kw_only=True)
class ProfileStamp:
    """What an overview was read from, as far as it changes under a face: the model's learned profile (routings,
    sessions; None without a model) and the profile file shown (size, modification time; None without one, or when it
    cannot be read)."""

    learned: tuple[float, int] | None
    file: tuple[int, int] | None


@dataclass(frozen=True, kw_only=True)
class Overview:
    model: str | None  # None: a profile file shown on its own
    source: str  # of the profile shown: "file", "learned", "shipped", "none"
    where: str | None  # the file or store it comes from
    chat: ChatStart | None  # None without a model
    mature_at: int  # routings before a learned profile is used over a shipped one
    warnings: tuple[str, ...]  # e.g. an unreadable store entry
    summary: ProfileSummary  # of the profile shown (an empty one when there is none)
    stamp: ProfileStamp  # read before the profiles themselves: a change while they were read shows as a newer stamp

    def to_dict(self) -> dict:
        """`tqbench profile show --json`: these keys, then the summary's."""
        return {"model": self.model, "source": self.source, "where": self.where,
                "chat": None if self.chat is None else self.chat.to_dict(), "mature_at": self.mature_at,
                "warnings": list(self.warnings), **self.summary.to_dict()}


def overview(model: str | Path, store: ProfileStore | None = None, file: str | Path | None = None, force: bool = False,
             top: int = 8) -> Overview:
    """What `tqbench profile show` reports for a model: the profile shown (`file` if given, else the learned one if
    it has any routings, else what a chat would start from), and what a chat without --profile starts from."""
    return overview_profile(model, store, file, force, top)[0]


def overview_profile(model: str | Path, store: ProfileStore | None = None, file: str | Path | None = None,
                     force: bool = False, top: int = 8) -> tuple[Overview, Profile]:
    """`overview`, and the profile it describes (an empty one when there is none). `store` None: the user's."""
    with opened(store) as store:
        return _overview_profile(model, store, file, force, top)


def _overview_profile(model: str | Path, store: ProfileStore, file: str | Path | None, force: bool,
                      top: int) -> tuple[Overview, Profile]:
    fp, geo = identify(model)
    file_stamp = None if file is None else _file_stamp(file)
    learned = store.load(fp, geo)
    stamp = ProfileStamp(learned=(learned.routings, learned.sessions), file=file_stamp)
    chat = choose(model, store=store)
    if file is not None:
        p, source, where = read_file(file, fp, geo, force), "file", str(file)
    else:
        if learned.routings > 0:
            p, source, where = learned, "learned", str(store.directory)
        else:
            p, source, where = chat.profile, chat.source, chat.where
    if p is None:
        p = Profile.empty(fp, geo)
    return Overview(model=str(model), source=source, where=where, chat=ChatStart(source=chat.source, where=chat.where),
                    mature_at=MATURE, warnings=tuple(store.warnings), summary=summary(p, top), stamp=stamp), p


def overview_file(file: str | Path, top: int = 8) -> tuple[Overview, Profile]:
    """A profile file of ours on its own, no model to check it against: `overview`'s record (model and chat None)
    and the profile."""
    stamp = ProfileStamp(learned=None, file=_file_stamp(file))
    p = read_profile(file)
    return Overview(model=None, source="file", where=str(file), chat=None, mature_at=MATURE, warnings=(),
                    summary=summary(p, top), stamp=stamp), p


def profile_view(model: str | Path | None, file: str | Path | None, top: int = 8,
                 store: ProfileStore | None = None) -> tuple[Overview, Profile] | None:
    """What the Profile screen shows: the model's overview (`file` checked against it), or `file` on its own when
    there is no model, or when the file is another model's (then a warning says so and the overview's model is
    None). None when there is neither."""
    if model is None:
        return overview_file(file, top) if file is not None else None
    try:
        return overview_profile(model, store, file, top=top)
    except ProfileError as e:
        if file is None:
            raise
        try:
            shown, p = overview_file(file, top)
        except TqbenchError:
            raise e from None
        return replace(shown, warnings=(*shown.warnings, f"not for this model ({e}): shown on its own")), p


def profile_stamp(ov: Overview, store: ProfileStore | None = None) -> ProfileStamp:
    """`ov.stamp` read again, cheaply (the model's learned entry in the store and the file's metadata; no model file
    is read): when it differs from `ov.stamp`, a chat session learned or the file changed, and `ov` is out of date.
    `store` None: the user's."""
    learned = None
    if ov.model is not None:
        with opened(store) as store:
            p = store.load(ov.summary.fingerprint, ov.summary.geometry)
        learned = (p.routings, p.sessions)
    return ProfileStamp(learned=learned, file=_file_stamp(ov.where) if ov.source == "file" else None)


def _file_stamp(file: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns

"""Whether an output directory or file can be written at all, checked before any work by everything that writes one
(a conversion, the demo, a profile export or merge, chat's statistics): the nearest path that exists must be a
directory that lets us create things in it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from tqbench.errors import TqbenchError


class OutputError(TqbenchError):
    """An output directory, output file or shard size that cannot be used."""


# Why a directory cannot be made in a directory that exists, by the errno of trying.
_CANNOT = {errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "read-only file system",
           errno.ENOENT: "the file system does not allow it"}  # /proc: the directory exists, what is made in it not


def check_output_dir(dest: Path) -> None:
    """`dest` is an output directory that can be made (with its missing parents) or written into. OutputError (one
    line naming `dest`) when it, or the nearest path above it that exists, is not a directory, or when that directory
    does not let us write into it."""
    dest = Path(dest)
    existing = _nearest_existing(dest)
    where = "" if existing == dest else f"{existing} "
    if not existing.is_dir():
        raise OutputError(f"{where}{_not_a_directory(existing)}", dest)
    why = _cannot_write(existing)
    if why is not None:
        what = "write into this directory" if existing == dest else f"create the output directory in {existing}"
        raise OutputError(f"cannot {what} ({why})", dest)


def check_output_file(file: Path, option: str = "") -> None:
    """`file` is an output file that can be written (its directory exists and lets us create files; a file there is
    replaced whole, so it must be a regular one, never a device or pipe). OutputError (one line naming the path, then
    `option`, e.g. "--stats-json", when given) otherwise."""
    file = Path(file)
    label = f"{option}: " if option else ""
    if file.is_dir():
        raise OutputError(f"{label}this is a directory; give a file", file)
    if file.exists() and not file.is_file():
        raise OutputError(f"{label}is a device, pipe or socket, not a file", file)
    existing = _nearest_existing(file.parent)
    if not existing.is_dir():
        raise OutputError(f"{label}{existing} {_not_a_directory(existing)}", file)
    if existing != file.parent:
        raise OutputError(f"{label}no such directory", file.parent)
    why = _cannot_write(existing)
    if why is not None:
        raise OutputError(f"{label}cannot create a file in {existing} ({why})", file)


def _nearest_existing(path: Path) -> Path:
    """`path` if it exists (a broken symbolic link counts), else the nearest directory above it that does."""
    for p in (path, *path.parents):
        if os.path.lexists(p):
            return p
    return Path(".")


def _not_a_directory(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "is a broken symbolic link"
    return "is a file, not a directory" if path.is_file() else "is not a directory"


def _cannot_write(directory: Path) -> str | None:
    """Why nothing can be created in `directory`, or None when something can: tried with a directory made and removed
    at once (permissions alone miss read-only and virtual file systems, and root)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tqbench-check-", dir=directory))
    except OSError as e:
        return _CANNOT.get(e.errno, (e.strerror or str(e)).lower())
    return None

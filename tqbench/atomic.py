"""Files written whole or not at all: the content goes to a new temporary file next to the destination, which then
takes the destination's name in one rename (os.replace). A write that fails removes its temporary file and leaves the
destination as it was. Each write has its own temporary name, so processes writing the same file never share one."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Iterable

TEMP_SUFFIX = ".partial"
_TEMP_NAME = re.compile(rf"(.+)\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}")


def write_bytes(path: Path, data: bytes | Iterable[bytes], fsync: bool = True) -> None:
    """Write `data` (bytes, or chunks of bytes) to `path`; with `fsync` it is on disk before it takes the name."""
    path = Path(path)
    tmp, f = _create_temp(path)
    try:
        with f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, fsync: bool = True) -> None:
    """Write `text` (UTF-8) to `path`, as `write_bytes`."""
    write_bytes(path, text.encode("utf-8"), fsync)


def write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write `obj` as indented JSON with a final newline to `path`, as `write_bytes`."""
    write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode(), fsync)


def temp_target(name: str) -> str | None:
    """The file name that the temporary file `name` (left by a write that was killed) was to take, else None."""
    m = _TEMP_NAME.fullmatch(name)
    return m.group(1) if m else None


def _create_temp(path: Path) -> tuple[Path, BinaryIO]:
    """A new file `<name>.<8 hex digits>.partial` next to `path`, open for writing (the usual permissions of a new
    file, unlike tempfile.mkstemp's owner-only ones)."""
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            return tmp, open(tmp, "xb")
        except FileExistsError:
            continue

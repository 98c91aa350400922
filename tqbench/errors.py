"""Errors and exit codes shared by every face of tqbench.

Every error the engine raises on bad input is a `TqbenchError`: its message is one line that names the file or
tensor and what is wrong, and it carries the exit code a CLI should return.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path


class ExitCode(IntEnum):
    OK = 0
    BAD_INPUT = 1  # a file or argument is wrong; nothing was written
    USAGE = 2  # command-line usage error (Typer/Click's own code)
    INCOMPLETE = 3  # the checkpoint is missing shards: the report is partial
    INTERRUPTED = 130  # Ctrl-C


class TqbenchError(Exception):
    """A clear, one-line error about user input."""

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(self, message: str, path: str | Path | None = None):
        self.path = str(path) if path is not None else None
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


class CheckpointError(TqbenchError):
    """A checkpoint directory, index, config or shard is malformed."""


class ConvertError(TqbenchError):
    """A conversion that cannot start or go on: its output directory, the disk, or what an earlier run left."""


class UsageError(TqbenchError):
    """Options that contradict each other (a usage error, as Typer's own)."""

    exit_code = ExitCode.USAGE

"""A command's one error line, said once."""

from __future__ import annotations

import os
import signal
import sys

from tqbench.distributed.world import env_rank
from tqbench.errors import TqbenchError


def say_error(e: TqbenchError) -> None:
    """`tqbench: error: ...` on stderr. Under a launcher of several ranks (mlx.launch) the launcher stops every rank
    with SIGTERM once one has ended; a rank that has said why it stops then leaves quietly, with the same code, rather
    than add the launcher's line to its own while it closes."""
    print(f"tqbench: error: {e}", file=sys.stderr, flush=True)
    if env_rank() is not None:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(e.exit_code))

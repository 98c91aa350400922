"""Test hooks, inert unless their variable is set:

- `TQBENCH_TEST_KILL=<stage>:N` SIGKILLs this process at the N-th `kill_point(stage)`, so tests can stop a real run
  anywhere (a unit converted, a step of the final write, a chunk downloaded) the way a crash would;
- `TQBENCH_TEST_INTERRUPT=<stage>` sends this process a SIGINT (a user's Ctrl-C) at `interrupt_point(stage)`, so a
  test can interrupt a command too quick to catch from outside (every command passes the stage "command" as it
  starts)."""

from __future__ import annotations

import os
import signal


def kill_point(stage: str) -> None:
    spec = os.environ.get("TQBENCH_TEST_KILL")
    if not spec or not spec.startswith(stage + ":"):
        return
    n = int(spec.split(":")[1]) - 1
    os.environ["TQBENCH_TEST_KILL"] = f"{stage}:{n}"
    if n <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


def interrupt_point(stage: str) -> None:
    if os.environ.get("TQBENCH_TEST_INTERRUPT") == stage:
        os.kill(os.getpid(), signal.SIGINT)

"""Helpers for driving the Textual app in tests."""

from __future__ import annotations


async def settle(pilot, rounds: int = 50) -> None:
    """Wait until no worker runs: the workers a screen starts, the workers they lead to, and their messages."""
    for _ in range(rounds):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
        if not any(w.is_running for w in pilot.app.workers):
            await pilot.pause()
            if not any(w.is_running for w in pilot.app.workers):
                return

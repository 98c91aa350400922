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


async def wait_for(pilot, condition, what: str, seconds: float = 30) -> None:
    """Until `condition()` holds, polling every 20 ms; an AssertionError naming `what` after `seconds`."""
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def burst(pilot, *keys: str) -> None:
    """Send keys as one terminal read delivers them: back to back, the app reading none before all are sent (a paste
    without bracketed paste, fast typing). Pilot.press waits for the app after each key, so it never shows an order
    problem between a binding and the characters typed after it."""
    from textual import events

    for key in keys:
        pilot.app._driver.send_message(events.Key(key, key if len(key) == 1 else None))


def screen_lines(app) -> list[str]:
    """The screen as the terminal shows it, one string per line (what export_screenshot draws, as text)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False).split("\n")[:height]


async def stable_screen_lines(pilot, rounds: int = 40) -> list[str]:
    """The screen once it stops changing: two captures 50 ms apart that agree. A layout change (an error row
    appearing) reaches the widgets' drawn lines on a later refresh than the message that caused it, so a capture
    right after `settle` can show a row half redrawn on a loaded machine."""
    lines = screen_lines(pilot.app)
    for _ in range(rounds):
        await pilot.pause(0.05)
        again = screen_lines(pilot.app)
        if again == lines:
            return lines
        lines = again
    return lines

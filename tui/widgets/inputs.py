"""A one-line Input whose own key bindings run in the order the keys came, with the characters typed around them.

Textual runs a focused widget's (non-priority) bindings only once the key has bubbled up to the App, through the
message queue of every ancestor, while the Input inserts a printable key as soon as it reads it. Keys that arrive
together (a paste into a terminal without bracketed paste, fast typing, a test's `press`) therefore overtake a binding:
ctrl+u followed at once by `64GB` inserted `64GB` first and then deleted everything left of the cursor, leaving the
field empty. Here the field's own bindings (cursor moves, deletes, the rows' up/down) run when the field reads the key.
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input


class OrderedInput(Input):
    """An Input that runs its own bindings in order with typed characters (see the module docstring)."""

    async def _on_key(self, event: events.Key) -> None:
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            if not binding.priority and await self.app.run_action(binding.action, self):
                event.stop()
                event.prevent_default()  # Input's own key handling (and the bubbling to the App) is done
                return
        # Not a binding of this field: Input._on_key runs next (Textual calls each class's handler in turn).

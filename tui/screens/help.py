"""The help screen: every key binding of the app, of each screen (with the fields and panels it shows) and of the
dialogs, read from the classes' BINDINGS when it opens, so it cannot go stale."""

from __future__ import annotations

import re
import sys

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import Static


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _ours(cls: type) -> bool:
    """A class of this UI (tui.*) that declares bindings itself."""
    return cls.__module__.startswith("tui.") and bool(cls.__dict__.get("BINDINGS"))


def _title(cls: type) -> str:
    """PlanTable -> "Plan table"."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", cls.__name__.removesuffix("Screen")).capitalize()


def key_lines(app, bindings: list) -> list[tuple[str, str]]:
    """(keys, description) per description, in order; keys shown as the footer shows them, a key left out when a
    shown key_display already names it (down in "↑↓")."""
    groups: dict[str, list[str]] = {}
    named: dict[str, str] = {}  # description -> the key_displays given
    for b in Binding.make_bindings(bindings):
        if b.description and not b.system:
            keys = groups.setdefault(b.description, [])
            shown = app.get_key_display(b)
            if shown not in keys and shown not in named.get(b.description, ""):
                keys.append(shown)
            if b.key_display:
                named[b.description] = named.get(b.description, "") + b.key_display
    return [(" ".join(keys), description[:1].upper() + description[1:]) for description, keys in groups.items()]


def sections(app) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(keys, description)]) for the app, each mode's screen and its widgets, then the dialogs."""
    app_bindings = [b for _, b in app._bindings]  # the app's classes' bindings, and Textual's palette key
    out = [("Everywhere", key_lines(app, app_bindings))]
    mode_keys = {b.action: app.get_key_display(b) for b in app_bindings}
    widgets = [w for w in _subclasses(Widget) if _ours(w) and not issubclass(w, Screen)]
    screens = list(app.MODES.values())
    for mode, screen in app.MODES.items():
        key = mode_keys.get(f"switch_mode('{mode}')")
        out.append((f"{_title(screen)} screen" + (f" ({key})" if key else ""), key_lines(app, screen.BINDINGS)))
        module = sys.modules[screen.__module__]
        used = {mod for v in vars(module).values() if (mod := getattr(v, "__module__", None))} | {module.__name__}
        for w in [w for w in widgets if w.__module__ in used]:
            out.append((f"  {_title(w)}", key_lines(app, w.BINDINGS)))
            widgets.remove(w)
    for other in [*widgets, *[s for s in _subclasses(Screen) if _ours(s) and s not in screens]]:
        out.append((_title(other), key_lines(app, other.BINDINGS)))
    return out


def help_text(app) -> str:
    lines = []
    parts = sections(app)
    width = max(len(k) for _, keys in parts for k, _ in keys)
    for title, keys in parts:
        lines += [title] + [f"    {k:<{width}}  {d}" for k, d in keys] + [""]
    return "\n".join(lines).rstrip()


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,f1,q", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen #help-box { width: 76; max-width: 100%; height: 90%; border: round $accent; padding: 0 1;
                           background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "Keys (esc closes; ctrl+p: the command palette)"
            yield Static(Content(help_text(self.app)), id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)

"""Screens of the TUI. Source is the first; Recipe, Convert, Chat and Streaming join as app modes later."""

from tui.screens.open import OpenScreen
from tui.screens.source import SourceScreen

__all__ = ["OpenScreen", "SourceScreen"]

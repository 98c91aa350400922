"""Screens of the TUI. Source and Recipe are app modes; Convert, Chat and Streaming join later."""

from tui.screens.open import OpenScreen
from tui.screens.recipe import RecipeScreen
from tui.screens.source import SourceScreen

__all__ = ["OpenScreen", "RecipeScreen", "SourceScreen"]

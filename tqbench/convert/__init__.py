"""Streaming, resumable conversion of a source checkpoint with a recipe."""

from tqbench.convert.pipeline import DestinationStatus, Layout, convert, destination_status, layout
from tqbench.errors import ConvertError

__all__ = ["ConvertError", "DestinationStatus", "Layout", "convert", "destination_status", "layout"]

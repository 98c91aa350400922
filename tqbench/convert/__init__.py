"""Streaming, resumable conversion of a source checkpoint with a recipe."""

from tqbench.convert.pipeline import ConvertError, DestinationStatus, Layout, convert, destination_status, layout

__all__ = ["ConvertError", "DestinationStatus", "Layout", "convert", "destination_status", "layout"]

"""Streaming, resumable conversion of a source checkpoint with a recipe."""

from tqbench.convert.pipeline import ConvertError, convert

__all__ = ["ConvertError", "convert"]

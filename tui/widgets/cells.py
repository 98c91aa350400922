"""Table cells as Rich Text: never parsed as markup (tensor names are data), numbers right-aligned."""

from __future__ import annotations

from rich.text import Text


def cell(value: object, style: str = "") -> Text:
    return Text(str(value), style=style, no_wrap=True, end="")


def num(value: object, style: str = "") -> Text:
    return Text(str(value), style=style, justify="right", no_wrap=True, end="")


def header(label: str, numeric: bool = False) -> Text:
    return Text(label, justify="right" if numeric else "left", end="")

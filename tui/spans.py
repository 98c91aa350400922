"""The engine's report lines (tqbench.chat.report.Span) as Textual Content: the engine says what a run of text is
(a label, a value, muted), the TUI only picks its style."""

from __future__ import annotations

from typing import Sequence

from textual.content import Content

from tqbench.chat.report import Line

STYLES = {"": "", "label": "$text-muted", "value": "bold", "muted": "$text-muted"}


def content(lines: Sequence[Line]) -> Content:
    return Content("\n").join(Content.assemble(*((s.text, STYLES[s.kind]) for s in line)) for line in lines)

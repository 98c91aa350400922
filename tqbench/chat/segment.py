"""A completion's text split the way the model's markers say: the answer, its reasoning (a thinking block) and tool
calls, with the markers stripped. mlx-lm's TextStateMachine finds the markers of the tokenizer's formats and the
tokenizer's tool parser (mlx_lm.tool_parsers) reads each call; tqbench only feeds them a token's text at a time."""

from __future__ import annotations

import json
import uuid
from typing import Any

from tqbench.events import ToolCall


class Segmenter:
    """A completion's text split into answer, reasoning and tool calls with mlx-lm's TextStateMachine (the markers
    of the tokenizer's thinking and tool-call formats, stripped), tool calls parsed by the tokenizer's tool parser."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, prompt_text_end: str = "") -> None:
        from mlx_lm.generate import TextStateMachine, make_text_state_machine

        self._sm = TextStateMachine
        self._parser = tokenizer.tool_parser if getattr(tokenizer, "has_tool_calling", False) else None
        self._tools = tools
        initial = "normal"
        if getattr(tokenizer, "has_thinking", False) and prompt_text_end.endswith(tokenizer.think_start):
            initial = "reasoning"  # the template opened the reasoning block itself
        self._state = make_text_state_machine(tokenizer).make_state(initial)
        self._prev = initial
        self._tool_text = ""
        self._calls = 0

    def feed(self, text: str, final: str | None = None) -> tuple[str, str, tuple[ToolCall, ...]]:
        """(answer, reasoning, tool calls) that `text` completes. `final`: the generation's finish reason on its
        last token ("stop" drops a held-back partial marker, "length" lets it out as text)."""
        if final == "stop":
            self._state, now = self._sm.discard(self._state)
            segments = [(now, "")]
        else:
            self._state, segments = self._sm.split(self._state, text)
            if final is not None:
                self._state, rest, now = self._sm.flush(self._state)
                segments.append((now, rest))
        content, reasoning, calls = [], [], []
        for state, piece in segments:
            if state == "reasoning":
                reasoning.append(piece)
            elif state == "tool":
                self._tool_text += piece
            else:
                if self._prev == "tool":
                    calls += self._parse()
                content.append(piece)
            self._prev = state
        if final is not None and self._prev == "tool" and self._tool_text:
            calls += self._parse()  # a call cut off by max tokens: parsed if it can be
        return "".join(content), "".join(reasoning), tuple(calls)

    def _parse(self) -> list[ToolCall]:
        text, self._tool_text = self._tool_text, ""
        if self._parser is None:
            return []
        try:
            parsed = self._parser(text, self._tools)
        except (ValueError, KeyError, json.JSONDecodeError):
            return []  # a malformed or truncated call: left out, as mlx_lm.server does
        calls = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            self._calls += 1
            args = c.get("arguments", {})
            calls.append(ToolCall(id=str(c.get("id") or f"call_{self._calls}_{uuid.uuid4().hex[:12]}"),
                                  name=str(c["name"]),
                                  arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return calls

"""The README's commands run as written after its first command: the venv's `tqbench` is not on PATH."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FIRST_COMMANDS = [
    'python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/tqbench convert --hf-path "$(.venv/bin/tqbench '
    'demo)" --mlx-path demo-tq3a-tqTe-down4-g64 --bits 3 -g 64 --ternary-experts --expert-down-bits 4 --streaming '
    "&& .venv/bin/tqbench chat --model demo-tq3a-tqTe-down4-g64 --no-chat-template --max-tokens 24 "
    "--prompt $'def add(a, b):\\n    return a + b\\n\\n\\ndef sub(a, b):\\n'",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q',
]
# A command word `tqbench` (not `.venv/bin/tqbench`, not the package `tqbench/` or `tqbench.demo`) that is run: inside
# `$(...)`, or followed by a subcommand and an argument. `tqbench plan` alone names a command; it is not one to run.
BARE = re.compile(r"(?<![\w./-])tqbench(?=\)|\s+(?:inspect|plan|convert|demo|ui|chat)\s+\S)")


def code_snippets(text: str) -> list[str]:
    """Inline code spans (joined across line breaks) and code-block lines, outside headings."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            out.append(line.strip())
    prose = "\n".join(line for line in text.splitlines() if not line.startswith(("#", "    ", "```")))
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return out


def test_first_two_commands_are_unchanged():
    block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line for line in block.splitlines() if not line.startswith("#")] == FIRST_COMMANDS


def test_follow_up_commands_use_the_venv_tqbench():
    snippets = code_snippets(README.read_text())
    assert any(".venv/bin/tqbench plan" in s for s in snippets)  # the follow-ups were found at all
    bare = [s for s in snippets if BARE.search(s)]
    assert bare == []

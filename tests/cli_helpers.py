"""Run the real `tqbench` entry point in-process and capture what a user would see."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from tqbench.cli.main import run


@dataclass
class Result:
    code: int
    out: str
    err: str


def tqbench(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    monkeypatch.setattr(sys, "argv", ["tqbench", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        run()
    except SystemExit as e:
        code = int(e.code or 0)
    cap = capsys.readouterr()
    return Result(code, cap.out, cap.err)

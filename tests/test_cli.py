"""The command line as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from cli_helpers import tqbench
from tqbench import __version__, units
from tqbench.source import open_checkpoint, summarize


def test_version_and_help(capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "--version")
    assert (r.code, r.out.strip()) == (0, f"tqbench {__version__}")
    r = tqbench(capsys, monkeypatch, "--help")
    assert r.code == 0
    for command in ("inspect", "demo", "ui"):
        assert command in r.out


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "tqbench", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"tqbench {__version__}"


def test_inspect_json_is_the_engine_summary(small_k3, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "inspect", small_k3, "--json", "--tensors", "*layers.1.*experts.0.*")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    s = summarize(open_checkpoint(small_k3))
    assert doc["schema"] == "tqbench.inspect/1"
    assert (doc["params"], doc["active_params"], doc["bytes"], doc["tensors"]) == (s.params, s.active_params, s.bytes, s.tensors)
    assert doc["experts"]["bytes_by_projection"] == {"gate": 1088, "up": 1088, "down": 1088}
    names = [t["name"] for t in doc["tensor_list"]]
    assert names == sorted(f"language_model.model.layers.1.block_sparse_moe.experts.0.{w}.{p}"
                           for w in ("w1", "w2", "w3") for p in ("weight_packed", "weight_scale"))
    assert {t["role"] for t in doc["tensor_list"]} == {"routed_expert"}


def test_inspect_tables(small_k3, capsys, monkeypatch):
    r = tqbench(capsys, monkeypatch, "inspect", small_k3)
    assert r.code == 0 and "routed_expert" in r.out and "kimi_k3" in r.out
    # by role: the size in decimal and in binary units, each cell with its own unit (KiB here, not a "GiB" column)
    lines = r.out.splitlines()
    head = lines.index("by role") + 1
    assert re.split(r"\s{2,}", lines[head].strip()) == ["role", "tensors", "params", "size", "binary", "formats"]
    for g, line in zip(summarize(open_checkpoint(small_k3)).by_role, lines[head + 1:]):
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[0] == g.key and cells[3:5] == [units.gb(g.bytes), units.gib(g.bytes)]
    r = tqbench(capsys, monkeypatch, "inspect", small_k3, "--by", "layer")
    assert r.code == 0 and "mla" in r.out and "kda" in r.out
    r = tqbench(capsys, monkeypatch, "inspect", small_k3, "--by", "shard", "--tensors", "*embed*")
    assert r.code == 0 and "model-00001-of-" in r.out and "embed_tokens" in r.out


@pytest.mark.parametrize("args", [[], ["ui"]])
def test_ui_without_a_terminal_is_refused_at_once(args):
    """Piped or redirected, the full-screen UI would spin at 99% CPU forever: one line on stderr and exit 2."""
    command = [sys.executable, "-m", "tqbench", *args]
    done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "needs a terminal" in done.stderr
    # A terminal on stdin but stdout piped: refused the same way.
    leader, follower = os.openpty()
    try:
        done = subprocess.run(command, stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert done.returncode == 2 and done.stdout == "" and "needs a terminal" in done.stderr


@pytest.mark.parametrize("command", [[], ["inspect"], ["plan"], ["convert"], ["demo"], ["ui"]])
def test_help_shows_no_type_for_flags(command, capsys, monkeypatch):
    """Flags take no value: no `<bool>` after --json, --force, --version or --help."""
    r = tqbench(capsys, monkeypatch, *command, "--help")
    assert r.code == 0 and r.out.startswith("Usage: ")
    assert "bool" not in r.out.lower()
    flags = [line.split()[0] for line in r.out.splitlines() if line.strip().startswith("--")]
    assert "--help" in flags


def test_inspect_counts_shards_in_words(tmp_path, capsys, monkeypatch):
    from conftest import small_k3_text
    from tqbench.skeleton import k3_config, k3_tensor_specs, write_skeleton

    text = small_k3_text()
    one = write_skeleton(tmp_path / "one", k3_config(text), k3_tensor_specs(text))
    r = tqbench(capsys, monkeypatch, "inspect", one)
    n = len(open_checkpoint(one).tensors)
    assert r.code == 0 and f"{n:,} in 1 shard " in r.out and "1 shards" not in r.out


def _commands() -> dict[str, object]:
    """Every command and group, by its words after `tqbench` ("" for tqbench itself), as click sees them."""
    import typer

    from tqbench.cli.main import app

    found = {}

    def walk(cmd, words):
        found[" ".join(words)] = cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*words, name])
    walk(typer.main.get_command(app), [])
    return found


USAGE = {
    "": "[OPTIONS] COMMAND [ARGS]...",
    "inspect": "[OPTIONS] PATH",
    "demo": "[OPTIONS]",
    "ui": "[OPTIONS] [PATH]",
    "plan": "[OPTIONS] SRC",
    "convert": "[OPTIONS]",
    "chat": "[OPTIONS]",
    "eval": "[OPTIONS] MODEL",
    "serve": "[OPTIONS]",
    "profile": "[OPTIONS] COMMAND [ARGS]...",
    "profile show": "[OPTIONS]",
    "profile export": "[OPTIONS]",
    "profile import": "[OPTIONS] FILE",
    "profile merge": "[OPTIONS] A B",
    "profile diff": "[OPTIONS] A B",
    "profile reset": "[OPTIONS]",
}


def test_every_usage_line_reads_as_unix_usage(capsys, monkeypatch):
    """`tqbench plan [OPTIONS] SRC`, not Typer's `{SRC}`: in --help and on a usage error, for every command."""
    assert sorted(_commands()) == sorted(USAGE)
    for words, usage in USAGE.items():
        tail = f"tqbench {words} {usage}" if words else f"tqbench {usage}"  # after the program's name as run
        r = tqbench(capsys, monkeypatch, *words.split(), "--help")
        help_line = r.out.splitlines()[0]
        assert r.code == 0 and help_line.startswith("Usage: ") and help_line.endswith(tail), words
        r = tqbench(capsys, monkeypatch, *words.split(), "--zzz")
        assert r.code == 2 and r.err.splitlines()[0] == help_line, words
        assert r.err.splitlines()[-1] == "Error: No such option: --zzz", words
        assert "{" not in help_line and "}" not in help_line


# Every numeric option of every command, a value out of its range, and what Typer says of it (exit 2).
RANGES = [
    ("inspect", "--limit", "-1", "greater than or equal to 0"),
    *[(command, flag, value, why) for command in ("plan", "convert") for flag, value, why in [
        ("--bits", "0", "greater than or equal to 1"),
        ("--group-size", "-64", "greater than or equal to 1"),
        ("--attn-bits", "-1", "greater than or equal to 1"),
        ("--mlp-bits", "0", "greater than or equal to 1"),
        ("--expert-down-bits", "-3", "greater than or equal to 1"),
        ("--mlp-group-size", "0", "greater than or equal to 1"),
        ("--seed", "-1", "greater than or equal to 0"),
    ]],
    ("convert", "--seed", str(2**31), "less than or equal to 2147483647"),
    ("convert", "--calibrate-tokens", "255", "greater than or equal to 256"),
    ("convert", "--calibrate-tokens", str(2**24 + 1), "less than or equal to 16777216"),
    ("plan", "--disk-gbps", "0", "greater than 0"),
    ("plan", "--disk-gbps", "-2.5", "greater than 0"),
    ("plan", "--hit-rate", "-0.1", "greater than or equal to 0"),
    ("plan", "--hit-rate", "1.5", "less than or equal to 1"),
    ("plan", "--reduced-k", "0", "greater than or equal to 1"),
    ("plan", "--limit", "-5", "greater than or equal to 0"),
    ("plan", "--machines", "0", "greater than or equal to 1"),
    ("chat", "--max-tokens", "0", "greater than or equal to 1"),
    ("chat", "--temp", "-1", "greater than or equal to 0"),
    ("chat", "--top-p", "1.5", "less than or equal to 1"),
    ("chat", "--top-k", "-1", "greater than or equal to 0"),
    ("chat", "--seed", "-1", "greater than or equal to 0"),
    ("chat", "--prefetch-workers", "0", "greater than or equal to 1"),
    ("chat", "--reads-in-flight", "-1", "greater than or equal to 0"),
    ("chat", "--max-active-experts", "-1", "greater than or equal to 0"),
    ("chat", "--pin-share", "-0.5", "greater than or equal to 0"),
    ("chat", "--cache-routing", "1.5", "less than or equal to 1"),
    ("serve", "--port", "70000", "less than or equal to 65535"),
    ("serve", "--max-queue", "-1", "greater than or equal to 0"),
    ("serve", "--max-body-mb", "0", "greater than or equal to 0.001"),
    ("serve", "--prompt-cache-gb", "-1", "greater than or equal to 0"),
    ("serve", "--max-requests", "-1", "greater than or equal to 0"),
    ("serve", "--max-tokens", "0", "greater than or equal to 1"),
    ("serve", "--temp", "-1", "greater than or equal to 0"),
    ("serve", "--top-p", "1.5", "less than or equal to 1"),
    ("serve", "--top-k", "-1", "greater than or equal to 0"),
    ("serve", "--seed", "-1", "greater than or equal to 0"),
    ("serve", "--prefetch-workers", "0", "greater than or equal to 1"),
    ("serve", "--reads-in-flight", "-1", "greater than or equal to 0"),
    ("serve", "--max-active-experts", "-1", "greater than or equal to 0"),
    ("serve", "--pin-share", "-0.5", "greater than or equal to 0"),
    ("serve", "--cache-routing", "-0.1", "greater than or equal to 0"),
    ("eval", "--window", "1", "greater than or equal to 2"),
    ("eval", "--tokens", "0", "greater than or equal to 1"),
    ("eval", "--prompts", "-1", "greater than or equal to 0"),
    ("eval", "--generate", "-1", "greater than or equal to 0"),
    ("eval", "--max-active-experts", "-1", "greater than or equal to 0"),
    ("eval", "--prefetch-workers", "0", "greater than or equal to 1"),
    ("eval", "--reads-in-flight", "-1", "greater than or equal to 0"),
    ("eval", "--cache-routing", "2", "less than or equal to 1"),
    ("eval", "--tool-cases", "-1", "greater than or equal to 0"),
    ("eval", "--tool-temp", "-0.5", "greater than or equal to 0"),
    ("profile show", "--top", "-1", "greater than or equal to 0"),
    ("profile merge", "--weight-a", "-1", "greater than or equal to 0"),
    ("profile merge", "--weight-b", "-0.5", "greater than or equal to 0"),
    ("profile diff", "--share", "0", "greater than or equal to 0.01"),
]
# What each command needs besides the option (never read: the value is refused first).
REQUIRED = {"inspect": ["ckpt"], "plan": ["ckpt"], "eval": ["model"], "convert": ["--hf-path", "ckpt", "--mlx-path", "out"],
            "profile merge": ["a.json", "b.json", "--output", "c.json"], "profile diff": ["a.json", "b.json"]}


def test_every_numeric_option_has_a_range():
    """RANGES covers every int and float option there is: a new one gets a range and a line there."""
    from typer.core import TyperOption

    numeric = {(words, p.opts[0]) for words, cmd in _commands().items() for p in cmd.params
               if isinstance(p, TyperOption) and p.type_descriptor.annotation in (int, float)}
    assert numeric == {(command, flag) for command, flag, _, _ in RANGES}


@pytest.mark.parametrize("command, flag, value, why", RANGES, ids=[f"{c} {f}={v}" for c, f, v, _ in RANGES])
def test_a_numeric_option_out_of_range_is_a_usage_error(command, flag, value, why, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = tqbench(capsys, monkeypatch, *command.split(), *REQUIRED.get(command, []), f"{flag}={value}")
    assert (r.code, r.out) == (2, "")
    named = "'--group-size' / '-g'" if flag == "--group-size" else f"'{flag}'"  # Typer names both spellings
    assert r.err.splitlines()[-1] == f"Error: Invalid value for {named}: Input should be {why}"
    assert "Traceback" not in r.err and list(tmp_path.iterdir()) == []

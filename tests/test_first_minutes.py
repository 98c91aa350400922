"""What a new user meets in the first minutes, as a user meets it: README command 1's reply, exit codes that follow
one rule on every command, honest figures and one-line answers to odd input."""

from __future__ import annotations

import ast
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import demo_tq4
from tqbench import units
from tqbench.cli.eval import STAGES
from tqbench.demo import ensure_demo

README = Path(__file__).resolve().parent.parent / "README.md"
STAGE_GREEDY = STAGES["greedy"]


def tq(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 300,
       stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tqbench", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout, input=stdin)


# ---- README command 1 -----------------------------------------------------------------------------------------------

def readme_chat_prompt() -> str:
    """The prompt README command 1 sends, decoded from its $'...' quoting."""
    block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    quoted = block.split("--prompt $'", 1)[1].split("'", 1)[0]
    return quoted.encode().decode("unicode_escape")


@pytest.mark.slow
def test_readme_command_one_writes_python_a_reader_recognises(tmp_path):
    """Its conversion and chat, as the README runs them (the venv's tqbench is this interpreter's): the reply continues
    the prompt as Python that parses, and the summary gives the first reply's prompt time, not a speed."""
    env = {"TQBENCH_CACHE_DIR": str(tmp_path / "cache")}
    dest = tmp_path / "demo-tq3a-tqTe-down4-g64"
    conv = tq("convert", "--hf-path", ensure_demo(), "--mlx-path", dest, "--bits", "3", "-g", "64",
              "--ternary-experts", "--expert-down-bits", "4", "--streaming", env=env, cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr[-2000:]
    prompt = readme_chat_prompt()
    assert prompt.startswith("def add(a, b):\n")
    chat = tq("chat", "--model", dest, "--no-chat-template", "--max-tokens", "24", "--prompt", prompt, env=env,
              cwd=tmp_path)
    assert chat.returncode == 0, chat.stderr[-2000:]
    reply = chat.stdout.rstrip("\n")
    whole = prompt + reply
    complete = whole[: whole.rfind("\n")] if not whole.endswith("\n") else whole  # the last line may be cut off
    tree = ast.parse(complete)  # Python, not "    ...     1" repeated
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert defs[:2] == ["add", "sub"] and any(isinstance(n, ast.Return) for n in ast.walk(tree.body[1]))
    summary = chat.stderr.strip().splitlines()[-1]
    assert "[24 tokens (max tokens)" in summary and "prompt 18 tokens in " in summary
    assert "(warming up: the first pass compiles)" in summary and summary.count("tok/s") == 1  # decode's only


# ---- exit codes: one rule -------------------------------------------------------------------------------------------

QUICK = [  # commands too quick to interrupt from outside: the test hook sends SIGINT as each starts
    ("inspect", lambda d: ["inspect", d]),
    ("plan", lambda d: ["plan", d, "--disk-gbps", "1"]),
    ("demo", lambda d: ["demo"]),
    ("convert", lambda d: ["convert", "--hf-path", d, "--mlx-path", "out", "-r", "tq4"]),
    ("chat", lambda d: ["chat", "--model", d, "--prompt", "hi"]),
    ("eval", lambda d: ["eval", d]),
    ("serve", lambda d: ["serve", "--model", d, "--port", "0"]),
    ("profile show", lambda d: ["profile", "show", "--model", d]),
    ("profile reset", lambda d: ["profile", "reset", "--model", d]),
]


@pytest.mark.parametrize("name,args", QUICK, ids=[q[0] for q in QUICK])
def test_ctrl_c_exits_130_from_every_command(name, args, tmp_path):
    r = tq(*args(ensure_demo()), env={"TQBENCH_TEST_INTERRUPT": "command", "TQBENCH_CACHE_DIR": str(tmp_path)},
           cwd=tmp_path, timeout=120)
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (130, "tqbench: interrupted"), r.stderr[-1000:]
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_ctrl_c_at_the_chat_prompt_leaves_with_130_on_a_new_line(tmp_path):
    """Interactive chat (a terminal): Ctrl-C stops a reply and keeps the session; at the prompt it leaves."""
    model = demo_tq4(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a chat on the pty
        os.environ["TQBENCH_CACHE_DIR"] = str(tmp_path / "cache")
        os.execv(sys.executable, [sys.executable, "-m", "tqbench", "chat", "--model", str(model), "--no-learn"])
    seen = b""
    deadline = time.time() + 120
    while b">>> " not in seen and time.time() < deadline:
        if select.select([fd], [], [], 1)[0]:
            seen += os.read(fd, 4096)
    assert b">>> " in seen, seen.decode(errors="replace")
    os.write(fd, b"\x03")  # the terminal turns it into SIGINT
    # A Ctrl-C that lands while readline is still setting up its prompt can go unseen until the next key (its wait
    # for input does not look at a signal that came before it): as a user would, press it again after a while.
    tail, pressed, last = b"", 1, time.time()
    while time.time() < deadline + 60:
        if not select.select([fd], [], [], 1)[0]:
            if time.time() - last > 10:
                os.write(fd, b"\x03")
                pressed, last = pressed + 1, time.time()
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        tail += chunk
    else:
        os.kill(pid, signal.SIGKILL)  # never left: the assertions below say so
    _, status = os.waitpid(pid, 0)
    assert pressed <= 2, f"Ctrl-C pressed {pressed} times"
    assert os.waitstatus_to_exitcode(status) == 130
    lines = tail.decode(errors="replace").replace("\r", "").split("\n")
    assert "tqbench: interrupted" in lines  # on a line of its own, after the prompt's line was ended


# ---- odd input, honest figures --------------------------------------------------------------------------------------

def test_an_empty_prompt_is_refused_in_one_line(tmp_path):
    r = tq("chat", "--model", ensure_demo(), "--prompt", "  ", env={"TQBENCH_CACHE_DIR": str(tmp_path)})
    assert (r.returncode, r.stderr.strip()) == (2, "tqbench: error: --prompt is empty: give the message to answer")
    assert r.stdout == ""


def test_sizes_below_a_kilobyte_read_as_bytes_like_the_rest():
    assert [units.gb(576), units.gb(1090), units.gib(576), units.gib(2048)] == ["576 B", "1.09 kB", "576 B",
                                                                                "2.00 KiB"]
    assert units.size(999) == "999 B (999 B)" and units.gb(1000) == "1.00 kB"


def test_plan_names_the_layers_of_a_repeated_warning_once():
    """The demo's experts' down projections are 32 wide: at -g 64 each of its 7 MoE layers keeps them; one line says so,
    naming the layers and their bytes together."""
    from tqbench.recipe import Recipe, make_plan
    from tqbench.recipe.plan import group_sources
    from tqbench.source import open_checkpoint

    plan = make_plan(group_sources(open_checkpoint(ensure_demo())), Recipe.parse("tq3a-tqTe-down4-g64"), 5 << 30)
    kept = [m for m in plan.modules if m.name.endswith("switch_mlp.down_proj") and m.choice.reason != "recipe"
            and m.choice.format.value == "source"]
    assert len(kept) == 7
    assert plan.warnings == (f"language_model.model.layers.N.block_sparse_moe.switch_mlp.down_proj stays at source "
                             f"precision (in % 64 != 0) in layers 1-7: {sum(m.bytes for m in kept):,} bytes",)


@pytest.mark.slow
def test_eval_says_when_the_texts_hold_fewer_tokens_than_asked_and_counts_greedy_once(tmp_path):
    model = demo_tq4(tmp_path)
    text = tmp_path / "short.txt"
    text.write_text(Path(units.__file__).read_text() * 2)
    r = tq("eval", model, "--text", text, "--window", "128", "--tokens", "10000000", "--prompts", "2", "--generate",
           "4", "--against", model, "--json", env={"TQBENCH_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-1500:]
    doc = json.loads(r.stdout)
    scored = doc["total"]["tokens"]
    assert 0 < scored < 10_000_000
    started = next(x for x in r.stderr.splitlines() if x.startswith("evaluating "))
    assert started.endswith("(all the texts hold: fewer than the 10,000,000 asked)") and f"{scored:,} tokens" in started
    greedy = [x for x in r.stderr.splitlines() if x.startswith(STAGE_GREEDY)]
    assert greedy and greedy[-1].startswith(f"{STAGE_GREEDY} 8/8 tokens (100%)"), greedy  # 2 prompts x 4, once each

"""scripts/gpu_prompt_check.py, the GPU's prompt check, run here on the CPU: it must work before a lease spends minutes
on it, and it must fail where streamed and resident tokens differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import demo_tq4

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_prompt_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_streamed_resident_and_every_face_agree_on_the_demo(tmp_path):
    """Prompts of 16 and 150 tokens (1,200 routings at top-8), resident, streamed at 4 MB (1,217 slots, two pools) and
    over a host tier; chat, serve and eval on the streamed model."""
    model = demo_tq4(tmp_path)
    out = tmp_path / "check.json"
    p = run("--model", str(model), "--lengths", "16,150", "--tokens", "3", "--faces", "--face-length", "150",
            "--work", str(tmp_path / "work"), "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failed"] == 0
    rows = result["models"][0]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [16, 150]
    for r in rows:
        assert len(r["reference"]) == 3
        assert r["streamed"]["tokens"] == r["streamed+host"]["tokens"] == r["reference"]
        assert r["streamed"]["slots"] == 1217 and r["streamed"]["misses"] > 0
    faces = result["faces"]
    chat = faces["chat"]["tokens"]  # its token events: not an end-of-message token, which has no text
    assert len(chat) >= 2 and chat == rows[1]["streamed"]["tokens"][:len(chat)]
    assert faces["serve"]["prompt_tokens"] == 150 and faces["serve"]["ok"]
    ppl = faces["eval"]["perplexity"]
    assert ppl["streamed"] == ppl["resident"] > 1


def test_a_crashing_mode_is_reported_and_fails_the_check(tmp_path):
    """A mode whose process dies (here: a model directory that is not one) is a failed check, not a crash."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    assert "error" in json.dumps(
        __import__("gpu_prompt_check").run_mode("x", bad, None, 0, ["hello"], 2, "default", 120))


def test_the_group_probe_runs_here():
    """On a CPU gather_mm has no group limit: 1,025 matrices give the per-expert products (outputs of about 8 in
    size). Equal up to float32 rounding, not bit for bit: with OpenBLAS on an AVX-512 machine gather_mm's products
    and the reference's one-row products take different kernels (5.7e-6 apart seen; the reference BLAS: 0)."""
    p = run("--probe", "groups")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("BENCH-RESULT ")][-1]
    assert json.loads(line.split(" ", 1)[1])["max_abs_err"] <= 1e-4

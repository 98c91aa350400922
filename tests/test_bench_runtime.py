"""benchmarks/runtime.py --quick runs end to end on the shipped demo and writes a complete JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # converts the demo four ways and runs a dozen model processes (~45 s on 2 cores)

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "runtime.py"
MODELS = ["source", "tq3a-tqTe-down4-g64", "tq4", "affine4", "src"]


def test_quick_run_writes_every_model(tmp_path):
    out = tmp_path / "runtime.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "tqbench.bench.runtime/1" and doc["config"]["quick"]
    rows = {r["model"]: r for r in doc["summary"]["rows"]}
    assert list(rows) == MODELS
    for name, r in rows.items():
        for key in ("load_s", "weight_bytes", "disk_tensor_bytes", "prefill_tps", "decode_tps", "peak_rss",
                    "peak_rss_after_load", "mlx_peak_after_load", "mlx_peak_total", "perplexity", "quality_tokens",
                    "prefill_ratio", "decode_ratio", "peak_rss_ratio"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (name, key, r[key])
        assert 0 <= r["top1_agreement"] <= 1 and 0 < r["top1_accuracy"] < 1
        assert r["quality_tokens"] == doc["inputs"]["windows"]["predicted_tokens"]
    src, passthrough = rows["source"], rows["src"]
    assert src["top1_agreement"] == 1.0 and src["decode_ratio"] == 1.0
    # "src" keeps every tensor as stored (mxfp4 experts copied): the same model, the same numbers, bit for bit.
    assert passthrough["perplexity"] == src["perplexity"] and passthrough["top1_agreement"] == 1.0
    assert passthrough["weight_bytes"] == src["weight_bytes"]
    # Quantized recipes are smaller on disk and in memory than the source.
    for name in ("tq3a-tqTe-down4-g64", "tq4", "affine4"):
        assert rows[name]["disk_tensor_bytes"] < src["disk_tensor_bytes"]
        assert rows[name]["weight_bytes"] < src["weight_bytes"]
    assert "quality on the held-out split" in p.stdout

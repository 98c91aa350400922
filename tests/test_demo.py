"""The built-in demo checkpoint: deterministic bytes, K3 source layout, and mlx-lm loads and runs it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate

from tqbench.demo import DEMO_VERSION, TRAINED_SPEC, DemoSpec, ensure_demo, split_shards, tensor_plan, write_source
from tqbench.layout.shard_units import assign_shards
from tqbench.quant.mxfp4 import unpack_mxfp4
from tqbench.shards.header import read_header

SPEC = DemoSpec()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("demo") / "kimi-k3-demo")


@pytest.fixture(scope="module")
def loaded(demo):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        return load(str(demo))


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


def tensors(root: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the checkpoint as (dtype, data): U8 and F32 in their shapes, BF16 as flat raw bytes."""
    out = {}
    for shard in sorted(root.glob("model-*.safetensors")):
        h = read_header(shard)
        raw = shard.read_bytes()
        for t in h.tensors:
            data = np.frombuffer(raw, np.uint8, t.nbytes, t.offset)
            if t.dtype == "F32":
                data = data.view(np.float32)
            out[t.name] = (t.dtype, data.reshape(t.shape) if t.dtype in ("U8", "F32") else data)
    return out


def test_write_is_deterministic(tmp_path):
    a, b, c = (write_source(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    da, db, dc = digests(a), digests(b), digests(c)
    assert da == db and len(da) == 4 + 5  # 4 shards + index, config, generation config, tokenizer x2
    assert sorted(dc) == sorted(da)
    changed = {k for k in da if da[k] != dc[k]}
    assert changed == {k for k in da if k.endswith(".safetensors")}  # only the weights depend on the seed
    # Rewriting in place replaces the directory and leaves nothing else behind.
    write_source(a, seed=1)
    assert digests(a) == dc and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


@pytest.mark.parametrize("spec", [SPEC, TRAINED_SPEC, DemoSpec(num_shards=7), DemoSpec(num_shards=1)])
def test_shard_split_is_the_greedy_split_at_the_smallest_size(spec):
    plan = tensor_plan(spec)
    shards = split_shards(plan, spec.num_shards)
    assert [t for s in shards for t in s] == plan and len(shards) <= spec.num_shards and all(shards)
    largest = max(sum(t.nbytes for t in s) for s in shards)
    assert shards == assign_shards(plan, largest)
    assert len(assign_shards(plan, largest - 1)) > spec.num_shards  # a smaller shard size needs more shards


def test_source_layout(demo):
    config = json.loads((demo / "config.json").read_text())
    base = SPEC.base_vocab
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (base, base + 2, base + 255)
    text = config["text_config"]
    assert text["model_type"] == "kimi_linear" and text["vocab_size"] == base + 256 == 768
    assert text["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert text["linear_attn_config"]["full_attn_layers"] == [4]
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"

    index = json.loads((demo / "model.safetensors.index.json").read_text())
    ts = tensors(demo)
    assert set(index["weight_map"]) == set(ts)
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    assert index["metadata"]["total_size"] == sum(t.nbytes for f in shards for t in read_header(demo / f).tensors)
    assert all(index["weight_map"][t.name] == f for f in shards for t in read_header(demo / f).tensors)

    lm = "language_model.model.layers."
    assert ts[f"{lm}0.self_attn.q_conv1d.weight"][0] == "BF16"
    assert ts[f"{lm}0.self_attn.A_log"][1].shape == (64,)
    assert ts[f"{lm}0.self_attn.dt_bias"][1].shape == (64,)
    assert f"{lm}0.mlp.gate_proj.weight" in ts and f"{lm}1.mlp.gate_proj.weight" not in ts
    assert f"{lm}3.self_attn.kv_b_proj.weight" in ts and f"{lm}2.self_attn.kv_b_proj.weight" not in ts
    dtype, bias = ts[f"{lm}1.block_sparse_moe.gate.e_score_correction_bias"]
    assert dtype == "F32" and bias[0] > bias[-1]  # skewed toward low-numbered experts
    packed = ts[f"{lm}2.block_sparse_moe.experts.15.w2.weight_packed"][1]
    scales = ts[f"{lm}2.block_sparse_moe.experts.15.w2.weight_scale"][1]
    assert packed.shape == (32, 32) and scales.shape == (32, 2)
    w = unpack_mxfp4(packed, scales)
    assert 0.05 < w.std() < 0.2  # ~1/sqrt(64) after quantization
    experts = [n for n in ts if ".experts." in n]
    assert len(experts) == 3 * 16 * 3 * 2 and all(ts[n][0] == "U8" for n in experts)
    assert {d for n, (d, _) in ts.items() if n not in experts} == {"BF16", "F32"}


def test_mlx_lm_runs_it(loaded):
    model, tok = loaded
    prompt = tok.apply_chat_template([{"role": "user", "content": "route the experts"}], add_generation_prompt=True)
    assert prompt[0] == SPEC.base_vocab + 3 and SPEC.base_vocab + 2 in prompt  # <|open|> ... <|end_of_msg|>
    logits = model(mx.array([prompt])).astype(mx.float32)
    assert logits.shape == (1, len(prompt), SPEC.vocab_size)
    assert mx.isfinite(logits).all().item() and 0.3 < logits.std().item() < 3.0
    assert tok.eos_token_ids == {SPEC.base_vocab + 2}

    # Greedy decoding with the KDA/MLA caches picks the argmax of a full forward pass over the same tokens.
    out = [r.token for r in stream_generate(model, tok, prompt, max_tokens=6)]
    assert len(out) >= 1 and out == [r.token for r in stream_generate(model, tok, prompt, max_tokens=6)]
    for i, t in enumerate(out):
        full = model(mx.array([prompt + out[:i]]))[0, -1].astype(mx.float32)
        assert full[t].item() >= full.max().item() - 0.1


def test_mlx_lm_weights_are_the_file_values(demo, loaded):
    model, _ = loaded
    ts = tensors(demo)
    # mlx-lm keeps A_log per head: of a [heads * head_dim] A_log it uses the first `heads` values.
    a_log = ts["language_model.model.layers.0.self_attn.A_log"][1]
    np.testing.assert_array_equal(np.array(model.layers[0].self_attn.A_log), a_log[: SPEC.kda_num_heads])
    bias = ts["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"][1]
    np.testing.assert_array_equal(np.array(model.layers[1].mlp.e_score_correction_bias), bias)
    for i, layer in enumerate(model.layers):
        if not SPEC.is_moe(i):
            continue
        for src, dst in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            sw = getattr(layer.mlp.switch_mlp, dst)
            names = [f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{src}" for e in range(16)]
            packed = np.stack([ts[f"{n}.weight_packed"][1] for n in names])
            scales = np.stack([ts[f"{n}.weight_scale"][1] for n in names])
            assert np.array_equal(np.array(sw.weight).view(np.uint8), packed)
            deq = mx.dequantize(sw.weight, sw.scales, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
            np.testing.assert_array_equal(np.array(deq), unpack_mxfp4(packed, scales))


def test_ensure_demo_creates_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    path = ensure_demo()
    assert path == tmp_path / "demo" / f"kimi-k3-demo-v{DEMO_VERSION}"
    first = (path / "config.json").stat()
    before = digests(path)
    assert ensure_demo() == path
    again = (path / "config.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # reused, not rewritten
    assert ensure_demo(force=True) == path and digests(path) == before
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [path.name]  # no partial or old directories left

"""The converted format's one home (tqbench.layout): the expert map and quantization block read back what the
conversion wrote, and outputs of MLX-native recipes load in mlx-lm unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from conftest import converted, demo_source
from tqbench.demo import DemoSpec
from tqbench.layout import ExpertMap, QuantizationBlock
from tqbench.quant import turboquant as tq
from tqbench.shards import read_header
from tqbench.source.reader import ShardReader

pytestmark = pytest.mark.slow  # four conversions and mlx-lm loads (~3 s of module setup)

SHARD = 150_000
# The expert width 352 = 11 x 32 has no Hadamard transform of its own length, so the
# routed experts' down_proj (input 96) rotates blockwise.
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=352)


@pytest.fixture(scope="module")
def src() -> Path:
    return demo_source(SPEC)  # shared (read-only)


@pytest.fixture(scope="module")
def outputs(src) -> dict[str, Path]:
    """The conversions, shared with other modules (read-only)."""
    return {name: converted(name, SPEC, SHARD)
            for name in ("tq3a-tqTe-down4-g32", "tq3a-tqTe-down4-g32-norot", "affine4-g64", "src-mxfp4e")}


def _load(path: Path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        return mlx_load(str(path))


def _tensors(root: Path) -> dict[str, tuple]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        for t in read_header(f).tensors:
            out[t.name] = (f, t)
    return out


def test_expert_map_reader_points_at_each_experts_bytes(outputs):
    dst = outputs["tq3a-tqTe-down4-g32"]
    emap = ExpertMap.load(dst)
    tensors = _tensors(dst)
    assert sorted(emap.layers) == [i for i in range(SPEC.num_hidden_layers) if SPEC.is_moe(i)]
    for layer, lay in emap.layers.items():
        assert lay.experts == SPEC.num_experts
        for e in (0, SPEC.num_experts - 1):
            path, offset, length = emap.locate(layer, e)
            blob = path.read_bytes()[offset:offset + length]
            names = list(emap.tensor_names(layer, e))
            assert len(names) == len(lay.tensors) == 6  # gate, up, down: codes and scales
            for name, (key, rng) in zip(names, lay.tensors.items()):
                file, t = tensors[name]
                assert file == path and t.offset == offset + rng.offset and t.nbytes == rng.nbytes
                assert blob[rng.offset:rng.offset + rng.nbytes] == file.read_bytes()[t.offset:t.offset + t.nbytes]


def test_expert_map_errors_name_the_file(outputs, tmp_path):
    from tqbench.errors import CheckpointError

    dst = tmp_path / "broken"
    shutil.copytree(outputs["tq3a-tqTe-down4-g32"], dst)
    doc = json.loads((dst / "expert_map.json").read_text())
    first = next(iter(doc["layers"].values()))
    name, tensor = next(iter(first["tensors"].items()))
    tensor["offset"] = first["length"] - 1  # its bytes run past the expert's
    (dst / "expert_map.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"expert_map.json: layer \d+: tensor '{name}' lies outside"):
        ExpertMap.load(dst)
    tensor["offset"], tensor["bytes"] = 0, first["length"] + 1  # bytes that disagree with its shape
    (dst / "expert_map.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"layer \d+: tensor '{name}': {first['length'] + 1} bytes, but shape"):
        ExpertMap.load(dst)
    (dst / "expert_map.json").write_text("{")
    with pytest.raises(CheckpointError, match="expert_map.json: invalid JSON"):
        ExpertMap.load(dst)


def test_quantization_block_records_every_quantized_module_and_its_rotation(outputs):
    cfg = json.loads((outputs["tq3a-tqTe-down4-g32"] / "config.json").read_text())
    block = QuantizationBlock.from_config(cfg["quantization"])
    down = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"  # a per-expert name finds its layer's entry
    q = block.module(down)
    assert (q.format, q.bits, q.ternary, q.group_size) == ("turboquant", 4, False, 32)
    assert q.rotation == {"kind": "blockwise-hadamard", "block": 32}   # 352 = 11 x 32
    gate = block.module("language_model.model.layers.1.block_sparse_moe.experts.5.w1")
    assert (gate.ternary, gate.bits, gate.rotation) == (True, None, {"kind": "hadamard", "block": 64})
    norot = QuantizationBlock.from_config(
        json.loads((outputs["tq3a-tqTe-down4-g32-norot"] / "config.json").read_text())["quantization"])
    assert norot.module(down).rotation == {"kind": "none", "block": None}
    assert QuantizationBlock.from_config({"quant_method": "compressed-tensors"}) is None


def test_blockwise_rotated_experts_are_stored_with_their_signs_and_decode(src, outputs):
    """The down_proj of input 96 is rotated in blocks of 32 with signs != +1; decoding with the stored signs and the
    recorded rotation gives back the source weights to the quantizer's own error (quantizing them again here)."""
    for name in ("tq3a-tqTe-down4-g32", "tq3a-tqTe-down4-g32-norot"):
        dst = outputs[name]
        tensors = _tensors(dst)
        prefix = "language_model.model.layers.1.block_sparse_moe"
        with ShardReader(dst) as r:
            signs = r.read_mlx(tensors[f"{prefix}.switch_mlp.down_proj.signs"][1])
            book = r.read_mlx(tensors[f"{prefix}.switch_mlp.down_proj.codebook"][1])
            weight = r.read_mlx(tensors[f"{prefix}.experts.3.w2.weight"][1])
            scales = r.read_mlx(tensors[f"{prefix}.experts.3.w2.scales"][1])
        rotated = bool((np.array(signs) < 0).any())
        assert rotated == (name == "tq3a-tqTe-down4-g32")
        w_hat = tq.dequantize(weight, scales, book, signs if rotated else None, SPEC.moe_intermediate_size)
        src_t = _tensors(src)
        with ShardReader(src) as r:
            from tqbench.source.reader import decode_mxfp4
            w = decode_mxfp4(r.read_mlx(src_t[f"{prefix}.experts.3.w2.weight_packed"][1]),
                             r.read_mlx(src_t[f"{prefix}.experts.3.w2.weight_scale"][1]))
        error = (mx.linalg.norm(w_hat - w) / mx.linalg.norm(w)).item()
        again = tq.quantize(w, "4", 32, signs if rotated else None, rule="search")
        assert error == pytest.approx(again.rel_error, rel=1e-3) and error < 0.15


def _prompt_logits(model) -> mx.array:
    tokens = mx.array([[5, 17, 99, 3, 250, 42, 7, 300]])
    return model(tokens).astype(mx.float32)


def test_mxfp4_passthrough_loads_in_mlx_lm_with_the_sources_logits(src, outputs):
    source, _ = _load(src)
    converted, tok = _load(outputs["src-mxfp4e"])
    assert isinstance(converted.layers[1].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert converted.layers[1].mlp.switch_mlp.gate_proj.mode == "mxfp4"
    np.testing.assert_array_equal(np.array(_prompt_logits(converted)), np.array(_prompt_logits(source)))


def test_affine_output_loads_in_mlx_lm_with_the_dequantized_weights_logits(src, outputs):
    """mlx_lm.load of the affine output == the source model whose quantized Linears hold the dequantized weights
    (both computed in float32, so the comparison is of the weights, not of bf16 rounding)."""
    converted, _ = _load(outputs["affine4-g64"])
    reference, _ = _load(src)
    converted.set_dtype(mx.float32)
    reference.set_dtype(mx.float32)
    swapped = 0
    for path, module in converted.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, QuantizedSwitchLinear)):
            continue
        parent = reference
        *parents, leaf = path.split(".")
        for part in parents:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        target = getattr(parent, leaf)
        if module.mode == "mxfp4":  # routed experts the recipe keeps (in % 64 != 0): the source's own bytes
            assert target.mode == "mxfp4"
            np.testing.assert_array_equal(np.array(module.weight), np.array(target.weight))
            continue
        assert (module.mode, module.bits, module.group_size) == ("affine", 4, 64)
        w = mx.dequantize(module.weight, module.scales, module.biases, group_size=64, bits=4)
        if isinstance(target, QuantizedSwitchLinear):  # mxfp4 experts in the source: float experts instead
            *lead, out_dims, in_dims = w.shape
            target = SwitchLinear(in_dims, out_dims, lead[0], bias=False)
            setattr(parent, leaf, target)
            target.weight = w
        else:
            target.weight = w
        swapped += 1
    assert swapped > 10
    np.testing.assert_allclose(np.array(_prompt_logits(converted)), np.array(_prompt_logits(reference)),
                               rtol=1e-5, atol=1e-5)


def test_turboquant_output_is_refused_by_mlx_lm_with_a_clear_error(outputs):
    with pytest.raises(ValueError, match="turboquant"):
        _load(outputs["tq3a-tqTe-down4-g32"])

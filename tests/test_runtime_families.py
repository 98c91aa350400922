"""Other mlx-lm MoE families run like kimi_k3: tiny real qwen3_moe and deepseek_v3 checkpoints in Hugging Face naming
(per-expert `mlp.experts.E.{gate,up,down}_proj`, bf16) are classified by `tqbench inspect`'s summary, convert with
TurboQuant recipes, and the loaded output's logits equal those of mlx-lm's own model of the family holding the
dequantized float weights (read from the converted files and un-rotated by tqbench.quant, not by the runtime).

Each checkpoint gets a tiny real byte-level BPE tokenizer (`tokenizer.json` of the `tokenizers` library), the kind
these families ship: load() needs one (without, transformers fails for deepseek_v3, a one-line LoadError)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model

from model_helpers import logits
from tqbench.convert import convert
from tqbench.layout import QuantizationBlock
from tqbench.quant import turboquant as tq
from tqbench.recipe import Recipe
from tqbench.runtime.layers import TurboQuantLinear, TurboQuantSwitchLinear
from tqbench.runtime.load import LoadError, load
from tqbench.shards.writer import save_shard, to_bf16
from tqbench.source.opening import open_checkpoint
from tqbench.source.summary import summarize

HIDDEN, VOCAB, EXPERTS, TOP_K, LAYERS = 128, 384, 8, 2, 2
# The tokenizer: 256 byte tokens (GPT-2's byte-to-unicode alphabet), three merges, then the special tokens.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = 256 + len(MERGES)  # <|endoftext|>
TEXT = "def the(x): return the + 42"

# qwen3_moe: 2 MoE layers of 8 experts, top-2; the experts' width 192 = 12 x 16 (MLX's 12-point Hadamard factor).
QWEN = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=HIDDEN,
            num_hidden_layers=LAYERS, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=192, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=1e6, tie_word_embeddings=False,
            max_position_embeddings=4096, norm_topk_prob=True, torch_dtype="bfloat16", bos_token_id=None,
            eos_token_id=EOS)

# deepseek_v3: MLA, a dense first layer, then 1 MoE layer of 8 routed experts (sigmoid router with a score correction
# bias, top-2) and 1 shared expert; the experts' width 704 = 11 x 64 has no Hadamard of its own length: the down_proj
# rotates in blocks of 64.
DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB,
                hidden_size=HIDDEN, intermediate_size=256, moe_intermediate_size=704, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=EXPERTS,
                routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=32, v_head_dim=32,
                qk_nope_head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1,
                topk_group=1, num_experts_per_tok=TOP_K, moe_layer_freq=1, first_k_dense_replace=1,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=None,
                eos_token_id=EOS)


def write_tokenizer(dest: Path) -> None:
    """A byte-level BPE `tokenizer.json` (Qwen's and DeepSeek's kind) and its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord))}
    assert len(vocab) == 256
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.token_to_id(SPECIALS[0]) == EOS
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0], "bos_token": None,
        "model_max_length": 4096}, indent=2))


class _Writer:
    """Tensors of one checkpoint from a seeded NumPy RNG, in file order: bf16 Linears scaled by 1/sqrt(in) (so
    activations keep their size through the layers), norms near 1."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, tuple[str, np.ndarray]] = {}

    def linear(self, name: str, out: int, inp: int) -> None:
        w = self.rng.standard_normal((out, inp)).astype(np.float32) / np.sqrt(inp)
        self.tensors[f"{name}.weight"] = ("BF16", to_bf16(w))

    def norm(self, name: str, n: int) -> None:
        self.tensors[f"{name}.weight"] = ("BF16", to_bf16(1 + 0.1 * self.rng.standard_normal(n).astype(np.float32)))

    def embed(self) -> None:
        self.tensors["model.embed_tokens.weight"] = ("BF16", to_bf16(
            self.rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)))

    def experts(self, moe: str, n: int, width: int) -> None:
        for e in range(n):
            self.linear(f"{moe}.experts.{e}.gate_proj", width, HIDDEN)
            self.linear(f"{moe}.experts.{e}.up_proj", width, HIDDEN)
            self.linear(f"{moe}.experts.{e}.down_proj", HIDDEN, width)

    def save(self, dest: Path, config: dict) -> Path:
        self.norm("model.norm", HIDDEN)
        self.linear("lm_head", VOCAB, HIDDEN)
        dest.mkdir(parents=True)
        save_shard(dest / "model.safetensors", self.tensors, {"format": "pt"})
        (dest / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(dest)
        return dest


def write_qwen3_moe(dest: Path, seed: int = 0) -> Path:
    c, w = QWEN, _Writer(seed)
    w.embed()
    for i in range(c["num_hidden_layers"]):
        p, hd = f"model.layers.{i}", c["head_dim"]
        w.norm(f"{p}.input_layernorm", HIDDEN)
        w.linear(f"{p}.self_attn.q_proj", c["num_attention_heads"] * hd, HIDDEN)
        w.linear(f"{p}.self_attn.k_proj", c["num_key_value_heads"] * hd, HIDDEN)
        w.linear(f"{p}.self_attn.v_proj", c["num_key_value_heads"] * hd, HIDDEN)
        w.linear(f"{p}.self_attn.o_proj", HIDDEN, c["num_attention_heads"] * hd)
        w.norm(f"{p}.self_attn.q_norm", hd)
        w.norm(f"{p}.self_attn.k_norm", hd)
        w.norm(f"{p}.post_attention_layernorm", HIDDEN)
        w.linear(f"{p}.mlp.gate", c["num_experts"], HIDDEN)
        w.experts(f"{p}.mlp", c["num_experts"], c["moe_intermediate_size"])
    return w.save(dest, c)


def write_deepseek_v3(dest: Path, seed: int = 0) -> Path:
    c, w = DEEPSEEK, _Writer(seed)
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    w.embed()
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm", HIDDEN)
        w.linear(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], HIDDEN)
        w.norm(f"{p}.self_attn.q_a_layernorm", c["q_lora_rank"])
        w.linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), c["q_lora_rank"])
        w.linear(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + rope, HIDDEN)
        w.norm(f"{p}.self_attn.kv_a_layernorm", c["kv_lora_rank"])
        w.linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), c["kv_lora_rank"])
        w.linear(f"{p}.self_attn.o_proj", HIDDEN, heads * v)
        w.norm(f"{p}.post_attention_layernorm", HIDDEN)
        if i < c["first_k_dense_replace"]:
            w.linear(f"{p}.mlp.gate_proj", c["intermediate_size"], HIDDEN)
            w.linear(f"{p}.mlp.up_proj", c["intermediate_size"], HIDDEN)
            w.linear(f"{p}.mlp.down_proj", HIDDEN, c["intermediate_size"])
            continue
        w.linear(f"{p}.mlp.gate", c["n_routed_experts"], HIDDEN)
        w.tensors[f"{p}.mlp.gate.e_score_correction_bias"] = (
            "F32", (0.1 * w.rng.standard_normal(c["n_routed_experts"])).astype(np.float32))
        w.experts(f"{p}.mlp", c["n_routed_experts"], c["moe_intermediate_size"])
        shared = c["n_shared_experts"] * c["moe_intermediate_size"]
        w.linear(f"{p}.mlp.shared_experts.gate_proj", shared, HIDDEN)
        w.linear(f"{p}.mlp.shared_experts.up_proj", shared, HIDDEN)
        w.linear(f"{p}.mlp.shared_experts.down_proj", HIDDEN, shared)
    return w.save(dest, c)


CASES = [  # (family, recipe)
    ("qwen3_moe", "tq4-g64"),
    ("qwen3_moe", "tq3a-tqTe-down4-g64"),
    ("qwen3_moe", "tq3a-tqTe-down4-g64-norot"),
    ("deepseek_v3", "tq3a-tqTe-down4-g64"),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {"qwen3_moe": write_qwen3_moe(root / "qwen3_moe"), "deepseek_v3": write_deepseek_v3(root / "deepseek_v3")}


@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family, recipe in CASES:
        out[family, recipe] = root / f"{family}-{recipe}"
        list(convert(sources[family], out[family, recipe], Recipe.parse(recipe), 10**9))
    return out


@pytest.mark.parametrize("family, config", [("qwen3_moe", QWEN), ("deepseek_v3", DEEPSEEK)])
def test_inspect_classifies_the_families_experts(sources, family, config):
    s = summarize(open_checkpoint(sources[family]))
    width = config["moe_intermediate_size"]
    moe_layers = LAYERS - config.get("first_k_dense_replace", 0)
    assert (s.model_type, s.format, s.complete) == (family, "bf16", True)
    assert s.experts is not None
    e = s.experts
    assert (e.moe_layers, e.experts_per_layer, e.top_k, e.expert_layers) == (moe_layers, EXPERTS, TOP_K,
                                                                            moe_layers * EXPERTS)
    assert e.params_per_expert == 3 * width * HIDDEN and e.bytes_per_expert == 2 * e.params_per_expert
    assert e.bytes_by_projection == {"gate": 2 * width * HIDDEN, "up": 2 * width * HIDDEN, "down": 2 * width * HIDDEN}
    roles = {g.key: g.tensors for g in s.by_role}
    assert roles["routed_expert"] == 3 * EXPERTS * moe_layers
    assert roles["router"] == moe_layers * (2 if family == "deepseek_v3" else 1)  # + e_score_correction_bias
    assert [(ly.mlp, ly.experts, ly.attention) for ly in s.by_layer] == (
        [("moe", EXPERTS, "generic")] * LAYERS if family == "qwen3_moe"
        else [("dense", 0, "mla")] + [("moe", EXPERTS, "mla")] * moe_layers)
    assert s.active_params == s.params - e.routed_params + TOP_K * e.params_per_expert * moe_layers


def _files(root: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(root.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _module(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent = model
    *parents, leaf = path.split(".")
    for part in parents:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, leaf


def _reference(source: Path, converted: Path) -> tuple[nn.Module, int]:
    """mlx-lm's model of the family from the source, every Linear the conversion quantized holding its dequantized
    float32 weights, read from the converted files (per-expert tensors stacked here); the number of such modules."""
    model, _ = load_model(source)
    model.set_dtype(mx.float32)
    block = QuantizationBlock.from_config(json.loads((converted / "config.json").read_text())["quantization"])
    files = _files(converted)
    n = 0
    for key in sorted(k for k in files if k.endswith(".codebook")):
        p = key[: -len(".codebook")]
        signs, book = files[f"{p}.signs"], files[key]
        q = block.module(p)
        rotation = None if q.rotation["kind"] == "none" else signs
        width = signs.shape[0]
        parent, leaf = _module(model, p)
        target = getattr(parent, leaf)
        if ".switch_mlp." in p:
            moe, proj = p.split(".switch_mlp.")
            w = mx.stack([tq.dequantize(files[f"{moe}.experts.{e}.{proj}.weight"],
                                        files[f"{moe}.experts.{e}.{proj}.scales"], book, rotation, width)
                          for e in range(EXPERTS)])
            assert isinstance(target, SwitchLinear)
        else:
            w = tq.dequantize(files[f"{p}.weight"], files[f"{p}.scales"], book, rotation, width)
            assert isinstance(target, nn.Linear)
        assert target.weight.shape == w.shape
        target.weight = w
        n += 1
    return model, n


@pytest.mark.parametrize("family, recipe", CASES)
def test_turboquant_output_equals_the_familys_model_of_its_dequantized_weights(sources, outputs, family, recipe):
    loaded = load(outputs[family, recipe])
    assert loaded.model_type == family
    prompt = loaded.tokenizer.encode(TEXT)  # the tokenizer the conversion copied
    assert prompt.count(258) == 2 and loaded.tokenizer.decode(prompt) == TEXT and loaded.tokenizer.eos_token_id == EOS
    reference, quantized = _reference(sources[family], outputs[family, recipe])
    # qwen3_moe: 2 x (q, k, v, o + 3 expert projections) + lm_head; deepseek_v3: MLA's q_a, q_b, kv_a, o in both
    # layers, the dense MLP's 3, the shared expert's 3, 3 expert projections, lm_head (kv_b_proj stays bf16)
    assert loaded.turboquant_modules == quantized == {"qwen3_moe": 15, "deepseek_v3": 18}[family]
    model = loaded.model
    model.set_dtype(mx.float32)
    experts = [m for m in model.modules() if isinstance(m, TurboQuantSwitchLinear)]
    dense = [m for m in model.modules() if isinstance(m, TurboQuantLinear)]
    moe_layers = LAYERS - (1 if family == "deepseek_v3" else 0)
    assert len(experts) == 3 * moe_layers and len(experts) + len(dense) == quantized
    assert all(m.num_experts == EXPERTS for m in experts)
    shapes = sorted({(m.output_dims, m.input_dims, m.codebook.shape[0]) for m in experts})  # (out, in, levels)
    width = (QWEN if family == "qwen3_moe" else DEEPSEEK)["moe_intermediate_size"]
    if recipe == "tq4-g64":
        assert shapes == [(HIDDEN, width, 16), (width, HIDDEN, 16)]
        assert {m.codebook.shape[0] for m in dense} == {16}
    else:  # ternary gate and up, 4-bit down; 3-bit everything else
        assert shapes == [(HIDDEN, width, 16), (width, HIDDEN, 3)]
        assert {m.codebook.shape[0] for m in dense} == {8}
    assert {m.group_size for m in experts + dense} == {64}
    rotated = not recipe.endswith("-norot")
    down = [m for m in experts if m.input_dims == width]
    assert {m.block for m in down} == {tq.rotation_block(width) if rotated else None}
    if family == "deepseek_v3":
        assert tq.rotation_block(width) == 64  # 704 = 11 x 64: blockwise
    got, want = logits(model, prompt), logits(reference, prompt)
    scale = np.abs(want).max()
    assert np.isfinite(got).all() and scale > 1
    assert np.abs(got - want).max() <= 1e-4 * scale
    # and the weights are really quantized: the source's own logits differ
    source, _ = load_model(sources[family])
    source.set_dtype(mx.float32)
    assert np.abs(logits(source, prompt) - got).max() > 1e-2 * scale


def test_a_conversion_without_a_tokenizer_is_a_one_line_load_error(outputs, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(outputs["deepseek_v3", "tq3a-tqTe-down4-g64"], bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(LoadError) as e:
        load(bare)
    assert str(e.value) == f"{bare}: no tokenizer files (tokenizer.json, tiktoken.model, tokenizer.model, ...)"
    (bare / "tokenizer.json").write_text("{not json")  # there, but broken: the library's reason, on one line
    with pytest.raises(LoadError) as e:
        load(bare)
    assert str(e.value).startswith(f"{bare}: cannot load its tokenizer (") and "\n" not in str(e.value)

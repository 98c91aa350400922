"""Running converted models (tqbench.runtime): the loaded TurboQuant model computes what its dequantized weights
compute, passthrough is the source, a conversation's second turn reuses the cache and equals a fresh run, and the
trust rule for model code."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchLinear

from conftest import converted, shipped_demo
from model_helpers import logits as _logits
from tqbench.demo import SHIPPED_SPEC
from tqbench.layout import QuantizationBlock
from tqbench.quant import turboquant as tq
from tqbench.recipe import Recipe
from tqbench.runtime.conversation import Conversation, Sampling
from tqbench.events import ReplyDone, ReplyStarted, TokenOut
from tqbench.runtime.layers import TurboQuantConcat, TurboQuantLinear, TurboQuantSwitchLinear
from tqbench.runtime.load import LoadError, load, trust_decision

pytestmark = pytest.mark.slow  # conversions of the demo and model loads (~20 s)

# Ternary gate/up and 4-bit down experts. g32, not the first demo's g64: the shipped demo's experts are 32 wide
# (moe_intermediate_size), so at g64 the down projection (input 32) is kept as the source's mxfp4 ("in % 64 != 0").
RECIPE = "tq3a-tqTe-down4-g32"
L = sum(SHIPPED_SPEC.is_moe(i) for i in range(SHIPPED_SPEC.num_hidden_layers))  # MoE layers


def _turboquant_expert_projections(recipe: str) -> int:
    """Expert projections a recipe quantizes: per MoE layer gate and up (input: the latent size) and down (input:
    moe_intermediate_size), each whose input the expert group size divides (recipe rules: else kept)."""
    g = Recipe.parse(recipe).expert_group_size
    ins = (SHIPPED_SPEC.routed_expert_hidden_size,) * 2 + (SHIPPED_SPEC.moe_intermediate_size,)
    return L * sum(n % g == 0 for n in ins)


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The shipped trained demo (mxfp4 experts) and its conversions, shared with other modules (read-only)."""
    return {"source": shipped_demo(), **{name: converted(name) for name in (RECIPE, "tq4", "src")}}


PROMPT = [4352, 100, 517, 2300, 42, 7, 1311, 260, 9, 88, 1000, 61]


def _module(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent = model
    *parents, leaf = path.split(".")
    for part in parents:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, leaf


def _float(m: TurboQuantLinear | TurboQuantSwitchLinear) -> mx.array:
    """Float weights in the input's own domain, by tqbench.quant's dequantize (un-rotates), not the runtime's path."""
    signs = m.signs if m.block is not None else None
    return tq.dequantize(m.weight, m.scales, m.codebook, signs, m.input_dims)


@pytest.mark.parametrize("recipe", [RECIPE, "tq4"])
def test_turboquant_model_equals_its_dequantized_weights(models, recipe):
    """The loaded TurboQuant model's logits == mlx-lm's model of the same architecture holding the dequantized float
    weights, both in float32."""
    loaded = load(models[recipe])
    reference = mlx_load(str(models["source"]))[0]
    model = loaded.model
    model.set_dtype(mx.float32)
    reference.set_dtype(mx.float32)
    kinds = {"linear": 0, "experts": 0, "concat": 0}
    for path, m in model.named_modules():
        if ".parts." in path:
            continue  # inside a TurboQuantConcat: handled with it
        parent, leaf = _module(reference, path)
        if isinstance(m, TurboQuantConcat):
            getattr(parent, leaf).weight = mx.concatenate([_float(p) for p in m.parts], axis=0)
            kinds["concat"] += 1
        elif isinstance(m, TurboQuantSwitchLinear):
            setattr(parent, leaf, SwitchLinear(m.input_dims, m.output_dims, m.num_experts, bias=False))
            getattr(parent, leaf).weight = _float(m)
            kinds["experts"] += 1
        elif isinstance(m, TurboQuantLinear):
            getattr(parent, leaf).weight = _float(m)
            kinds["linear"] += 1
    assert loaded.turboquant_modules == kinds["linear"] + kinds["experts"] + 3 * kinds["concat"]
    # RECIPE: 7 MoE layers x 3 expert projections; tq4 (g64): x 2, the 32-wide down projection kept mxfp4;
    # 6 KDA layers whose q/k/v mlx-lm fuses into qkv_proj
    assert kinds["experts"] == _turboquant_expert_projections(recipe) == {RECIPE: 3 * L, "tq4": 2 * L}[recipe]
    assert kinds["concat"] == 6 and kinds["linear"] > 40
    got, want = _logits(model, PROMPT), _logits(reference, PROMPT)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # and the weights are really quantized: the source model's logits differ
    source = mlx_load(str(models["source"]))[0]
    source.set_dtype(mx.float32)
    assert np.abs(_logits(source, PROMPT) - got).max() > 1e-2 * np.abs(want).max()


def test_rotation_comes_from_the_recorded_block(models):
    loaded = load(models[RECIPE])
    block = QuantizationBlock.from_config(json.loads((models[RECIPE] / "config.json").read_text())["quantization"])
    q = block.modules["language_model.model.layers.1.block_sparse_moe.switch_mlp.down_proj"]
    m = loaded.model.language_model.model.layers[1].mlp.switch_mlp.down_proj
    # one Hadamard transform of the whole input (moe_intermediate_size, a power of two)
    assert isinstance(m, TurboQuantSwitchLinear)
    assert m.block == q.rotation["block"] == SHIPPED_SPEC.moe_intermediate_size
    assert m.codebook.shape == (16,) and m.group_size == 32  # down4: 4-bit codebook, from the stored tensors
    assert loaded.model.language_model.model.layers[1].mlp.switch_mlp.gate_proj.codebook.shape == (3,)  # ternary


def _greedy(model, tokens: list[int], n: int) -> list[int]:
    return [t for t, _ in zip((int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)), range(n))]


def test_passthrough_generates_the_sources_greedy_tokens(models):
    ours = load(models["src"])
    assert ours.turboquant_modules == 0
    source = mlx_load(str(models["source"]))[0]
    assert _greedy(ours.model, PROMPT, 24) == _greedy(source, PROMPT, 24)
    np.testing.assert_array_equal(_logits(ours.model, PROMPT), _logits(source, PROMPT))


def _run(conv: Conversation, text: str, n: int = 12) -> tuple[ReplyStarted, list[int], ReplyDone]:
    events = list(conv.reply(text, Sampling(max_tokens=n)))
    return events[0], [e.id for e in events if isinstance(e, TokenOut)], events[-1]


def _greedy_gaps(model, prefix: list[int], generated: list[int]) -> np.ndarray:
    """For each generated token, how far its logit is below the largest one, from one forward pass over the whole
    sequence (0 where it is the argmax)."""
    logits = _logits(model, prefix + generated[:-1])[0, len(prefix) - 1:]
    return logits.max(axis=1) - logits[np.arange(len(generated)), generated]


def test_second_turn_processes_only_its_new_tokens_and_equals_a_fresh_run(models):
    loaded = load(models["tq4"])
    conv = Conversation(loaded=loaded)
    s1, t1, d1 = _run(conv, "def fib(n):")
    assert s1.cached_tokens == 0
    assert d1.generated_tokens == len(conv.tokens) - s1.prompt_tokens
    full2 = conv.conversation_tokens("class Node:")
    assert full2[: len(conv.tokens)] == conv.tokens  # the template extends what the cache holds
    s2, t2, d2 = _run(conv, "class Node:")
    assert s2.cached_tokens == s1.prompt_tokens + d1.generated_tokens
    assert s2.prompt_tokens == len(full2) - s2.cached_tokens == d2.prompt_tokens
    # a fresh conversation given the whole history at once
    fresh = Conversation(loaded=loaded)
    fresh.messages = list(conv.messages[:-2])
    s3, t3, _ = _run(fresh, "class Node:")
    assert s3.cached_tokens == 0 and s3.prompt_tokens == len(full2)
    assert len(t2) == len(t3) == 12
    # Both are greedy decodes of the same history: every token is the argmax of one forward pass over the whole
    # sequence, up to the logits' bf16 rounding (a cached prefix and a one-pass prefill of it differ by an ulp or two,
    # 0.0625 at the demo's logits of ~13: enough to swap a near tie, as 95 and 506 after this history's first token).
    # A cache that lost or repeated tokens would put the cached reply's tokens far below the argmax.
    for generated in (t2, t3):
        gaps = _greedy_gaps(loaded.model, full2, generated)
        assert (gaps <= 0.25).all(), gaps
    assert t2[0] == t3[0]


def test_a_stopped_reply_keeps_the_conversation_consistent(models):
    conv = Conversation(loaded=load(models["tq4"]))
    gen = conv.reply("import os", Sampling(max_tokens=30))
    started, tokens = next(gen), []
    while len(tokens) < 4:  # the prompt's progress, then 4 tokens
        ev = next(gen)
        if isinstance(ev, TokenOut):
            tokens.append(ev)
    gen.close()
    assert conv.last.finish_reason == "cancelled" and conv.last.generated_tokens == 4
    assert conv.messages[-1] == {"role": "assistant", "content": "".join(e.text for e in tokens)}
    assert len(conv.tokens) == started.prompt_tokens + 4
    s, _, _ = _run(conv, "print(1)")
    assert s.cached_tokens > 0  # still reused


def test_sampling_defaults_come_from_generation_config():
    gc = {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert Sampling.defaults(gc) == Sampling(max_tokens=64, temp=0.7, top_p=0.9, top_k=20, seed=None)
    assert Sampling.defaults(gc, temp=0.0, max_tokens=None) == Sampling(max_tokens=64, temp=0.0, top_p=0.9, top_k=20,
                                                                        seed=None)
    assert Sampling.defaults({"do_sample": False, "temperature": 0.6}) == Sampling(max_tokens=512, temp=0.0, top_p=0.0,
                                                                                   top_k=0, seed=None)


# ---- the trust rule ---------------------------------------------------------------------------------------------------

def _model_dir(root: Path, model_type: str, remote_code: bool) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    tc = {"tokenizer_class": "TikTokenTokenizer"}
    if remote_code:
        tc["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (root / "tokenizer_config.json").write_text(json.dumps(tc))
    return root


def test_trust_rule(tmp_path):
    k3 = _model_dir(tmp_path / "k3", "kimi_k3", True)
    other = _model_dir(tmp_path / "other", "qwen3_moe", True)
    plain = _model_dir(tmp_path / "plain", "qwen3_moe", False)
    assert trust_decision(str(k3), False) is True  # a local K3 directory the user named
    assert trust_decision(str(plain), False) is False  # nothing to trust
    with pytest.raises(LoadError, match=r"other: its tokenizer is Python code .* pass --trust-remote-code"):
        trust_decision(str(other), False)
    assert trust_decision(str(other), True) is True
    with pytest.raises(LoadError, match=r"moonshotai/Kimi-K3: not a local model directory.*--trust-remote-code"):
        trust_decision("moonshotai/Kimi-K3", False)
    assert trust_decision("moonshotai/Kimi-K3", True) is True
    # a path someone typed is said to be missing, or not a directory, before any word of hubs or remote code
    for missing in (tmp_path / "nope", tmp_path / "nope" / "model", "./nope", "~/nope-tqbench", "a/b/c"):
        for trust in (False, True):
            with pytest.raises(LoadError) as e:
                trust_decision(str(missing), trust)
            assert str(e.value) == f"{missing}: no such model directory"
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(LoadError) as e:
        trust_decision(str(notes), False)
    assert str(e.value) == f"{notes}: not a directory (give the model's directory)"


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(LoadError, match=r"no config.json: not a model directory"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    with pytest.raises(LoadError, match=r"mlx-lm [0-9.]+ has no architecture for model_type 'no_such_family'"):
        load(tmp_path)

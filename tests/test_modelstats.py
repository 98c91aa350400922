"""Routing capture on a small random demo model: the recorded expert ids are the router's top-k, recomputed here from
the gate's scores; capturing changes neither the outputs nor the gradients, and leaves the model as it was."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from tqbench.demo import DemoSpec, source_config, write_source
from training.modelstats import capture_routing, moe_blocks, trace_routing

SPEC = DemoSpec()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        m, _ = load(str(write_source(tmp_path_factory.mktemp("demo") / "demo", SPEC, seed=5)))
    return m


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SPEC.base_vocab, n).astype(np.int32)


class ScoreTap(nn.Module):
    """The test's own view of a router: the gate's output, recorded."""

    def __init__(self, gate, out):
        super().__init__()
        self.gate = gate
        self.out = out.append

    def __call__(self, x):
        y = self.gate(x)
        self.out(y)
        return y


def test_captured_routing_is_the_top_k_of_the_router_scores(model):
    blocks = [model.layers[i].mlp for i in range(SPEC.num_hidden_layers) if SPEC.is_moe(i)]  # in forward order
    assert len(moe_blocks(model)) == len(blocks) and {id(b) for b in moe_blocks(model)} == {id(b) for b in blocks}
    scores: list = []
    gates = [b.gate for b in blocks]
    for b in blocks:
        b.gate = ScoreTap(b.gate, scores)
    try:
        x = mx.array(tokens(2 * 24).reshape(2, 24))
        with capture_routing(model) as calls:
            mx.eval(model(x))
    finally:
        for b, g in zip(blocks, gates):
            b.gate = g
    assert len(calls) == len(scores) == len(blocks)
    k = SPEC.num_experts_per_token
    for picked, s, b in zip(calls, scores, blocks):
        # kimi_k3's selection: sigmoid of the scores plus the correction bias, the k largest (one expert group).
        biased = 1 / (1 + np.exp(-np.array(s.astype(mx.float32), np.float64))) + np.array(b.e_score_correction_bias)
        want = np.sort(np.argsort(-biased, axis=-1)[..., :k], axis=-1)
        got = np.array(picked)
        assert got.shape == (2, 24, k)
        np.testing.assert_array_equal(np.sort(got, axis=-1), want)


def test_capture_changes_nothing(model):
    x = mx.array(tokens(40, seed=1).reshape(2, 20))
    names = [k for k, _ in tree_flatten(model.parameters())]
    plain = model(x)
    with capture_routing(model) as calls:
        captured = model(x)
    assert len(calls) == len(moe_blocks(model))
    np.testing.assert_array_equal(np.array(captured.astype(mx.float32)), np.array(plain.astype(mx.float32)))
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert all(not k.startswith("switch_mlp.experts") for k in names)


def test_capture_keeps_training_gradients():
    """value_and_grad with the capture inside the loss (as scripts/train_demo.py trains) gives the same loss and
    gradients, the experts' included, on a float model."""
    from mlx_lm.models import kimi_k3

    mx.random.seed(0)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(source_config(SPEC)))
    x = mx.array(tokens(40, seed=1).reshape(2, 20))
    y = mx.array(tokens(40, seed=2).reshape(2, 20))

    def loss(m, x, y, capture):
        if capture:
            with capture_routing(m):
                logits = m(x)
        else:
            logits = m(x)
        return nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")

    l1, g1 = nn.value_and_grad(model, lambda m, a, b: loss(m, a, b, False))(model, x, y)
    l2, g2 = nn.value_and_grad(model, lambda m, a, b: loss(m, a, b, True))(model, x, y)
    assert l1.item() == l2.item()
    f1, f2 = dict(tree_flatten(g1)), dict(tree_flatten(g2))
    assert f1.keys() == f2.keys() and any(".switch_mlp." in k for k in f1)
    for key in f1:
        np.testing.assert_array_equal(np.array(f1[key]), np.array(f2[key]), err_msg=key)


def test_trace_routing_stacks_windows(model):
    t = tokens(3 * 16 + 1, seed=3)
    trace = trace_routing(model, t, window=16, batch=2)
    assert trace.dtype == np.int16 and trace.shape == (len(moe_blocks(model)), 3 * 16, SPEC.num_experts_per_token)
    with capture_routing(model) as calls:
        mx.eval(model(mx.array(t[32:48][None])))
    np.testing.assert_array_equal(trace[:, 32:48], np.stack([np.array(c)[0] for c in calls]))

"""The chunked gated delta rule used to train the demo (training.delta) against mlx-lm's per-time-step loop:
the same outputs, final states and gradients, and the same loss and gradients of a real kimi_k3 model in training."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from mlx_lm.models.gated_delta import gated_delta_ops

from tqbench.demo import TRAINED_SPEC, source_config
from training.delta import chunked_gated_delta, chunked_kda_training


def inputs(B=2, T=37, H=2, Dk=8, Dv=6, seed=0, lower=-5.0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, H, Dk))
    k = mx.random.normal((B, T, H, Dk))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk ** -0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, H, Dv))
    g = mx.exp(lower * mx.sigmoid(mx.random.normal((B, T, H, Dk))))  # K3's gate: log decay in [lower, 0]
    beta = mx.sigmoid(mx.random.normal((B, T, H)))
    state = 0.3 * mx.random.normal((B, H, Dv, Dk))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 16, 32, 64, 128])
def test_values_and_state_match_the_loop(chunk):
    args = inputs()
    y0, s0 = gated_delta_ops(*args)
    y1, s1 = chunked_gated_delta(*args, chunk=chunk)  # T = 37: the last chunk is padded
    assert y1.shape == y0.shape and s1.shape == s0.shape
    np.testing.assert_allclose(np.array(y1), np.array(y0), rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(np.array(s1), np.array(s0), rtol=1e-4, atol=2e-6)
    assert float(mx.abs(y0).max()) > 0.1  # not a trivially small output


def test_strong_decay_does_not_overflow():
    # log decay -20 per step: over a 16-step chunk exp(+320) would overflow if any exponent were positive.
    args = inputs(T=32, lower=-20.0)
    y0, s0 = gated_delta_ops(*args)
    y1, s1 = chunked_gated_delta(*args, chunk=16)
    assert bool(mx.isfinite(y1).all()) and bool(mx.isfinite(s1).all())
    np.testing.assert_allclose(np.array(y1), np.array(y0), rtol=1e-4, atol=2e-6)


def test_gradients_match_the_loop():
    q, k, v, g, beta, state = inputs(T=20)

    def loss(f):
        def fn(*a):
            y, s = f(*a)
            return (y * y).sum() + 0.5 * (s * s).sum() + (y * mx.arange(y.shape[-1])).sum()
        return fn

    argnums = tuple(range(6))
    ref = mx.grad(loss(gated_delta_ops), argnums=argnums)(q, k, v, g, beta, state)
    got = mx.grad(loss(lambda *a: chunked_gated_delta(*a, chunk=8)), argnums=argnums)(q, k, v, g, beta, state)
    for name, a, b in zip("q k v g beta state".split(), ref, got):
        scale = float(mx.abs(a).max())
        assert scale > 1e-3, name
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-3, atol=1e-5 * scale, err_msg=name)


def test_bad_arguments_are_refused():
    q, k, v, g, beta, state = inputs(T=8)
    with pytest.raises(ValueError, match="power of two"):
        chunked_gated_delta(q, k, v, g, beta, state, chunk=6)
    with pytest.raises(ValueError, match="per-key gate"):
        chunked_gated_delta(q, k, v, g[..., 0], beta, state)


def test_a_kimi_k3_training_step_is_the_same_through_the_patch():
    mx.random.seed(3)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(source_config(TRAINED_SPEC)))
    model.train()
    x = mx.random.randint(0, TRAINED_SPEC.vocab_size, (2, 33), key=mx.random.key(4))

    def loss_fn(m, xb, yb):
        return nn.losses.cross_entropy(m(xb).astype(mx.float32), yb, reduction="mean")

    vg = nn.value_and_grad(model, loss_fn)
    loss0, grads0 = vg(model, x[:, :-1], x[:, 1:])
    original = kimi_k3.gated_delta_update
    with chunked_kda_training(chunk=8):
        assert kimi_k3.gated_delta_update is not original
        loss1, grads1 = vg(model, x[:, :-1], x[:, 1:])
    assert kimi_k3.gated_delta_update is original  # restored
    assert abs(loss1.item() - loss0.item()) < 1e-5 * abs(loss0.item())
    g0, g1 = dict(tree_flatten(grads0)), dict(tree_flatten(grads1))
    kda = [n for n in g0 if ".self_attn." in n and ("A_log" in n or "f_b_proj" in n)]
    assert kda  # the KDA parameters get gradients through the recurrence
    for name in g0:
        scale = float(mx.abs(g0[name]).max())
        np.testing.assert_allclose(np.array(g1[name]), np.array(g0[name]), rtol=1e-3, atol=1e-4 * scale + 1e-9,
                                   err_msg=name)
    # Outside training (the kernel path, masks, caches) nothing changes: eval-mode logits are bit-identical.
    model.eval()
    ref = model(x[:, :8])
    with chunked_kda_training():
        assert mx.array_equal(model(x[:, :8]), ref)

"""FlatAdamW (training.flat_adamw) against MLX's own optimizers: the same parameter groups through
`mlx.optimizers.MultiOptimizer` of `AdamW`s, after `mlx.optimizers.clip_grad_norm`, must give the same parameters,
step after step, and a saved and reloaded state must continue exactly as an unbroken run."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from training.flat_adamw import FlatAdamW

ROUTER = lambda path, p: path.endswith("gate.weight")  # noqa: E731
MATRIX = lambda path, p: p.ndim >= 2 and "norm" not in path  # noqa: E731


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.RMSNorm(16)
        self.gate = nn.Linear(16, 8, bias=False)
        self.mlp = nn.Linear(16, 32)
        self.out = nn.Linear(32 + 8, 50)
        self.frozen = mx.ones(3)  # a parameter no gradient reaches (as the router's correction bias)
        self.freeze(keys=["frozen"])

    def __call__(self, x):
        h = self.norm(self.embed(x))
        return self.out(mx.concatenate([nn.gelu(self.mlp(h)), mx.sigmoid(self.gate(h))], axis=-1))


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def reference_optimizer():
    adamw = lambda wd: optim.AdamW(learning_rate=0.0, betas=[0.9, 0.95], eps=1e-8, weight_decay=wd)  # noqa: E731
    return optim.MultiOptimizer([adamw(0.0), adamw(0.1), adamw(0.0)], [ROUTER, MATRIX]), [0.1, 1.0, 1.0]


def flat_optimizer():
    return FlatAdamW(0.0, [(ROUTER, 0.1, 0.0), (MATRIX, 1.0, 0.1)], default=(1.0, 0.0), betas=(0.9, 0.95), eps=1e-8)


def batches(n):
    rng = np.random.default_rng(3)
    return [(mx.array(rng.integers(0, 50, (4, 12))), mx.array(rng.integers(0, 50, (4, 12)))) for _ in range(n)]


def run(kind, data, lrs, clip=0.43, model=None, opt=None):
    mx.random.seed(0)
    model = model or Tiny()
    opt = opt or (reference_optimizer() if kind == "mlx" else (flat_optimizer(), None))
    step_grad = nn.value_and_grad(model, loss_fn)
    norms = []
    for (x, y), lr in zip(data, lrs):
        _, g = step_grad(model, x, y)
        if kind == "mlx":
            ref, mults = opt
            for o, m in zip(ref.optimizers, mults):
                o.learning_rate = lr * m
            g, norm = optim.clip_grad_norm(g, clip)
            ref.update(model, g)
        else:
            opt[0].learning_rate = lr
            norm = opt[0].clip_and_update(model, g, clip)
        mx.eval(model.parameters(), norm)
        norms.append(norm.item())
    return model, opt, norms


def test_flat_adamw_equals_mlx_adamw_with_groups_and_clipping():
    data = batches(8)
    lrs = [3e-2, 3e-2, 2e-2, 2e-2, 1e-2, 1e-2, 5e-3, 5e-3]
    ref, _, ref_norms = run("mlx", data, lrs)
    flat, opt, flat_norms = run("flat", data, lrs)
    assert opt[0].step.item() == 8
    np.testing.assert_allclose(flat_norms, ref_norms, rtol=1e-5)
    assert max(ref_norms) > 0.43 > min(ref_norms)  # clipped on some steps and not on others: both paths compared
    start = dict(tree_flatten(Tiny().parameters()))
    moved = 0
    for (path, a), (path2, b) in zip(tree_flatten(ref.parameters()), tree_flatten(flat.parameters())):
        assert path == path2
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=2e-5, atol=2e-7, err_msg=path)
        moved += not np.array_equal(np.array(a), np.array(start[path]))
    assert moved == len(start) - 1  # every trainable parameter moved; the frozen one did not
    assert np.array_equal(np.array(flat.frozen), np.ones(3))


def test_router_group_moves_at_its_multiplier_and_decay_only_where_asked():
    """One step from zero moments: Adam's first step is lr * g / (|g| + eps) elementwise, so each parameter moves by
    about its group's learning rate (times 1 - lr * wd for the decayed matrices)."""
    mx.random.seed(0)
    model = Tiny()
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    opt = FlatAdamW(0.01, [(ROUTER, 0.1, 0.0), (MATRIX, 1.0, 0.5)], default=(1.0, 0.0), betas=(0.0, 0.0), eps=1e-30)
    _, grads = nn.value_and_grad(model, loss_fn)(model, *batches(1)[0])
    g = {k: np.array(v) for k, v in tree_flatten(grads)}
    opt.update(model, grads)
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for path, gv in g.items():
        mult, wd = (0.1, 0.0) if path == "gate.weight" else (1.0, 0.5) if before[path].ndim >= 2 and "norm" not in path \
            else (1.0, 0.0)
        lr = 0.01 * mult
        expect = before[path] * (1 - lr * wd) - lr * np.sign(gv)
        np.testing.assert_allclose(after[path], expect, rtol=1e-5, atol=1e-7, err_msg=path)


def test_a_saved_state_continues_exactly():
    """The state as train_demo.py saves it (tree_flatten of `state`, loaded into a fresh optimizer by path) gives the
    same parameters as an unbroken run."""
    data = batches(6)
    lrs = [1e-2] * 6
    whole, _, _ = run("flat", data, lrs)
    first, opt, _ = run("flat", data[:3], lrs[:3])
    saved = dict(tree_flatten(opt[0].state))
    params = dict(tree_flatten(first.parameters()))
    assert set(saved) == {"step", "learning_rate", "m", "v"}
    mx.random.seed(0)
    model = Tiny()
    model.load_weights(list(params.items()))
    fresh = flat_optimizer()
    fresh.init(model.trainable_parameters())
    fresh.state = tree_map_with_path(lambda path, _: saved[path], fresh.state)
    resumed, _, _ = run("flat", data[3:], lrs[3:], model=model, opt=(fresh, None))
    for (path, a), (_, b) in zip(tree_flatten(whole.parameters()), tree_flatten(resumed.parameters())):
        assert np.array_equal(np.array(a), np.array(b)), path


def test_the_norm_of_a_long_vector_is_exact_to_float32_rounding():
    """The clip norm of all 22 M parameters' gradients is one long sum: blocked, it agrees with a float64 sum (a plain
    float32 sum of the whole vector on MLX's CPU came out 0.8% low on the demo's gradients)."""
    from training.flat_adamw import sum_of_squares

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(22_175_768) * rng.choice([1e-4, 1e-2, 1.0], 22_175_768, p=[0.9, 0.09, 0.01]))
    x = x.astype(np.float32)
    exact = float((x.astype(np.float64) ** 2).sum())
    assert abs(sum_of_squares(mx.array(x)).item() / exact - 1) < 1e-5
    assert abs(sum_of_squares(mx.array(x[:1000])).item() / float((x[:1000].astype(np.float64) ** 2).sum()) - 1) < 1e-5

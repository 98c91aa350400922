"""AdamW over all of a model's trainable parameters as one vector, for training the demo.

MLX's optimizers update a model one parameter at a time: for the chat demo's 204 trainable tensors, gradient clipping
and AdamW are about 3,900 small kernels a step, a third of the whole step's (`docs/demo-model.md`). On a GPU a step of
this small model costs about the same at any batch up to 64, i.e. it is bound by the number of kernels, not by
arithmetic. `FlatAdamW` concatenates the gradients and the parameters into one vector each, keeps the moments as one
vector each, and updates them with a few whole-vector operations; the new parameters go back to the model as views of
the updated vector. The arithmetic is MLX's AdamW (`mlx.optimizers.AdamW`, no bias correction) and MLX's
`clip_grad_norm`; `tests/test_demo_flat_adamw.py` checks the updates against them.

Parameter groups, as `mlx.optimizers.MultiOptimizer`'s filters: `groups` is a list of (filter(path, array), learning
rate multiplier, weight decay); a parameter takes the first group whose filter accepts it, else `default`.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

Group = tuple[Callable[[str, mx.array], bool], float, float]


class FlatAdamW(optim.Optimizer):
    def __init__(self, learning_rate: float, groups: list[Group] = (), default: tuple[float, float] = (1.0, 0.01),
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.groups, self.default = list(groups), default
        self.betas, self.eps = betas, eps
        self._layout: list[tuple[str, tuple[int, ...], int]] = []

    def init(self, parameters: dict) -> None:
        """The layout (every trainable parameter's path, shape and offset in the vector, in `tree_flatten` order),
        the per-element learning-rate multipliers and weight decays; zero moments unless the state already holds
        them (a resumed run sets `state` first)."""
        flat = tree_flatten(parameters)
        self._layout = [(path, tuple(p.shape), p.size) for path, p in flat]
        mult, decay = [], []
        for path, p in flat:
            m, wd = next(((m, wd) for accept, m, wd in self.groups if accept(path, p)), self.default)
            mult.append(np.full(p.size, m, np.float32))
            decay.append(np.full(p.size, wd, np.float32))
        self._mult = mx.array(np.concatenate(mult))
        self._decay = mx.array(np.concatenate(decay))
        n = sum(size for _, _, size in self._layout)
        if "m" not in self.state:
            self.state["m"] = mx.zeros(n, mx.float32)
            self.state["v"] = mx.zeros(n, mx.float32)
        if self.state["m"].shape != (n,):
            raise ValueError(f"optimizer state holds {self.state['m'].size} values, the parameters {n}")
        self._initialized = True

    def _vector(self, tree: dict) -> mx.array:
        items = dict(tree_flatten(tree))
        return mx.concatenate([items[path].reshape(-1) for path, _, _ in self._layout])

    def _update(self, g: mx.array, p: mx.array) -> dict:
        for name, schedule in self._schedulers.items():
            self.state[name] = schedule(self.step)
        self.state["step"] = self.step + 1
        b1, b2 = self.betas
        lr = self.learning_rate.astype(mx.float32) * self._mult
        m = b1 * self.state["m"] + (1 - b1) * g
        v = b2 * self.state["v"] + (1 - b2) * mx.square(g)
        self.state["m"], self.state["v"] = m, v
        p = p * (1 - lr * self._decay)  # AdamW's decoupled decay, then Adam's step (as MLX orders them)
        p = p - lr * m / (mx.sqrt(v) + self.eps)
        out, offset = [], 0
        for path, shape, size in self._layout:
            out.append((path, p[offset: offset + size].reshape(shape)))
            offset += size
        return tree_unflatten(out)

    def apply_gradients(self, gradients: dict, parameters: dict) -> dict:
        if not self._initialized:
            self.init(gradients)
        return self._update(self._vector(gradients), self._vector(parameters))

    def clip_and_update(self, model, gradients: dict, max_norm: float) -> mx.array:
        """`mlx.optimizers.clip_grad_norm(gradients, max_norm)` then `update(model, ...)`, on the one vector; returns
        the gradients' norm before clipping."""
        if not self._initialized:
            self.init(gradients)
        g = self._vector(gradients)
        norm = mx.sqrt(sum_of_squares(g))
        g = g * mx.minimum(max_norm / (norm + 1e-6), 1.0)
        model.update(self._update(g, self._vector(model.parameters())))
        return norm


def sum_of_squares(x: mx.array, block: int = 4096) -> mx.array:
    """sum(x**2) of a long vector, block by block: MLX's CPU sum of one float32 vector of 22 M values accumulates in
    order and came out 1.6% low (the norm 0.8%); sums of 4,096-value blocks, then of the blocks, are as exact as
    the per-parameter sums MLX's clip_grad_norm adds up."""
    n = x.size // block * block
    total = mx.square(x[:n]).reshape(-1, block).sum(axis=1).sum()
    return total + mx.square(x[n:]).sum() if n < x.size else total
